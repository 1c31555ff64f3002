"""`edge-agent simulate`: a fleet of devices on this machine, on virtual time by default.

    edge-agent simulate --devices 200 --duration 10m --seed 7 --report a.json
    edge-agent simulate --scenario thundering-herd
    edge-agent simulate --scenario wave-rollout --devices 200 --seed 3 --fail-rate 0.2

One leader and N workers run with the real actors, outboxes (a few shared SQLite files) and
relays, on an in-memory broker (or a real one with --broker) and a virtual clock (or the wall
clock with --realtime), in one process or spread over --processes N; with --broker, --shard K/M
runs one part of a fleet spread over machines. Shows progress (a live panel on a terminal, plain lines
otherwise) and a summary; --report writes the JSON report, --plot draws its time series.
The same --seed gives the same report except its `wall` section. A named --scenario fills the
options not given from its preset, prints what it demonstrates and checks its claim.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from agent.core.config import HeartbeatSection
from agent.core.errors import ConfigError

# Defaults of the options a scenario may preset (None on the command line = not given).
DEFAULTS: dict[str, Any] = {
    "devices": 50, "duration": "10m", "heartbeat": f"{HeartbeatSection().interval_s:g}s", "leader_interval": "30s",
    "telemetry": "30s",
    "offline_rate": 0.0, "offline_duration": "2m", "broker_outage": None, "jobs": 0, "job_window": 2,
    "leader_mailbox": None, "crash_rate": 0.0, "crash_downtime": "15s",
}
AUTO_MIN_DEVICES = 1000  # below this, a second process costs more than it saves
MAX_AUTO_PROCESSES = 16
# A scenario preset's SimOptions field -> the command-line option it stands for.
PRESET_ARGS = {
    "devices": "devices", "duration_s": "duration", "heartbeat_s": "heartbeat",
    "leader_interval_s": "leader_interval", "telemetry_s": "telemetry", "offline_rate": "offline_rate",
    "offline_duration_s": "offline_duration", "broker_outage": "broker_outage", "jobs": "jobs",
    "job_window": "job_window", "leader_mailbox": "leader_mailbox", "crash_rate": "crash_rate",
    "crash_downtime_s": "crash_downtime",
}


EPILOG = """\
examples:
  edge-agent simulate --devices 200 --duration 10m --seed 7 --report a.json
  edge-agent simulate --scenario offline-store-and-forward
  edge-agent simulate --scenario wave-rollout --devices 200 --seed 3 --fail-rate 0.2
  edge-agent simulate --scenario app-rollout --devices 200 --seed 7 --fail-rate 0.05
  edge-agent simulate --scenario release-rollout --devices 100 --seed 7 --fail-rate 0.1
  edge-agent simulate --scenario config-rollout --devices 200 --seed 7 --cut-rate 0.1
  edge-agent simulate --scenario wave-rollout --devices 200 --seed 3 --cancel-at 2m
  edge-agent simulate --rollout rollout.toml --public-key keys/public.pem --devices 50

