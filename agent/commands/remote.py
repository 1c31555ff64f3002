"""`edge-agent devices shell|forward|sessions|close`: remote sessions on devices through the leader
(docs/remote.md), run where the leader runs, by an operator whose user name the leader's
`[remote]` gives the right.

    edge-agent devices shell --config leader.toml ID [-- COMMAND ...]    a command (its exit code), or
                                                                         a login shell on a terminal
    edge-agent devices forward ID [LISTEN:]LOCAL:HOST:PORT --config ...  ssh -L's shape: connections to
                                                                         LOCAL reach HOST:PORT as the
                                                                         device sees it
    edge-agent devices logs --config ... ID [--since 1h] [--unit NAME]   a log bundle (gzip), resumable
    edge-agent devices sessions [--open] [--json] --config ...          the audit record, newest first
    edge-agent devices close SID --config ...                            end an open session
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from agent.core.config import AgentConfig, load_config, resolve
from agent.core.errors import ConfigError, EdgeAgentError

ACTIONS = ("shell", "forward", "logs", "sessions", "close")


def add_arguments(sub: Any, where: Any) -> None:
    shell = where(sub.add_parser("shell", help="run a command (or a login shell) on a device, through the leader"))
    shell.add_argument("device", metavar="ID")
    shell.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                       help="what to run (after --); none: a login shell")
    forward = where(sub.add_parser("forward", help="carry a local port's connections to an address on the device"))
    forward.add_argument("device", metavar="ID")
    forward.add_argument("spec", metavar="[LISTEN:]LOCAL:HOST:PORT",
                         help="as ssh -L: e.g. 8080:127.0.0.1:80 (LISTEN defaults to 127.0.0.1)")
    logs = where(sub.add_parser("logs", help="fetch a device's log bundle (its journal and the agent's own log)"))
    logs.add_argument("device", metavar="ID")
    logs.add_argument("--since", default="1h", help="how far back (default 1h; e.g. 30m, 2d)")
    logs.add_argument("--unit", action="append", default=[], metavar="NAME",
                      help="only this unit's journal (repeat; default every unit)")
    logs.add_argument("--out", metavar="FILE", help="where to write it (default ID-logs.txt.gz); a cut download"
                                                    " goes on when run again")
    sessions = where(sub.add_parser("sessions", help="the remote sessions on record, newest first"))
    sessions.add_argument("--open", action="store_true", help="only those still open")
    sessions.add_argument("--json", action="store_true", help="one JSON object per line (the audit export)")
    sessions.add_argument("--limit", type=int, default=100)
    close = where(sub.add_parser("close", help="end an open remote session"))
    close.add_argument("sid", metavar="SID")


def forward_spec(text: str) -> tuple[str, int, str, int]:
    """(listen address, local port, host, port) of `[LISTEN:]LOCAL:HOST:PORT`."""
    parts = text.split(":")
    if len(parts) == 3:
        parts = ["127.0.0.1", *parts]
    if len(parts) != 4 or not parts[1].isdigit() or not parts[3].isdigit() or not parts[2]:
        raise ConfigError("forward", None, f"{text!r} is not [LISTEN:]LOCAL:HOST:PORT (e.g. 8080:127.0.0.1:80)")
    local, port = int(parts[1]), int(parts[3])
    if not 0 <= local <= 65535 or not 1 <= port <= 65535:
        raise ConfigError("forward", None, f"{text!r}: ports are 1 to 65535 (LOCAL 0: any free port)")
    return parts[0], local, parts[2], port


def _socket(config: AgentConfig, path: str) -> Path:
    if config.agent.role != "leader":
        raise ConfigError(path, "agent.role", "remote sessions go through a leader: give its config")
    return resolve(Path(config.agent.data_dir), config.remote.socket)


def main(args: argparse.Namespace) -> int:
    from agent.remote.operator import FAILED, SessionRefused, close_session, forward, shell

    try:
        config = load_config(args.config)
        if args.action == "sessions":
            return _sessions(config, args)
        socket = _socket(config, args.config)
        if args.action == "shell":
            command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
            return asyncio.run(shell(socket, args.device, command))
        if args.action == "logs":
            return _logs(socket, args)
        if args.action == "close":
            print(asyncio.run(close_session(socket, args.sid)))
            return 0
        listen, local, host, port = forward_spec(args.spec)

        def ready(bound: int) -> None:
            print(f"forwarding {listen}:{bound} to {host}:{port} on {args.device} (Ctrl-C ends it)", flush=True)

        try:
            asyncio.run(forward(socket, args.device, (listen, local), host, port, ready=ready,
                                say=lambda text: print(text, file=sys.stderr, flush=True)))
        except KeyboardInterrupt:
            return 0
        return 0
    except SessionRefused as exc:
        print(f"edge-agent devices {args.action}: refused: {exc}", file=sys.stderr)
        return FAILED if args.action == "shell" else 1
    except OSError as exc:
        print(f"edge-agent devices {args.action}: {exc.strerror or exc}", file=sys.stderr)
        return FAILED if args.action == "shell" else 1
    except EdgeAgentError as exc:
        print(f"edge-agent devices: {exc}", file=sys.stderr)
        return 2


def _logs(socket: Path, args: argparse.Namespace) -> int:
    from agent.core.durations import parse_seconds
    from agent.remote.operator import logs

    try:
        since = int(parse_seconds(args.since))
    except ValueError:
        raise ConfigError("--since", None, f"{args.since!r} is not a duration (e.g. 30m, 1h, 2d)") from None
    if not 60 <= since <= 31 * 86_400:
        raise ConfigError("--since", None, "from 1m to 31d")
    for unit in args.unit:
        if not re.fullmatch(r"[A-Za-z0-9:_.@*-]{1,255}", unit):
            raise ConfigError("--unit", None, f"{unit!r} is not a unit name")
    out = Path(args.out or f"{args.device}-logs.txt.gz")
    started = time.monotonic()
    size = asyncio.run(logs(socket, args.device, out, since_s=since, units=tuple(args.unit),
                            say=lambda text: print(text, flush=True)))
    print(f"wrote {out} ({size:,} bytes in {time.monotonic() - started:.1f} s; zcat to read it)")
    return 0


def _sessions(config: AgentConfig, args: argparse.Namespace) -> int:
    from agent.leader.database import LEADER_DB, shared_database
    from agent.leader.readonly import open_leader_db

    shared = shared_database(config, Path(config.agent.data_dir))
    with open_leader_db(Path(config.agent.data_dir) / LEADER_DB, shared=shared) as db:
        records = db.sessions.sessions(open_only=args.open, limit=max(1, args.limit))
    if args.json:
        for r in records:
            print(json.dumps(r.as_json(), sort_keys=True))
        return 0
    if not records:
        print("no remote sessions on record" + (" open" if args.open else ""))
        return 0
    for r in records:
        opened = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.opened_ms / 1000))
        took = f"{(r.closed_ms - r.opened_ms) / 1000:.0f}s" if r.closed_ms else "open"
        code = f" exit {r.exit_code}" if r.exit_code is not None else ""
        print(f"{r.sid}  {opened}  {r.operator:<12} {r.op:<7} {r.device_id:<16} {r.target[:40]:<40} {r.state:<8}"
              f" {took:>6}  {r.bytes_to_device}/{r.bytes_from_device} B{code}  {r.reason}")
    return 0


__all__ = ["ACTIONS", "add_arguments", "forward_spec", "main"]
