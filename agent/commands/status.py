"""`edge-agent status --db PATH` (or `--config leader.toml`): the fleet as the leader's database
records it.

    edge-agent status --db leader.db                      summary, then the first 50 devices
    edge-agent status --db leader.db --offline            only the devices that are offline
    edge-agent status --db leader.db --version 1.2.0 --tag lab --limit 0
    edge-agent status --db leader.db --device pi-0042     one device in full
    edge-agent status --db leader.db --json               all of it as JSON (`devices` is the page)
    edge-agent status --db leader.db --watch 5            redraw every 5 s
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from agent.commands.arguments import aligned, positive_seconds, whole_number
from agent.core.durations import ago

if TYPE_CHECKING:
    from agent.leader.fleet_view import DeviceDetail, DevicePage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--db", metavar="PATH",
                       help="the leader's database: leader.db, or the fleet's postgresql:// URL")
    where.add_argument("--config", metavar="FILE", help="the leader's config: its database, as the leader opens it")
    parser.add_argument("--json", action="store_true", help="print JSON")
    state = parser.add_mutually_exclusive_group()
    state.add_argument("--offline", action="store_true", help="only devices that are offline")
    state.add_argument("--online", action="store_true", help="only devices that are online")
    parser.add_argument("--version", metavar="V", help="only devices that run firmware version V")
    parser.add_argument("--tag", metavar="T", help="only devices tagged T")
    parser.add_argument("--rollout", metavar="ID", help="only devices that rollout ID includes")
    parser.add_argument("--limit", type=whole_number, default=50, metavar="N",
                        help="devices per page (default 50; 0: all)")
    parser.add_argument("--offset", type=whole_number, default=0, metavar="N", help="skip the first N devices")
    parser.add_argument("--device", metavar="ID", help="one device in full: heartbeat, sample, rejects, rollouts")
    parser.add_argument("--watch", type=positive_seconds, metavar="SECONDS", help="redraw every SECONDS until Ctrl-C")


def main(args: argparse.Namespace) -> int:
    if args.config is not None:
        from agent.core.errors import EdgeAgentError

        try:
            args.db = _leader_database(args.config)
        except EdgeAgentError as exc:
            print(f"edge-agent status: {exc}", file=sys.stderr)
            return 2
    if args.watch is None:
        return _once(args)
    try:
        while True:
            sys.stdout.write("\x1b[H\x1b[2J")
            code = _once(args)
            if code != 0:
                return code
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _once(args: argparse.Namespace) -> int:
    import msgspec

    from agent.core.clock import SystemClock
    from agent.leader.fleet_view import DeviceFilter, device_detail, list_devices
    from agent.leader.readonly import open_leader_db
    from agent.leader.status import format_status, summarize

    now = SystemClock().now_ms()
    online = True if args.online else False if args.offline else None
    flt = DeviceFilter(online=online, version=args.version, tag=args.tag, rollout=args.rollout,
                       limit=args.limit, offset=args.offset)
    if args.device is not None:
        with open_leader_db(args.db) as db:
            detail = device_detail(db, args.device)
        if detail is None:
            print(f"edge-agent status: {args.db}: no device {args.device!r}", file=sys.stderr)
            return 1
        print(msgspec.json.encode(detail).decode() if args.json else format_device(detail, now))
        return 0
    summary = summarize(args.db, stale_limit=50 if args.json else 0)  # the table below lists them
    with open_leader_db(args.db) as db:
        page = list_devices(db, flt)
    if args.json:
        out = msgspec.to_builtins(summary)
        out.update(devices_matching=page.matching, devices_offset=page.offset,
                   devices=msgspec.to_builtins(page.devices))
        print(msgspec.json.encode(out).decode())
    else:
        print(format_status(summary))
        print(format_devices(page, now))
    return 0


def _leader_database(config_path: str) -> Any:
    """The database a leader's config names: its leader.db, or the fleet's PostgreSQL."""
    from pathlib import Path

    from agent.core.config import load_config
    from agent.core.errors import ConfigError
    from agent.leader.database import shared_database

    config = load_config(config_path)
    if config.agent.role != "leader":
        raise ConfigError(config_path, "agent.role", "status reads a leader's database: give a leader's config")
    return shared_database(config, Path(config.agent.data_dir))


def format_devices(page: DevicePage, now_ms: int) -> str:
    """The device table, one line per device."""
    if not page.devices:
        return (f"devices: none at offset {page.offset} of {page.matching} matching" if page.matching
                else "devices: none match")
    header = ("DEVICE", "STATE", "LAST SEEN", "VERSION", "TAGS", "ROLLOUT")
    rows = [(
        d.device_id,
        "online" if d.online else f"offline ({d.offline_reason})" if d.offline_reason else "offline",
        ago(now_ms, d.last_seen_ms),
        d.firmware_version or "-",
        ",".join(d.tags) or "-",
        f"{d.rollout_id} ({d.rollout_state})" if d.rollout_id else "-",
    ) for d in page.devices]
    lines = aligned([header, *rows])
    shown_to = page.offset + len(page.devices)
    if page.offset or shown_to < page.matching:
        lines.append(f"devices {page.offset + 1}-{shown_to} of {page.matching} matching"
                     f" (--offset {shown_to} for the next page, --limit 0 for all)")
    else:
        lines.append(f"{page.matching} devices")
    return "\n".join(lines)


_COMPLIANCE_SAID = {"in_sync": "in sync", "pending": "pending: the leader has more for it",
                    "damaged": "DAMAGED: its record cannot be read", "not_applied": "nothing applied",
                    "drifted": "drifted"}


def format_device(detail: DeviceDetail, now_ms: int) -> str:
    """One device in full, for a terminal."""
    from config_rollout.attempt_acks import attempt_said

    d = detail.device
    state = "online" if d.online else f"offline ({d.offline_reason or 'never seen online'})"
    lines = [
        f"device {d.device_id}: {state}, last seen {ago(now_ms, d.last_seen_ms)}",
        f"  firmware {d.firmware_version or '-'}   tags {','.join(d.tags) or '-'}   boot {detail.boot or '-'}",
        *([f"  is: {', '.join(f'{k} {v}' for k, v in sorted(d.facts.items()))}"] if d.facts else []),
        f"  heartbeat seq {detail.heartbeat_seq if detail.heartbeat_seq is not None else '-'}"
        f" ({ago(now_ms, detail.heartbeat_at_ms)}), uptime {detail.uptime_s or 0:.0f}s;"
        f" first seen {ago(now_ms, detail.first_seen_ms)}, state changed {ago(now_ms, detail.changed_ms)}",
        f"  telemetry: {detail.telemetry_count} records, {detail.telemetry_names} names;"
        f" outbox: {'not reported' if detail.outbox_pending is None else f'{detail.outbox_pending} pending'}"
        + (f";  served by leader {detail.served_by}" if detail.served_by else ""),
    ]
    s = detail.sample
    if s is not None:
        parts = [f"cpu {s.cpu_percent:.0f}%" if s.cpu_percent is not None else "",
                 f"mem {s.mem_percent:.0f}%" if s.mem_percent is not None else "",
                 f"disk {s.disk_percent:.0f}%" if s.disk_percent is not None else "",
                 f"load {s.load_1m:.2f}" if s.load_1m is not None else "",
                 f"{s.temperature_c:.1f} °C" if s.temperature_c is not None else ""]
        lines.append("  system: " + ", ".join(p for p in parts if p))
    if detail.configs:
        lines.append("  configuration targets:")
        lines += [f"    {name}: holds {c.version or 'nothing'}"
                  + (f"; DRIFTED: {', '.join(c.drifted)} changed on the device" if c.drifted else
                     f"; {_COMPLIANCE_SAID[detail.compliance.get(name, c.compliance)]}")
                  + (f" ({said})" if (said := attempt_said(c, detail.acknowledged.get(name))) else "")
                  for name, c in sorted(detail.configs.items())]
    if detail.apps:
        lines.append("  applications:")
        lines += [f"    {name}: {a.version or 'none committed'}" + (f", {a.trial} on trial" if a.trial else "")
                  + (f"; {a.previous} kept to go back to" if a.previous else "")
                  + ("; its last new version failed its health check and was taken back" if a.health == "failed"
                     else "")
                  for name, a in sorted(detail.apps.items())]
    if detail.release is not None:
        r = detail.release
        lines.append(f"  release: {r.name} {r.version} (rollout {r.rollout_id}): "
                     + (f"DRIFTED: {'; '.join(r.drift)}" if r.drift else "runs every part of it"))
    if detail.rollouts:
        lines.append("  rollouts (newest first):")
        lines += [f"    {r.rollout_id} ({r.name}): {r.from_version or '?'} → {r.version} [{r.rollout_state}]:"
                  f" wave {r.wave + 1}, {r.state}"
                  + (f" ({r.detail})" if r.detail else "") for r in detail.rollouts]
    if detail.rejects:
        lines.append(f"  recent rejects ({len(detail.rejects)}):")
        lines += [f"    {ago(now_ms, r.at_ms)}  {r.kind or '-'}  {r.reason}" for r in detail.rejects]
    return "\n".join(lines)
