"""`edge-agent send CLASS (--json TEXT | --file F | -) [--key K] [--ttl 1h]`: hand the agent one
message from a shell script, through the local API of the worker running on this device.

    edge-agent send telemetry --config /etc/edge-agent/worker.toml --json '{"t": 21.5}'
    sensor-read | edge-agent send events --config worker.toml -
    edge-agent send state --key door --json '"open"' --socket /run/edge-agent/api.sock

It prints the message id and exits 0 once the message is durable (the leader or this device's
outbox holds it). `--app-id ID` names the message: a script that runs the same command again
(after exit status 3 or 4, or a reboot) with the same name gets the first message's id back
(printed with "duplicate" on standard error), never a second copy.
Exit status: 2 a usage error or a message the agent refuses as wrong (unknown class, bad field,
too large); 3 not taken now, try again later (the class is full: 429, or the
outbox cannot store: 503); 4 no agent answers on the socket.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_OK = 0
EXIT_REFUSED = 2
EXIT_LATER = 3
EXIT_UNAVAILABLE = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("cls", metavar="CLASS", help="the message class ([classes.NAME] of the worker's config)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", metavar="FILE", help="the worker's config (says where its socket is)")
    where.add_argument("--socket", metavar="PATH", help="the local API socket itself")
    parser.add_argument("--json", metavar="TEXT", help="the payload, a JSON value")
    parser.add_argument("--file", metavar="FILE", help="the payload, a file's bytes (-: standard input)")
    parser.add_argument("stdin", nargs="?", choices=["-"], help="- : the payload from standard input")
    parser.add_argument("--key", metavar="K", help="the message key (required by an overwrite class)")
    parser.add_argument("--ttl", metavar="DURATION", help="drop it undelivered after this long, e.g. 1h")
    parser.add_argument("--app-id", metavar="ID", help="the message's own name (1-128 of A-Z a-z 0-9 . _ : -):"
                        " sent again under it, it is not stored twice")
    parser.add_argument("--content-type", metavar="TYPE", help="of a --file or stdin payload"
                        " (default application/octet-stream; --json sends application/json)")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="wait this long at most")


def take_extra(args: argparse.Namespace, extra: list[str]) -> bool:
    """A `-` after the options: the payload from standard input."""
    if extra == ["-"] and args.stdin is None:
        args.stdin = "-"
        return True
    return False


def _fail(code: int, text: str) -> int:
    print(f"edge-agent send: {text}", file=sys.stderr)
    return code


def main(args: argparse.Namespace) -> int:
    from agent.client import AgentUnavailable, Client, LocalApiError
    from agent.core.config import load_config, local_api_socket

    given = [name for name, value in (("--json", args.json), ("--file", args.file), ("-", args.stdin))
             if value is not None]
    if len(given) != 1:
        return _fail(EXIT_REFUSED, "give the payload once: --json TEXT, --file FILE or - (standard input)"
                     + (f", not {' and '.join(given)}" if given else ""))
    payload: bytes | object
    if args.json is not None:
        try:
            payload = json.loads(args.json)
        except ValueError as exc:
            return _fail(EXIT_REFUSED, f"--json: not valid JSON: {exc}")
    elif args.file is not None and args.file != "-":
        try:
            payload = Path(args.file).read_bytes()
        except OSError as exc:
            return _fail(EXIT_REFUSED, f"--file: {args.file}: {exc.strerror or exc}")
    else:
        payload = sys.stdin.buffer.read()
    socket_path = args.socket or str(local_api_socket(load_config(args.config)))
    try:
        with Client(socket_path, timeout_s=args.timeout) as client:
            receipt = client.submit(args.cls, payload, key=args.key, ttl=args.ttl, content_type=args.content_type,
                                    app_id=args.app_id)
    except LocalApiError as exc:
        code = EXIT_LATER if exc.status in (429, 503) else EXIT_REFUSED
        later = f" (retry after {exc.retry_after_s:g} s)" if exc.retry_after_s else ""
        return _fail(code, f"refused ({exc.status}): {exc.field + ': ' if exc.field else ''}{exc.error}{later}")
    except AgentUnavailable as exc:
        return _fail(EXIT_UNAVAILABLE, f"no agent answers: {exc}")
    if receipt.duplicate:
        print(f"edge-agent send: duplicate: {args.app_id} was taken before (path {receipt.path})", file=sys.stderr)
    print(receipt.id)
    return EXIT_OK
