"""`edge-agent rollout`: start and control firmware rollouts in waves.

    edge-agent rollout start SPEC.toml --db /var/lib/edge-agent/leader.db   (or --config leader.toml)
    edge-agent rollout start SPEC.toml --db ... --dry-run   the plan, device by device; nothing starts
    edge-agent rollout status [ID] [--watch] [--json]
    edge-agent rollout pause|resume|cancel|next|approve ID
    edge-agent rollout rollback ID [--artifact PREVIOUS.eafw]
    edge-agent rollout list [--json]

How the CLI reaches the running leader: it writes the control into the `rollout_controls` table
of the leader's database and the leader's orchestrator applies it on its next tick (every 2 s
by default, one indexed read of the unapplied controls; no busy polling, no extra socket or
broker round trip, and a control written while the leader is down is applied when it starts).
The CLI then waits a few seconds for the leader to record the result and prints it. `status`
and `list` read the tables directly.

User mistakes (a bad spec, an unknown rollout, a control that does not apply) are one line on
stderr and exit status 2; a control the leader refused exits 1; one the leader did not apply
within the wait exits 3 and says since when the leader has not run (it is applied when the
leader starts). `status` and `list` open the database read-only and never write it.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import socket
import sys
import time
from pathlib import Path
from typing import Any

from agent.commands.arguments import aligned, positive_seconds
from agent.core.clock import SystemClock
from agent.core.errors import ConfigError, EdgeAgentError, RolloutError
from agent.core.sizes import format_bytes
from agent.leader.registry import LEADER_QUIET_S
from agent.leader.rollout_plan import plan_rollout, render_plan

EXIT_NOT_APPLIED = 3  # a control queued, the leader not running to apply it
CONTROL_ACTIONS = ("pause", "resume", "cancel", "next", "approve")
PIPED_WIDTH = 250  # columns of `status` written to a pipe or a file
CONTROL_HELP = {
    "pause": "stop offering the image; devices mid-update finish and report",
    "resume": "go on with a paused rollout (the failure threshold counts afresh)",
    "cancel": "end a rollout: devices not offered the image yet are never offered it",
    "next": "end the current wave now and start the next one, whatever its gates say",
    "approve": "start the next wave of a rollout waiting for approval",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True,
                                parser_class=type(parser))

    def with_db(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        where = p.add_mutually_exclusive_group()
        where.add_argument("--db", help="the leader's database (leader.db)")
        where.add_argument("--config", help="the leader's config file (its data_dir holds leader.db)")
        return p

    start = with_db(sub.add_parser("start", help="start a rollout from a spec file"))
    start.add_argument("spec", help="rollout spec (TOML)")
    start.add_argument("--id", help="rollout id (default: from the spec's name)")
    start.add_argument("--dry-run", action="store_true",
                       help="print the plan (the devices of each wave, who is left out and why) and start nothing")
    start.add_argument("--no-wait", action="store_true", help="do not wait for the leader to start it")
    start.add_argument("--wait", type=positive_seconds, default=10.0, metavar="SECONDS",
                       help="how long to wait for the leader (default 10)")
    status = with_db(sub.add_parser("status", help="show a rollout (default: the latest)"))
    status.add_argument("id", nargs="?", metavar="ID", help="the rollout's id (default: the latest)")
    status.add_argument("--watch", action="store_true", help="refresh until the rollout ends")
    status.add_argument("--interval", type=positive_seconds, default=2.0,
                        help="refresh interval of --watch, seconds (> 0)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--devices", action="store_true",
                        help="also list every device: wave, state, attempts and why (e.g. a failed health check)")
    status.add_argument("--device", metavar="ID",
                        help="one device: its state, why, and the lines of its log that explain a failure")
    for action in CONTROL_ACTIONS:
        p = with_db(sub.add_parser(action, help=CONTROL_HELP[action], description=CONTROL_HELP[action]))
        p.add_argument("id", metavar="ID", help="the rollout's id (see `edge-agent rollout list`)")
        p.add_argument("--no-wait", action="store_true", help="do not wait for the leader to apply it")
        p.add_argument("--wait", type=positive_seconds, default=10.0, metavar="SECONDS",
                       help="how long to wait for the leader (default 10)")
    rollback = with_db(sub.add_parser("rollback", help="offer the previous version to the devices that took this one"))
    rollback.add_argument("id", metavar="ID", help="the rollout whose devices go back")
    rollback.add_argument("--artifact", default="", help="the previous version's artifact (default: the spec's "
                                                         "rollback_artifact)")
    rollback.add_argument("--no-wait", action="store_true", help="do not wait for the leader to apply it")
    rollback.add_argument("--wait", type=positive_seconds, default=10.0, metavar="SECONDS",
                          help="how long to wait for the leader (default 10)")
    listing = with_db(sub.add_parser("list", help="list rollouts"))
    listing.add_argument("--json", action="store_true")


def _db_path(args: argparse.Namespace) -> Any:
    """Where the rollout tables are: `--db` (a file or a postgresql:// URL), or the leader's
    database by its `--config` (the fleet's PostgreSQL database when `[leader] database` says so)."""
    from agent.core.sql import is_server_url

    if getattr(args, "db", None) and is_server_url(args.db):
        return args.db
    if getattr(args, "db", None):
        path = Path(args.db)
    elif getattr(args, "config", None):
        from agent.core.config import load_config
        from agent.leader.agent import LEADER_DB
        from agent.leader.database import shared_database

        config = load_config(args.config)
        if config.leader.database:
            return shared_database(config, Path(config.agent.data_dir))
        path = Path(config.agent.data_dir) / LEADER_DB
    else:
        raise ConfigError("rollout", "--db", "give --db LEADER_DB or --config leader.toml")
    if not path.is_file():
        raise ConfigError(str(path), None, "no leader database here (start the leader once, or check the path)")
    return path


READ_ONLY = ("status", "list")


def _open(args: argparse.Namespace) -> Any:
    """The rollout store: read-only for `status` and `list`, which never write the file; `start`
    and the controls write, and only into a leader's database (never a worker's)."""
    from agent.leader.registry import DeviceRegistry
    from rollout_engine.store import RolloutStore

    path = _db_path(args)
    if args.action in READ_ONLY:
        return RolloutStore.open_readonly(path, clock=SystemClock())
    DeviceRegistry.connect_reader(path).close()  # a leader's database: it has the device registry
    if args.action == "start":
        return RolloutStore.open(path, clock=SystemClock())
    return RolloutStore.open_existing(path, clock=SystemClock())  # a control names a rollout: the tables are there


def main(args: argparse.Namespace) -> int:
    store = _open(args)
    try:
        action = args.action
        if action == "start":
            return _start(store, args)
        if action == "status":
            return _status(store, args)
        if action == "list":
            return _list(store, args)
        return _control(store, args)
    finally:
        store.close()


def _start(store: Any, args: argparse.Namespace) -> int:
    from agent.core.config import HeartbeatSection
    from rollout_engine.orchestrator import rollout_id_for
    from rollout_engine.spec import StartControl, load_spec, soak_warning

    spec = load_spec(args.spec)
    # Through a soak the workers heartbeat at their fast pace (the soak asks them to); their own
    # configs are not at hand here: warn against the default fast interval.
    soak = soak_warning(spec, heartbeat_s=HeartbeatSection().fast_interval_s, source=args.spec, devices="workers")
    if soak:
        print(f"warning: {soak}", file=sys.stderr, flush=True)
    traits = _traits(spec, args.spec)
    manifest = traits.describe(Path(spec.rollout.artifact))
    rid = args.id or rollout_id_for(spec, SystemClock().now_ms())
    if store.get(rid) is not None:
        raise RolloutError(f"rollout {rid!r} exists already")
    plan = plan_rollout(spec, manifest, store.target)
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    held = store.holders([d for wave in plan.waves for d in wave], among=traits.holds_with(manifest.lane))
    if args.dry_run:
        print(render_plan(rid, spec, manifest, plan, held))
        return 0
    control = store.add_control(rid, "start", StartControl(spec=spec, waves=plan.waves).to_json().decode(),
                                actor=cli_actor())
    print(f"rollout {rid}: {manifest.installs} from {spec.rollout.artifact}")
    print(plan.summary())
    return _await_control(store, control, args.no_wait, args.wait)


def _traits(spec: Any, source: str) -> Any:
    """The kind the spec names, its fields checked against it (a `ConfigError` naming the key)."""
    from agent.leader.rollout_kinds import traits_of

    traits = traits_of(spec.rollout.kind, source=source)
    traits.check_spec(spec, source=source)
    return traits


def cli_actor() -> str:
    """Who runs this command, for a control's audit record: the user (and who became it through
    sudo), the host."""
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = "?"
    via = os.environ.get("SUDO_USER", "")
    return (f"{user} (uid {uid}{', sudo from ' + via[:64] if via else ''}) on the CLI at "
            f"{socket.gethostname()[:64]}")


def _control(store: Any, args: argparse.Namespace) -> int:
    from rollout_engine.controls import request_control

    control = request_control(store, args.id, args.action, getattr(args, "artifact", None), actor=cli_actor())
    return _await_control(store, control, args.no_wait, args.wait)


def _await_control(store: Any, control_id: int, no_wait: bool, timeout_s: float = 10.0) -> int:
    """Wait for the running leader to apply the control and print its result. Exit status: 0
    applied (or `--no-wait`), 1 the leader refused it, 3 not applied within the wait (the leader
    is not running: it applies the control when it starts)."""
    if no_wait:
        print(f"queued as control {control_id}; the running leader applies it on its next tick")
        return 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = store.control(control_id)
        if row is not None and row.applied_ms is not None:
            if row.refused:
                print(f"edge-agent rollout: the leader refused it: {row.result}", file=sys.stderr)
                return 1
            print(row.result)
            return 0
        time.sleep(0.2)
    seen = _leader_last_seen(store)
    since = "never" if seen is None else time.strftime("%H:%M:%S", time.localtime(seen / 1000))
    print(f"edge-agent rollout: not applied yet: the leader has not run since {since} (its last write to"
          f" {store.path}); it applies control {control_id} when it starts", file=sys.stderr)
    return EXIT_NOT_APPLIED


def _leader_last_seen(store: Any) -> int | None:
    """When the leader last wrote to its database: its own alive mark (every 30 s while it
    runs), the newest rollout step or control it answered, or heartbeat it applied."""
    from agent.leader.readonly import open_leader_db

    seen = [store.leader_last_seen_ms()]
    try:
        with open_leader_db(store.target) as db:
            seen += [db.registry.last_heartbeat_ms(), db.registry.leader_alive_ms()]
    except EdgeAgentError:
        pass  # a database without a registry: the rollout tables are the only sign
    found = [s for s in seen if s is not None]
    return max(found) if found else None


def _status(store: Any, args: argparse.Namespace) -> int:
    from rollout_engine.status import describe

    rid = args.id
    if rid is None:
        latest = store.latest()
        if latest is None:
            raise RolloutError("no rollouts yet")
        rid = latest.id
    def load() -> dict[str, Any]:
        data = describe(store, rid)
        seen = _leader_last_seen(store)
        data["leader_last_seen_ms"] = seen
        # a running rollout's leader writes every few seconds (heartbeats, ticks): silence means
        # what is shown may no longer be true
        data["stale"] = data["state"] in ("scheduled", "running", "paused") and (
            seen is None or SystemClock().now_ms() - seen > LEADER_QUIET_S * 1000)  # (3 missed alive marks)
        if args.device:
            data["device"] = _device_status(store, rid, args.device)
        if args.devices:
            data["device_list"] = [
                {"device": d.device_id, "wave": d.wave, "state": d.state, "attempts": d.attempts,
                 "offers": d.offers, "from_version": d.from_version, "detail": d.detail,
                 "image_bytes": d.bytes_total, "bytes_to_fetch": d.bytes_to_fetch, "bytes_fetched": d.bytes_fetched}
                for d in sorted(store.devices(rid), key=lambda d: (d.wave, d.device_id))
            ]
        return data

    if store.find(rid) is None:
        raise RolloutError(f"no rollout {rid!r} (see `edge-agent rollout list`)")
    data = load()
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.live import Live

    # piped or redirected, rich would cut every line at 80 columns: a pipe gets whole lines
    console = Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)
    if not args.watch:
        console.print(render_status(data))
        return 0
    try:
        with Live(render_status(data), console=console, refresh_per_second=4) as live:
            while data["state"] in ("scheduled", "running", "paused"):
                time.sleep(max(0.2, args.interval))
                data = load()
                live.update(render_status(data))
        if not console.is_terminal:  # Live leaves the last line open when it writes to a pipe or file
            console.line()
    except KeyboardInterrupt:
        return 130
    return 0


AUDIT_SHOWN = 5  # newest controls under `rollout status` (all of them: `--json`)


def _device_status(store: Any, rollout_id: str, device_id: str) -> dict[str, Any]:
    """One device of a rollout, with the log lines its failure report carried."""
    from rollout_engine.store import RolloutReads

    d = store.device(rollout_id, device_id)
    if d is None:
        raise RolloutError(f"device {device_id!r} is not in rollout {rollout_id!r}"
                           " (see `edge-agent rollout status --devices`)")
    log = RolloutReads(store.connection).logs_of(device_id, [rollout_id]).get(rollout_id)
    return {"device": d.device_id, "wave": d.wave, "state": d.state, "attempts": d.attempts, "offers": d.offers,
            "from_version": d.from_version, "detail": d.detail, "updated_ms": d.updated_ms,
            "log": list(log.lines) if log else [], "log_ms": log.at_ms if log else 0,
            "log_state": log.state if log else ""}


def render_status(data: dict[str, Any]) -> Any:
    """The rich renderable of a rollout's status (per-wave progress bars and state counts)."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    colour = {"scheduled": "blue", "running": "cyan", "paused": "yellow", "succeeded": "green", "aborted": "red",
              "failed": "red", "stopped": "magenta",
              "canceled": "magenta"}.get(data["state"], "white")
    sources = ", ".join(data.get("from_versions") or {}) or "?"
    head = Text.assemble(
        ("rollout ", "bold"), (data["id"], "bold"), f"  ({data['name']})  {sources} → {data['version']}  ",
        (data["state"].upper(), f"bold {colour}"),
    )
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in ("wave", "size", "state", "devices", "done", "download", "states"):
        table.add_column(column, no_wrap=column != "states")
    for w in data["waves"]:
        name = f"{w['number']}" + (" canary" if w["canary"] else "")
        counts = ", ".join(f"{k} {v}" for k, v in w["counts"].items())
        done = w["finished"] - w["counts"].get("canceled", 0)
        dl = w.get("download") or {}
        total_bytes = int(dl.get("bytes_total", 0))
        download: Any = Text("-", style="dim")
        if total_bytes:
            rate = float(dl.get("rate_bytes_per_s", 0.0))
            to_fetch = int(dl.get("bytes_to_fetch", 0))
            done_bytes = int(dl.get("bytes_done", 0))
            # assembled (copied from the active slot or fetched) of the images' size; a delta
            # says how much of that is fetched at all
            fetch = f", {format_bytes(to_fetch)} to fetch (delta)" if 0 < to_fetch < total_bytes else ""
            download = Table.grid(padding=(0, 1))
            download.add_row(ProgressBar(total=total_bytes, completed=done_bytes, width=16),
                             Text(f"{format_bytes(done_bytes)} of {format_bytes(total_bytes)} assembled" + fetch
                                  + (f", {format_bytes(rate)}/s" if rate else ""), style="dim"))
        table.add_row(name, str(w["size"]), w["state"], ProgressBar(total=max(1, w["size"]), completed=done, width=20),
                      f"{w['succeeded']}/{w['size']} ok", download, counts)
    totals = "  ".join(f"{k}: {v}" for k, v in data["counts"].items())
    served = data.get("serving") or {}
    lines: list[Text | Table] = [head, Text(data["detail"], style="dim"), table,
             Text(f"devices {data['devices']}   {totals}   offers {data['offers']}"),
             Text(f"MQTT chunks served {served.get('chunks', 0)} ({format_bytes(served.get('bytes', 0))});"
                  f" {served.get('busy', 0)} busy answers; at most {served.get('max_concurrent', 0)} downloads at once",
                  style="dim")]
    if data["rollback_of"]:
        lines.insert(1, Text(f"rollback of {data['rollback_of']}", style="yellow"))
    if data.get("cancel_pending"):
        lines.insert(2, Text(f"{data['cancel_pending']} devices still to confirm the cancel (they were updating)",
                             style="yellow"))
    if data.get("stale"):
        seen = data.get("leader_last_seen_ms")
        when = "never" if seen is None else time.strftime("%H:%M:%S", time.localtime(seen / 1000))
        lines.insert(1, Text(f"STALE: the leader has written nothing since {when}; is it running?", style="bold red"))
    audit = data.get("audit") or []
    if audit:
        lines.append(Text("controls (newest last):", style="bold"))
        for c in audit[-AUDIT_SHOWN:]:
            asked = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["asked_ms"] / 1000))
            outcome = c["outcome"] or "not applied yet"
            lines.append(Text(f"  {asked}  {c['action']} by {c['actor'] or 'someone unrecorded'}: {outcome}"
                              + (f" ({c['result']})" if c["result"] else ""),
                              style="red" if c["outcome"] == "refused" else ""))
    if "device" in data:
        d = data["device"]
        lines.append(Text.assemble((f"device {d['device']}", "bold"), f"  wave {d['wave'] + 1}  ",
                                   (d["state"], "red" if d["state"] in ("failed", "rolled_back", "timed_out") else ""),
                                   f"  attempts {d['attempts']}  {d['from_version'] or '?'} → {data['version']}"))
        if d["detail"]:
            lines.append(Text(f"  {d['detail']}"))
        if d["log"]:
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["log_ms"] / 1000))
            lines.append(Text(f"its log when it reported {d['log_state']} ({at}; secrets redacted on the device):",
                              style="bold"))
            lines.extend(Text(f"  {line}", style="dim" if line.startswith("-- ") else "") for line in d["log"])
        elif d["state"] in ("failed", "rolled_back"):
            lines.append(Text("  (its report carried no log lines)", style="dim"))
    if "device_list" in data:
        devices = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for column in ("device", "wave", "versions", "state", "attempts", "fetched", "detail"):
            devices.add_column(column, no_wrap=column != "detail")
        for d in data["device_list"]:
            size, to_fetch = int(d.get("image_bytes", 0)), int(d.get("bytes_to_fetch", 0))
            fetched = int(d.get("bytes_fetched", 0))
            fetches = (f"{format_bytes(fetched)} of {format_bytes(to_fetch)} to fetch ({format_bytes(size)} image)"
                       if size and to_fetch else "-")
            versions = f"{d.get('from_version') or '?'} → {data['version']}"
            devices.add_row(d["device"], str(d["wave"] + 1), versions, d["state"], str(d["attempts"]), fetches,
                            d["detail"])
        lines.append(devices)
    return Group(*lines)


def _list(store: Any, args: argparse.Namespace) -> int:
    from rollout_engine.status import describe

    items = []
    for r in store.rollouts():
        d = describe(store, r.id)  # the numbers `status` shows, from the same place
        items.append({"id": d["id"], "name": d["name"], "version": d["version"], "state": d["state"],
                      "wave": f"{d['current_wave_number']}/{d['wave_count']}", "devices": d["devices"],
                      "succeeded": d["counts"].get("succeeded", 0), "created_ms": d["created_ms"]})
    if args.json:
        print(json.dumps(items, indent=2))
        return 0
    if not items:
        print("no rollouts")
        return 0
    # Plain aligned columns, never shortened or wrapped by a narrow terminal: ids are typed back.
    columns = ("id", "name", "version", "state", "wave", "devices", "succeeded")
    for line in aligned([list(columns), *([str(item[c]) for c in columns] for item in items)]):
        print(line)
    return 0
