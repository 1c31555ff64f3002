#!/usr/bin/env python3
"""Benchmark the fleet simulator (`edge-agent simulate`) on this machine.

    python scripts/bench_sim.py --quick          # one small run, well within 5 minutes
    python scripts/bench_sim.py                  # the two targets of the scale issue
    python scripts/bench_sim.py --budget 300     # wall-time budget per full run (default 300 s)
    python scripts/bench_sim.py --only 10k-devices-1h --budget 900   # one of the full runs
    python scripts/bench_sim.py --processes 1     # every run in one process (default: this machine's cores)
    python scripts/bench_sim.py --only 10k-devices-1h --heartbeat 5   # the same fleet at another interval

Each configuration runs in a child process of its own (so its peak RSS is its own):

* quick: 1,000 devices, 10 minutes of fleet time, 5 s heartbeats (the fast pace, to keep the
  figures comparable across rounds), 30 s telemetry, run in one process
  and again spread over `--processes` (its `scaling` compares the two: device-seconds per wall
  second with N processes over N times the figure with one; the target is 0.8 or more);
* full: 10,000 devices for 1 hour, and 1,000 devices for 24 hours (the shipped heartbeat settings,
  telemetry every 30 s; `--heartbeat S` runs them at another interval, e.g. the 5 s of before), plus the
  wave-rollout scenario with 1,000 devices, and 100,000 devices for 10 minutes. A run that
  exceeds `--budget` seconds of wall time stops generating load where it is (its
  `fleet_seconds` says how far it got) and drains.

Reported per run: devices, fleet_seconds (simulated, drain included), wall_seconds, cpu_seconds,
peak_rss_mb, rss_per_device_kb (peak RSS above the process's RSS before the fleet was built, per
device), events (virtual-clock timers fired + messages sent), events_per_wall_second,
device_seconds_per_wall_second, cpu_us_per_device_heartbeat (CPU per device per heartbeat
interval: the heartbeat end to end plus that interval's share of the device's other traffic),
lost, conservation_ok, processes and by_process (each process's devices, CPU seconds and peak RSS;
the CPU and peak RSS figures above are summed over the processes). With --breakdown (which runs
in one process, where the sampler sees everything) also `breakdown` (share of CPU samples by
component) and real_components_us_per_device_heartbeat: the CPU per device heartbeat less the
simulator's own share (clock, memory broker and transport, fleet, runner), i.e. what the real
components cost.
Progress goes to stderr; the LAST line on stdout is one JSON object (quick: the run itself;
full: {"runs": [...]} with the same keys for the first run at the top level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QUICK = {"name": "quick", "devices": 1000, "duration_s": 600.0, "heartbeat_s": 5.0}
FULL = [
    {"name": "10k-devices-1h", "devices": 10_000, "duration_s": 3600.0},
    {"name": "1k-devices-24h", "devices": 1000, "duration_s": 86_400.0},
    {"name": "wave-rollout-1k", "devices": 1000, "rollout": True},
    {"name": "100k-devices-10m", "devices": 100_000, "duration_s": 600.0},
]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


# Where the simulator's main thread spends its time, by the file of the innermost Python frame
# (a C call counts for the Python code that made it; asyncio code for our code that called it).
# First match wins.
CATEGORIES = [
    ("simulator", ("agent/sim/", "agent/transport/memory.py", "agent/transport/_memory_broker.py",
                   "agent/core/clock.py")),
    ("outbox_relay_sqlite", ("agent/outbox/", "agent/core/sqlite.py")),
    ("asyncio", ("/asyncio/", "/selectors.py", "/_weakrefset.py", "/contextlib.py")),
    ("endpoint", ("agent/transport/endpoint.py", "agent/transport/topics.py")),
    ("actors", ("agent/actors/",)),
    ("leader", ("agent/leader/",)),
    ("worker", ("agent/worker/",)),
    ("core_ids_codec", ("agent/core/", "agent/protocol.py")),
]


def _category(frame: Any) -> str:
    path = frame.f_code.co_filename.replace(os.sep, "/")
    return next((name for name, parts in CATEGORIES if any(p in path for p in parts)), "other")


class Sampler:
    """A statistical profiler: every `interval_s` of process CPU time (SIGPROF), the file of
    the innermost Python frame of the main thread is counted. The handler runs between two
    bytecodes, so time in a C call (SQLite, the selector) counts for the code that made it."""

    def __init__(self, interval_s: float = 0.005) -> None:
        import collections

        self.counts: collections.Counter[str] = collections.Counter()
        self._interval_s = interval_s
        self._previous: Any = None

    def __enter__(self) -> Sampler:
        import signal

        self._previous = signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, self._interval_s, self._interval_s)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        signal.setitimer(signal.ITIMER_PROF, 0.0, 0.0)
        signal.signal(signal.SIGPROF, self._previous)

    def _sample(self, _signum: int, frame: Any) -> None:
        if frame is None:
            return
        category = _category(frame)
        if category == "asyncio":
            # asyncio called by our code (a queue, an event, a task created) counts for that
            # code; what is left is the loop's own dispatch of callbacks and task steps.
            caller = frame.f_back
            while caller is not None and _category(caller) == "asyncio":
                caller = caller.f_back
            if caller is not None and _category(caller) != "other":
                category = _category(caller)
        self.counts[category] += 1

    def shares(self) -> dict[str, float]:
        total = sum(self.counts.values()) or 1
        return {name: round(self.counts[name] / total, 3) for name, _ in [*CATEGORIES, ("other", ())]}


def child(cfg: dict[str, Any], budget_s: float | None) -> dict[str, Any]:
    """Run one configuration in this process; the measured figures."""
    import contextlib

    from agent.sim import SimOptions, simulation
    from agent.sim.report import peak_rss_mb
    from agent.sim.rollout import run_rollout

    sampler = Sampler() if cfg.get("breakdown") else None
    before = _rss_mb()
    processes = 1 if cfg.get("rollout") or sampler is not None else cfg.get("processes", 1)
    shipped = {"heartbeat_s": cfg["heartbeat_s"]} if cfg.get("heartbeat_s") else {}  # else the shipped interval
    opts = SimOptions(devices=cfg["devices"], duration_s=cfg.get("duration_s", 600.0), seed=7,
                      progress=False, max_wall_s=budget_s, samples=24, processes=processes, **shipped)
    with tempfile.TemporaryDirectory(prefix="bench-sim-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        with sampler if sampler is not None else contextlib.nullcontext():
            report, fleet_s, events, extra = _run(cfg, opts, Path(d), run_rollout, simulation)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
    peak = peak_rss_mb()
    if processes > 1:  # summed over the processes (the others' setup is inside the run)
        cpu, peak = report["wall"]["cpu_seconds"], report["wall"]["peak_rss_mb"]
    result = {
        "name": cfg["name"], "devices": cfg["devices"], "fleet_seconds": round(fleet_s, 1),
        "wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2), "peak_rss_mb": round(peak, 1),
        "rss_per_device_kb": round(max(0.0, peak - before) * 1024 / cfg["devices"], 1),
        "events": events, "events_per_wall_second": round(events / wall, 1),
        "device_seconds_per_wall_second": round(cfg["devices"] * fleet_s / wall, 1),
        "lost": report["lost"], "conservation_ok": report["conservation_ok"], "processes": processes,
        "by_process": report["wall"].get("processes"), **extra,
    }
    if not cfg.get("rollout"):
        # CPU per device per heartbeat interval: one heartbeat end to end, plus that interval's
        # share of the device's other traffic (job-demand re-registration, telemetry).
        rounds = cfg["devices"] * fleet_s / opts.heartbeat_s
        result["cpu_us_per_device_heartbeat"] = round(cpu * 1e6 / rounds, 1)
    if sampler is not None:
        shares = sampler.shares()
        result["breakdown"] = shares
        if "cpu_us_per_device_heartbeat" in result:
            # The same CPU without the simulator's own code: what the real components cost.
            result["real_components_us_per_device_heartbeat"] = round(
                result["cpu_us_per_device_heartbeat"] * (1 - shares["simulator"]), 1)
    return result


def _run(cfg: dict[str, Any], opts: Any, workdir: Path, run_rollout: Any, simulation: Any) -> tuple[Any, ...]:
    """One run: (report, fleet seconds, events, extra figures)."""
    if cfg.get("rollout"):
        report = asyncio.run(run_rollout(opts, workdir=workdir))
        events = report["downloads"]["served"] + report["downloads"]["busy"] + report["rollout"]["offers"]
        return report, report["rollout"]["duration_s"], events, {"rollout_state": report["rollout"]["state"]}
    report = asyncio.run(simulation(opts, workdir=workdir).run())
    events = (report["wall"]["timers_fired"] or 0) + report["messages"]["sent"]
    extra = {"truncated_at_s": report["truncated_at_s"], "messages_sent": report["messages"]["sent"],
             "heartbeats": report["heartbeats"]["generated"],
             "coalescing_ratio": report["heartbeats"]["coalescing_ratio"],
             "target_fleet_seconds": opts.duration_s, "heartbeat_s": opts.heartbeat_s,
             "air_bytes_per_device_per_day": report["air"]["bytes_per_device_per_day"]}
    return report, report["fleet_seconds"], events, extra


def run_child(cfg: dict[str, Any], budget_s: float | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps(cfg)]
    if budget_s is not None:
        cmd += ["--budget", str(budget_s)]
    print(f"bench_sim: {cfg['name']} ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"bench_sim: {cfg['name']} failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(lines[-1])
    print(f"bench_sim: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small configuration (< 5 minutes)")
    parser.add_argument("--budget", type=float, default=None,
                        help="wall seconds per run before it stops generating (full default 300)")
    parser.add_argument("--only", action="append", choices=[cfg["name"] for cfg in FULL],
                        help="run just this full configuration (repeatable)")
    parser.add_argument("--breakdown", action="store_true",
                        help="sample where the time goes (simulator's own code vs the real components)")
    from agent.sim.part import available_cores

    parser.add_argument("--processes", type=int, default=available_cores(),
                        help="spread each fleet over this many processes (default: this machine's cores)")
    parser.add_argument("--heartbeat", type=float, default=None,
                        help="the full runs' heartbeat interval in seconds (default: the shipped one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.budget)))
        return 0
    extra: dict[str, Any] = {"breakdown": True} if args.breakdown else {"processes": args.processes}
    full_extra = {**extra, **({"heartbeat_s": args.heartbeat} if args.heartbeat else {})}
    if args.quick:
        one = run_child({**QUICK, **extra, "processes": 1}, args.budget or 240.0)
        result = one
        if args.processes > 1 and not args.breakdown:
            spread = run_child({**QUICK, **extra, "name": f"quick-{args.processes}p"}, args.budget or 240.0)
            ratio = spread["device_seconds_per_wall_second"] / (args.processes * one["device_seconds_per_wall_second"])
            result = {**spread, "scaling": {"processes": args.processes,
                                            "one_process": one["device_seconds_per_wall_second"],
                                            "spread": spread["device_seconds_per_wall_second"],
                                            "ratio_to_n_times_one": round(ratio, 3),
                                            "target_0.8": ratio >= 0.8}, "one_process_run": one}
        print(json.dumps(result))
        return 0 if result["lost"] == 0 and one["lost"] == 0 else 1
    budget = args.budget or 300.0
    runs = [run_child({**cfg, **full_extra}, budget) for cfg in FULL if not args.only or cfg["name"] in args.only]
    print(json.dumps({**runs[0], "runs": runs}))
    return 0 if all(r["lost"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
