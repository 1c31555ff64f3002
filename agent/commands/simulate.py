"""`edge-agent simulate`: a fleet of devices on this machine, on virtual time by default.

    edge-agent simulate --devices 200 --duration 10m --seed 7 --report a.json

One leader and N workers run in one process with the real actors, outboxes (a few shared SQLite
files) and relays, on an in-memory broker (or a real one with --broker) and a virtual clock (or
the wall clock with --realtime). Prints progress and a summary; --report writes the JSON report.
The same --seed gives the same report except its `wall` section.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from agent.core.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--devices", type=int, default=50, help="simulated worker devices (default 50)")
    add("--duration", default="10m", help="fleet time to simulate, e.g. 10m, 1h (default 10m)")
    add("--seed", type=int, default=1, help="seed of every random choice (default 1)")
    add("--heartbeat", default="5s", help="heartbeat interval of every device (default 5s)")
    add("--leader-interval", default="30s", help="the leader processes heartbeats at this pace (default 30s)")
    add("--telemetry", default="30s", help="telemetry interval per device; 0 for none (default 30s)")
    add("--offline-rate", type=float, default=0.0, help="fraction of devices losing their uplink once (0-1)")
    add("--offline-duration", default="2m", help="how long such a device stays offline (default 2m)")
    add("--broker-outage", metavar="AT:FOR", help="take the broker down at AT for FOR, e.g. 3m:1m")
    add("--jobs", type=int, default=0, help="jobs to submit to the leader's work-pulling queue")
    add("--job-window", type=int, default=2, help="each worker's demand window (default 2)")
    add("--leader-mailbox", type=int, default=1024, help="capacity of the leader's mailboxes (default 1024)")
    add("--files", type=int, default=4, help="shared outbox files the devices' rows live in (default 4)")
    add("--data-dir", metavar="DIR", help="keep the SQLite files here (default: a temporary directory)")
    add("--ephemeral", action="store_true", help="temporary files, removed at the end (the default)")
    add("--broker", metavar="URL", help="a real MQTT broker (mqtt://host:port); implies --realtime")
    add("--realtime", action="store_true", help="run on the wall clock instead of virtual time")
    add("--report", metavar="FILE", help="write the JSON report here")
    add("--quiet", action="store_true", help="no progress lines")


def options_from(args: argparse.Namespace):  # noqa: ANN201 - SimOptions, imported lazily
    from agent.sim import SimOptions, parse_duration, parse_outage

    if args.broker and (args.offline_rate or args.broker_outage):
        raise ConfigError("simulate", "broker", "--offline-rate and --broker-outage need the in-memory broker")
    return SimOptions(
        devices=args.devices, duration_s=parse_duration(args.duration), seed=args.seed,
        heartbeat_s=parse_duration(args.heartbeat, name="heartbeat"),
        leader_interval_s=parse_duration(args.leader_interval, name="leader-interval"),
        telemetry_s=parse_duration(args.telemetry, name="telemetry"),
        offline_rate=args.offline_rate,
        offline_duration_s=parse_duration(args.offline_duration, name="offline-duration"),
        broker_outage=parse_outage(args.broker_outage) if args.broker_outage else None,
        jobs=args.jobs, job_window=args.job_window, leader_mailbox=args.leader_mailbox, files=args.files,
        ephemeral=args.ephemeral or not args.data_dir, broker_url=args.broker, realtime=args.realtime,
        progress=not args.quiet,
    )


def main(args: argparse.Namespace) -> int:
    import logging

    from agent.actors import run as run_loop
    from agent.sim import Simulation, summary, to_json

    opts = options_from(args)  # ConfigError -> one line, exit 2 (agent.cli)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")

    def progress(line: str) -> None:
        print(line, flush=True)

    async def go(workdir: Path):  # noqa: ANN202
        return await Simulation(opts, workdir=workdir, progress=None if args.quiet else progress).run()

    if args.data_dir:
        workdir = Path(args.data_dir)
        workdir.mkdir(parents=True, exist_ok=True)
        report = run_loop(go(workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="edge-agent-sim-") as tmp:
            report = run_loop(go(Path(tmp)))
    print(summary(report))
    if args.report:
        Path(args.report).write_text(to_json(report) + "\n")
        print(f"report written to {args.report}")
    return 0 if report["lost"] == 0 and report["conservation_ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(argparse.Namespace()))
