"""`edge-agent devices`: the fleet's device identities (docs/service.md, "Device identity").

    edge-agent devices pending --config leader.toml          enrolments waiting for an operator
    edge-agent devices list [--state S] [--json]             every identity on record
    edge-agent devices approve ID [ID ...]                   sign their certificates
    edge-agent devices reject ID [--reason TEXT]
    edge-agent devices revoke ID [--reason TEXT]             its messages refused at once, the CRL rewritten,
                                                             the broker reloaded (identity.broker_reload)
    edge-agent devices token --uses N --expires 7d           a batch's enrolment token (printed once)
    edge-agent devices allow SERIAL [SERIAL ...]             hardware serials approved on first request
    edge-agent devices certs --out DIR --server-host HOST    the broker's server certificate and the
                     [--client OPERATOR ...]                 leader's own client certificate (and the
                                                             operators'), from the fleet CA

approve, reject and revoke are written into the leader's database and applied by the running
leader (it alone reads the CA's key), as rollout controls are; the command waits for the result.
Exit status: 0 done, 1 the leader refused it, 2 a user mistake, 3 the leader did not apply it
within the wait (it does when it starts).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agent.commands.arguments import aligned, positive_seconds, whole_number
from agent.core.clock import SystemClock
from agent.core.config import AgentConfig
from agent.core.durations import parse_seconds
from agent.core.errors import ConfigError, EdgeAgentError

if TYPE_CHECKING:
    from agent.core.sql import ServerUrl
    from agent.leader.identities import IdentityStore

EXIT_NOT_APPLIED = 3
STATES = ("pending", "approved", "rejected", "revoked")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))

    def where(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", required=True, metavar="FILE", help="the leader's config (leader.toml)")
        return p

    pending = where(sub.add_parser("pending", help="enrolments waiting for an operator"))
    pending.add_argument("--json", action="store_true")
    listing = where(sub.add_parser("list", help="every device identity on record"))
    listing.add_argument("--state", choices=STATES)
    listing.add_argument("--json", action="store_true")
    for action, text in (("approve", "approve pending enrolments: the leader signs their certificates"),
                         ("reject", "reject pending enrolments"),
                         ("revoke", "revoke enrolled devices: refused at once, the CRL rewritten, the broker"
                                    " reloaded")):
        p = where(sub.add_parser(action, help=text))
        p.add_argument("devices", nargs="+", metavar="ID")
        if action != "approve":
            p.add_argument("--reason", default="", help="said to the device and kept on record")
        p.add_argument("--wait", type=positive_seconds, default=10.0, metavar="SECONDS",
                       help="how long to wait for the leader (default 10)")
    token = where(sub.add_parser("token", help="make a batch's enrolment token (printed once, kept as a hash)"))
    token.add_argument("--uses", type=whole_number, required=True, help="how many devices it enrols at most")
    token.add_argument("--expires", default="7d", help="how long it is good for (default 7d)")
    allow = where(sub.add_parser("allow", help="hardware serial numbers approved on their first request"))
    allow.add_argument("serials", nargs="+", metavar="SERIAL")
    certs = where(sub.add_parser("certs", help="the broker's server certificate and the leader's client certificate"))
    certs.add_argument("--out", required=True, metavar="DIR", help="where to write them")
    certs.add_argument("--server-host", action="append", default=[], metavar="HOST",
                       help="a name or address devices reach the broker by (repeat)")
    certs.add_argument("--client", action="append", default=[], metavar="NAME",
                       help="also a client certificate for NAME, one of [leader] operators (repeat): an operator"
                            " cannot enrol as a device, its name being reserved")
    certs.add_argument("--days", type=whole_number, default=825)
    from agent.commands import remote

    remote.add_arguments(sub, where)


def _leader_config(path: str) -> AgentConfig:
    from agent.core.config import load_config

    config = load_config(path)
    if config.agent.role != "leader":
        raise ConfigError(path, "agent.role", "devices works on a leader's config")
    if config.identity is None:
        raise ConfigError(path, "identity", "this leader has no [identity] section: device identities are off")
    return config


def _db(config: AgentConfig, path: str) -> Path | ServerUrl:
    """The leader's identity store: its leader.db, or the fleet's PostgreSQL (`[leader] database`)."""
    from agent.core.sql import ServerUrl
    from agent.leader.database import LEADER_DB, shared_database

    shared = shared_database(config, Path(config.agent.data_dir))
    if isinstance(shared, ServerUrl):
        return shared
    db = Path(config.agent.data_dir) / LEADER_DB
    if not db.is_file():
        raise ConfigError(path, "agent.data_dir", f"no leader database at {db} (start the leader once)")
    return db


def main(args: argparse.Namespace) -> int:
    from agent.commands import remote

    if args.action in remote.ACTIONS:
        return remote.main(args)
    try:
        config = _leader_config(args.config)
        if args.action == "certs":
            return _certs(config, args)
        from agent.leader.identities import IdentityStore

        db = _db(config, args.config)
        if args.action in ("pending", "list"):
            with IdentityStore.open_readonly(db) as store:
                return _list(store, "pending" if args.action == "pending" else args.state, args.json)
        with IdentityStore.open(db) as store:
            if args.action == "token":
                return _token(store, args)
            if args.action == "allow":
                added = store.allow_serials(args.serials, by=_actor(), now_ms=SystemClock().now_ms())
                print(f"{added} serial number(s) added to the allow-list ({len(args.serials) - added} were there)")
                return 0
            return _controls(store, args)
    except EdgeAgentError as exc:
        print(f"edge-agent devices: {exc}", file=sys.stderr)
        return 2


def _actor() -> str:
    from agent.commands.rollout import cli_actor

    return cli_actor()


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ms / 1000)) if ms else "-"


def _list(store: IdentityStore, state: str | None, as_json: bool) -> int:
    rows = store.listed(state)  # type: ignore[arg-type]  # (a State: argparse's choices)
    if as_json:
        print(json.dumps([{"device": r.device, "state": r.state, "key": r.fingerprint, "serial": r.hw_serial,
                           "machine_id": r.machine_id, "agent_version": r.agent_version, "claim": r.claim,
                           "requested_ms": r.requested_ms, "requests": r.requests, "not_after_ms": r.not_after_ms,
                           "decided_by": r.decided_by, "reason": r.reason} for r in rows], indent=2))
        return 0
    if not rows:
        print(f"no {state or ''} enrolments".replace("  ", " "))
        return 0
    table = [("DEVICE", "STATE", "KEY", "SERIAL", "VERSION", "ASKED", "REQUESTS", "CERT UNTIL", "DECIDED BY / REASON")]
    table += [(r.device, r.state, r.fingerprint[:16], r.hw_serial or "-", r.agent_version or "-", _when(r.requested_ms),
               str(r.requests), _when(r.not_after_ms), (r.reason or r.decided_by or "-")[:60]) for r in rows]
    print("\n".join(aligned(table)))
    return 0


def _token(store: IdentityStore, args: argparse.Namespace) -> int:
    if args.uses < 1:
        raise ConfigError("--uses", None, "a token enrols at least one device")
    try:
        seconds = parse_seconds(args.expires)
    except ValueError as exc:
        raise ConfigError("--expires", None, str(exc)) from None
    token = secrets.token_urlsafe(24)
    now = SystemClock().now_ms()
    store.add_token(token, uses=args.uses, expires_ms=now + int(seconds * 1000), by=_actor(), now_ms=now)
    print(token)
    print(f"enrols {args.uses} device(s) until {_when(now + int(seconds * 1000))}: put it in each device's"
          " [identity] token_file; it is not shown again", file=sys.stderr)
    return 0


def _controls(store: IdentityStore, args: argparse.Namespace) -> int:
    now = SystemClock().now_ms()
    ids = [store.add_control(args.action, device, by=_actor(), now_ms=now, reason=getattr(args, "reason", ""))
           for device in args.devices]
    deadline = time.monotonic() + args.wait
    status = 0
    for control_id in ids:
        while True:
            row = store.control(control_id)
            if row is not None and row.applied_ms is not None:
                if row.ok:
                    print(row.outcome)
                else:
                    print(f"edge-agent devices: the leader refused it: {row.outcome}", file=sys.stderr)
                    status = max(status, 1)
                break
            if time.monotonic() >= deadline:
                print(f"edge-agent devices: {args.action} {row.device if row else ''} not applied yet: the leader is"
                      " not running; it applies it when it starts", file=sys.stderr)
                return EXIT_NOT_APPLIED
            time.sleep(0.2)
    return status


def _certs(config: AgentConfig, args: argparse.Namespace) -> int:
    from agent.identity.files import fleet_authority
    from agent.service.files import write_private_file

    assert config.identity is not None
    if not args.server_host:
        raise ConfigError("--server-host", None, "name at least one host devices reach the broker by")
    now = SystemClock().now_ms()
    authority = fleet_authority(config.identity, Path(config.agent.data_dir), fleet=config.agent.fleet, now_ms=now)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key, cert = authority.issue_with_key(args.server_host[0], now_ms=now, days=args.days, server_hosts=args.server_host)
    write_private_file(out / "server.key", key, 0o600)
    write_private_file(out / "server.crt", cert, 0o644)
    broker_reads = _for_the_broker(out / "server.key")
    key, cert = authority.issue_with_key(config.agent.device_id, now_ms=now, days=args.days)
    write_private_file(out / "leader.key", key, 0o600)
    write_private_file(out / "leader.crt", cert, 0o644)
    for name in args.client:
        if name not in config.leader.operators:
            raise ConfigError("--client", None, f"{name!r} is not one of [leader] operators: a device enrols instead")
        key, cert = authority.issue_with_key(name, now_ms=now, days=args.days)
        write_private_file(out / f"{name}.key", key, 0o600)
        write_private_file(out / f"{name}.crt", cert, 0o644)
        print(f"wrote {out}/{name}.crt + {name}.key (the operator {name})")
    write_private_file(out / "ca.crt", authority.cert_pem, 0o644)
    print(f"wrote {out}/ca.crt (the fleet CA), server.crt + server.key (the broker, for {', '.join(args.server_host)}),"
          f" leader.crt + leader.key (the leader {config.agent.device_id}, as [mqtt] tls_cert / tls_key)")
    print(broker_reads)
    return 0


def _for_the_broker(key: Path) -> str:
    """mosquitto reads its key after it drops to the `mosquitto` user: as root, the key is made
    0640 root:mosquitto; else what to do, in one line."""
    import grp

    from agent.service.files import unreadable_by

    try:
        gid = grp.getgrnam("mosquitto").gr_gid
    except KeyError:
        return f"{key}: no group mosquitto here; make the key readable by the broker's user (0640, its group)"
    try:
        os.chown(key, 0, gid)
        os.chmod(key, 0o640)
    except OSError as exc:
        return f"{key}: cannot give it to the group mosquitto ({exc.strerror}): run as root, or chgrp mosquitto and" \
               " chmod 0640 it"
    why = unreadable_by(key, "mosquitto")
    return f"{key}: 0640 root:mosquitto" + (f", but {why}" if why else ", readable by the broker's user")


__all__ = ["add_arguments", "main"]