A rollout (a --scenario ending in -rollout, or --rollout) runs until the rollout ends, on the
in-memory broker and virtual time; of the options above it uses --devices, --seed, --fail-rate,
--cut-rate (config-rollout), --cancel-at, --public-key, --data-dir, --report, --plot and --quiet.
Waves are numbered from 1 (the canary is wave 1), as in `edge-agent rollout list` and `rollout
status`. Every time the report gives is fleet time (the simulation's clock), unless it says wall.
Exit status: 0 when nothing was lost (and the scenario's claim holds), 1 otherwise, 2 for a
usage mistake."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from agent.sim.scenarios import SCENARIOS

    parser.description = ("Simulate a fleet on this machine: one leader and N worker devices with the real\n"
                          "actors, outboxes and relays, on an in-memory broker and virtual time. Shows live\n"
                          "progress, then a report; the same --seed gives the same report.")
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add("--scenario", choices=sorted(SCENARIOS), metavar="NAME",
        help=f"a named scenario: presets, then the claim it checks; one of {', '.join(sorted(SCENARIOS))}"
             " (default: none)")
    add("--devices", type=int, metavar="N", help="simulated worker devices (default 50, or the scenario's)")
    add("--duration", metavar="TIME", help="fleet time to simulate, e.g. 10m, 1h (default 10m, or the scenario's)")
    add("--seed", type=int, default=1, metavar="N", help="seed of every random choice (default 1)")
    add("--heartbeat", metavar="TIME", help="idle heartbeat interval of every device (default: the shipped"
                                              f" [heartbeat] interval_s, {HeartbeatSection().interval_s:g}s)")
    add("--leader-interval", metavar="TIME", help="the leader applies heartbeats at this pace (default 30s)")
    add("--telemetry", metavar="TIME", help="telemetry interval per device; 0 for none (default 30s)")
    add("--app-every", default="0", metavar="TIME",
        help="each device's application hands its agent's local API a message this often, e.g. 30s;"
             " 0 for none (default 0)")
    add("--offline-rate", type=float, metavar="FRACTION",
        help="fraction of devices losing their uplink once, 0-1 (default 0)")
    add("--offline-duration", metavar="TIME", help="how long such a device stays offline (default 2m)")
    add("--crash-rate", type=float, metavar="FRACTION",
        help="fraction of devices crashing once and restarting on their SQLite state, 0-1 (default 0)")
    add("--crash-downtime", metavar="TIME", help="how long a crashed device stays down (default 15s)")
    add("--broker-outage", metavar="AT:FOR", help="take the broker down at AT for FOR, e.g. 3m:1m (default: none)")
    add("--jobs", type=int, metavar="N", help="jobs to submit to the leader's work-pulling queue (default 0)")
    add("--job-window", type=int, metavar="N", help="each worker's demand window (default 2)")
    add("--leader-mailbox", type=int, metavar="N",
        help="capacity of the leader's mailboxes (default: devices + 64, at least 1024)")
    add("--rollout", metavar="SPEC.toml",
        help="roll out this spec's artifact to the simulated devices (default: the wave-rollout scenario's"
             " own signed image)")
    add("--public-key", metavar="PATH",
        help="with --rollout: the fleet's public key the devices pin (default: public.pem beside the artifact)")
    add("--fail-rate", type=float, default=0.0, metavar="FRACTION",
        help="with a rollout: fraction of devices whose new image (with --scenario app-rollout or"
             " release-rollout: the new application version) fails its health check, 0-1 (default 0)")
    add("--cut-rate", type=float, default=0.1, metavar="FRACTION",
        help="with --scenario config-rollout: fraction of devices the config cuts off when applied, 0-1"
             " (default 0.1)")
    add("--cancel-at", metavar="TIME",
        help="with a rollout: the operator cancels it this long after its start, e.g. 90 or 2m (default: never)")
    add("--files", type=int, default=4, metavar="N", help="shared outbox files the devices' rows live in (default 4)")
    add("--processes", default="auto", metavar="N",
        help="spread the devices over N processes, the leader in the first (default auto: the machine's"
             f" cores from {AUTO_MIN_DEVICES} devices up, else 1; a rollout, --broker and --realtime run in 1)")
    add("--round", default="250ms", metavar="TIME",
        help="with more than one process: the broker's least delivery latency, the processes' step"
             " (default 250ms)")
    add("--tick", default="100ms", metavar="TIME",
        help="virtual clock: timers due within one tick fire together (default 100ms)")
    add("--samples", type=int, default=60, metavar="N", help="points in the report's time series (default 60)")
    add("--data-dir", metavar="DIR", help="keep the SQLite files here (default: a temporary directory)")
    add("--ephemeral", action="store_true",
        help="keep the SQLite files in memory (a tmpfs such as /dev/shm when there is one), removed at the end"
             " (default: off)")
    add("--broker", metavar="URL", help="a real MQTT broker, mqtt://host:port; implies --realtime"
                                        " (default: the in-memory broker)")
    add("--realtime", action="store_true", help="run on the wall clock (default: virtual time)")
    add("--shard", metavar="K/M",
        help="with --broker: run only the K-th of M parts of the fleet (shard 1 runs the leader), so that"
             " M machines simulate one fleet against one broker (default: the whole fleet)")
    add("--leaders", type=int, default=1, metavar="N",
        help="leaders on one shared subscription, sharing one registry in --database (default 1)")
    add("--database", metavar="URL",
        help="the leaders' state in this PostgreSQL, postgresql://USER@HOST/DB, in a schema of the run's own"
             " dropped at the end (default: each leader's leader.db)")
    add("--leader-crash", metavar="TIME",
        help="with --leaders 2 or more: the first leader crashes at this fleet time, e.g. 3m, and the others"
             " carry the fleet (default: never)")
    add("--enrol", action="store_true",
        help="every device enrols at its first boot: its own key, a certificate request the leaders approve"
             " by a batch token, a certificate of the fleet's CA (default: devices start with no identity)")
    add("--report", metavar="FILE", help="write the JSON report here (default: none)")
    add("--plot", metavar="FILE.png", help="draw the time series; needs the sim extra, matplotlib (default: none)")
    add("--quiet", action="store_true",
        help="no progress display (default: a live panel on a terminal, plain lines when piped)")


def _value(args: argparse.Namespace, key: str, preset: dict[str, Any]) -> Any:
    given = getattr(args, key, None)
    if given is not None:
        return given
    for field, arg in PRESET_ARGS.items():
        if arg == key and field in preset:
            return preset[field]
    return DEFAULTS[key]


def processes_for(args: argparse.Namespace, *, devices: int, rollout: bool) -> int:
    """`--processes`: a number, or `auto` (see its help)."""
    given = str(getattr(args, "processes", None) or "auto")
    one_only = rollout or args.broker is not None or args.realtime
    if given == "auto":
        if one_only or devices < AUTO_MIN_DEVICES:
            return 1
        from agent.sim.part import available_cores

        return max(1, min(available_cores(), devices, MAX_AUTO_PROCESSES))
    try:
        n = int(given)
    except ValueError:
        raise ConfigError("simulate", "processes", f"expected a number or auto, got {given!r}") from None
    if n > 1 and rollout:
        raise ConfigError("simulate", "processes", "a rollout runs in one process: leave out --processes")
    return n


def options_from(args: argparse.Namespace):
    from agent.sim import SimOptions, parse_duration, parse_outage, parse_shard
    from agent.sim.scenarios import get

    # `--rollout SPEC` runs the wave-rollout scenario's fleet with the user's spec
    name = args.scenario or ("wave-rollout" if getattr(args, "rollout", None) else None)
    preset = get(name).presets if name else {}

    def duration(key: str, name: str) -> float:
        value = _value(args, key, preset)
        return float(value) if isinstance(value, (int, float)) else parse_duration(value, name=name)

    outage = _value(args, "broker_outage", preset)
    if isinstance(outage, str):
        outage = parse_outage(outage)
    offline_rate = _value(args, "offline_rate", preset)
    if args.broker and (offline_rate or outage or _value(args, "crash_rate", preset)):
        raise ConfigError("simulate", "broker",
                          "--offline-rate, --crash-rate and --broker-outage need the in-memory broker")
    if args.ephemeral and args.data_dir:
        raise ConfigError("simulate", "ephemeral", "--ephemeral keeps the files in memory: leave out --data-dir")
    if not 0.0 <= args.fail_rate <= 1.0:
        raise ConfigError("simulate", "fail-rate", "must be between 0 and 1")
    devices = _value(args, "devices", preset)
    return SimOptions(
        devices=devices, processes=processes_for(args, devices=devices,
                                                 rollout=name in ("wave-rollout", "config-rollout", "app-rollout",
                                                                  "release-rollout")),
        round_s=parse_duration(getattr(args, "round", None) or "250ms", name="round"),
        duration_s=duration("duration", "duration"), seed=args.seed,
        heartbeat_s=duration("heartbeat", "heartbeat"),
        leader_interval_s=duration("leader_interval", "leader-interval"),
        telemetry_s=duration("telemetry", "telemetry"),
        app_every_s=parse_duration(getattr(args, "app_every", None) or "0", name="app-every"),
        offline_rate=offline_rate, offline_duration_s=duration("offline_duration", "offline-duration"),
        broker_outage=outage, jobs=_value(args, "jobs", preset), job_window=_value(args, "job_window", preset),
        leader_mailbox=_value(args, "leader_mailbox", preset), files=args.files,
        ephemeral=args.ephemeral, broker_url=args.broker, realtime=args.realtime,
        progress=not args.quiet, tick_s=parse_duration(args.tick, name="tick"),
        crash_rate=_value(args, "crash_rate", preset),
        crash_downtime_s=duration("crash_downtime", "crash-downtime"), scenario=args.scenario,
        shard=parse_shard(args.shard) if getattr(args, "shard", None) else None,
        samples=args.samples, leaders=args.leaders, database=args.database,
        leader_crash_s=parse_duration(args.leader_crash, name="leader-crash") if args.leader_crash else None,
        enrol=bool(getattr(args, "enrol", False)),
    )


def main(args: argparse.Namespace) -> int:
    import logging

    from agent.actors import run as run_loop
    from agent.sim import simulation, summary, to_json
    from agent.sim.progress import ProgressDisplay
    from agent.sim.scenarios import check, get

    opts = options_from(args)  # ConfigError -> one line, exit 2 (agent.cli)
    configuring = args.scenario == "config-rollout"
    if configuring and (args.rollout is not None or args.cancel_at is not None or args.fail_rate):
        raise ConfigError("simulate", "scenario", "config-rollout signs its own release: leave out --rollout,"
                                                  " --cancel-at and --fail-rate (its fault is --cut-rate)")
    if not 0.0 <= args.cut_rate <= 1.0:
        raise ConfigError("simulate", "cut-rate", "must be between 0 and 1")
    applying = args.scenario == "app-rollout"
    releasing = args.scenario == "release-rollout"
    if (applying or releasing) and (args.rollout is not None or args.cancel_at is not None):
        raise ConfigError("simulate", "scenario", f"{args.scenario} signs its own files: leave out --rollout and"
                                                  " --cancel-at (its fault is --fail-rate)")
    rollout = args.scenario == "wave-rollout" or args.rollout is not None
    if opts.shard is not None and (rollout or args.scenario):
        raise ConfigError("simulate", "shard", "a rollout or a named scenario runs the whole fleet: leave out --shard")
    cancel_at_s = None
    if args.cancel_at is not None:
        from agent.sim import parse_duration

        if not rollout:
            raise ConfigError("--cancel-at", None, "applies with a rollout (--scenario wave-rollout or --rollout)")
        cancel_at_s = parse_duration(args.cancel_at, name="cancel-at")
    if args.rollout is not None and not Path(args.rollout).is_file():
        raise ConfigError("--rollout", None, f"{args.rollout}: no such spec file")
    public_key = None
    if args.public_key is not None and args.rollout is None:
        raise ConfigError("--public-key", None, "applies with --rollout SPEC.toml (the wave-rollout scenario"
                                                " signs its own image)")
    if args.rollout is not None:
        from agent.sim.rollout import public_key_for
        from rollout_engine.spec import load_spec, soak_warning

        public_key, warning = public_key_for(args.rollout, args.public_key)
        # through a soak the devices heartbeat at their fast pace (the soak asks them to)
        fast = min(opts.heartbeat_s, HeartbeatSection().fast_interval_s)
        soak = soak_warning(load_spec(args.rollout), heartbeat_s=fast, source=args.rollout,
                            devices="simulated devices")
        for line in (soak, warning):
            if line:
                print(f"warning: {line}", file=sys.stderr, flush=True)
    if args.plot:
        from agent.sim.plot import _pyplot

        _pyplot()  # a missing matplotlib is a one-line error before the run, not after it
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    if args.scenario:
        print(f"scenario {args.scenario}: {get(args.scenario).demonstrates}", flush=True)

    async def go(workdir: Path) -> dict[str, Any]:
        if releasing:
            from agent.sim.release_rollout import run_release_rollout

            with ProgressDisplay(duration_s=None) as display:
                every, idle = (5.0, 5.0) if display.live else (30.0, 300.0)
                return await run_release_rollout(opts, workdir=workdir, fail_rate=args.fail_rate,
                                                 progress=None if args.quiet else display, progress_every_s=every,
                                                 progress_idle_s=idle)
        if applying:
            from agent.sim.app_rollout import run_app_rollout

            with ProgressDisplay(duration_s=None) as display:
                every, idle = (5.0, 5.0) if display.live else (30.0, 300.0)
                return await run_app_rollout(opts, workdir=workdir, fail_rate=args.fail_rate,
                                             progress=None if args.quiet else display, progress_every_s=every,
                                             progress_idle_s=idle)
        if configuring:
            from agent.sim.config_rollout import run_config_rollout

            with ProgressDisplay(duration_s=None) as display:
                every, idle = (5.0, 5.0) if display.live else (30.0, 300.0)
                return await run_config_rollout(opts, workdir=workdir, cut_rate=args.cut_rate,
                                                progress=None if args.quiet else display, progress_every_s=every,
                                                progress_idle_s=idle)
        if rollout:
            from agent.sim.rollout import run_rollout

            with ProgressDisplay(duration_s=None) as display:
                # A live panel redraws every 5 s of fleet time. Plain lines: at every change of
                # the rollout's state or wave, every 30 s while devices move, every 5 min otherwise.
                every, idle = (5.0, 5.0) if display.live else (30.0, 300.0)
                return await run_rollout(opts, workdir=workdir, spec_path=args.rollout, fail_rate=args.fail_rate,
                                         public_key=public_key, progress=None if args.quiet else display,
                                         progress_every_s=every, progress_idle_s=idle, cancel_at_s=cancel_at_s)
        with ProgressDisplay(duration_s=opts.duration_s) as display:
            return await simulation(opts, workdir=workdir, progress=None if args.quiet else display).run()

    # Virtual time: asyncio's own loop, whose ready queue the clock can see (settling exactly
    # keeps runs reproducible); on the wall clock uvloop when installed.
    use_uvloop = opts.realtime or opts.broker_url is not None
    if args.data_dir:
        workdir = Path(args.data_dir)
        workdir.mkdir(parents=True, exist_ok=True)
        report = run_loop(go(workdir), use_uvloop=use_uvloop)
    else:
        shm = Path("/dev/shm")
        where = str(shm) if args.ephemeral and shm.is_dir() else None
        with tempfile.TemporaryDirectory(prefix="edge-agent-sim-", dir=where) as tmp:
            report = run_loop(go(Path(tmp)), use_uvloop=use_uvloop)
    if releasing:
        from agent.sim.release_rollout import release_rollout_summary

        print(release_rollout_summary(report))
    elif applying:
        from agent.sim.app_rollout import app_rollout_summary

        print(app_rollout_summary(report))
    elif configuring:
        from agent.sim.config_rollout import config_rollout_summary

        print(config_rollout_summary(report))
    elif rollout:
        from agent.sim.rollout import rollout_summary

        print(rollout_summary(report))
    else:
        print(summary(report))
    problems = check(args.scenario, report) if args.scenario else []
    if args.scenario:
        report["claim"] = {"holds": not problems, "problems": problems}
        print(f"claim {'holds' if not problems else 'FAILED: ' + '; '.join(problems)}")
    if args.report:
        Path(args.report).write_text(to_json(report) + "\n")
        print(f"report written to {args.report}")
    if args.plot:
        from agent.sim.plot import plot

        print(f"plot written to {plot(report, args.plot)}")
    return 0 if report["lost"] == 0 and report["conservation_ok"] and not problems else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(argparse.Namespace()))
