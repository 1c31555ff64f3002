"""`simulate --scenario wave-rollout` / `--rollout SPEC.toml`: the rollout orchestrator's scenario
(`firmware_rollout.scenario`: a leader with the rollout service and devices with the updater, on
the in-memory broker and a virtual clock), reported in the simulator's shape.

The report is the scenario's, plus the simulator's common keys:

* `lost`: targeted devices that did not end in a terminal state, or whose state the leader never
  learned (their report would have been lost). Must be 0.
* `conservation_ok`: the per-state counts add up to the devices targeted, and no device was
  offered the image after an abort.
* `wall`: wall and CPU seconds, peak RSS (the only section that varies between runs).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent.sim.options import SimOptions
from agent.sim.report import Report, peak_rss_mb
from firmware_rollout.rollout_store import TERMINAL
from firmware_rollout.scenario import wave_rollout_scenario


async def run_rollout(opts: SimOptions, *, workdir: Path, spec_path: str | Path | None = None,
                      fail_rate: float = 0.0) -> Report:
    """Run the wave-rollout scenario with `opts.devices` and `opts.seed`."""
    # The updaters' thread work completes in submission order only on one thread: the same
    # seed then gives the same report.
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sim-rollout")
    loop.set_default_executor(executor)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        result: dict[str, Any] = await wave_rollout_scenario(
            devices=opts.devices, seed=opts.seed, fail_rate=fail_rate, work_dir=workdir / "rollout",
            spec_path=spec_path)
    finally:
        executor.shutdown(wait=True)
    wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    ro = result["rollout"]
    counts: dict[str, int] = ro["counts"]
    targeted = sum(w["size"] for w in ro["waves"])
    terminal = sum(n for state, n in counts.items() if state in TERMINAL)
    untouched = sum(n for state, n in counts.items() if state == "queued")
    aborted = ro["state"] in ("aborted", "canceled")
    # An aborted rollout leaves the devices it never offered the image queued: accounted for.
    lost = targeted - terminal - (untouched if aborted else 0)
    result["lost"] = lost
    result["conservation_ok"] = sum(counts.values()) == targeted and ro["devices_offered_after_abort"] == 0
    result["scenario_name"] = "wave-rollout"
    result["wall"] = {
        "seconds": round(wall_s, 3), "cpu_seconds": round(cpu_s, 3), "peak_rss_mb": peak_rss_mb(),
        "fleet_seconds_per_wall_second": round(ro["duration_s"] / wall_s, 1) if wall_s > 0 else None,
    }
    return result


def rollout_summary(report: Report) -> str:
    ro = report["rollout"]
    lines = [
        f"wave rollout of {ro['version']} to {report['devices']} devices (seed {report['seed']},"
        f" {report['failing_devices']} failing): {ro['state']} after {ro['duration_s']:.0f}s of fleet time"
        f" ({report['wall']['seconds']:.1f}s wall) - {ro['detail']}",
    ]
    for w in ro["waves"]:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(w["counts"].items())) or "untouched"
        lines.append(f"  wave {w['index']}: {w['size']} devices, {w['state']}: {counts}")
    d = report["downloads"]
    lines.append(f"downloads: at most {d['max_concurrent']} at once (bound {d['bound']}), {d['served']} chunks"
                 f" served, {d['busy']} busy answers")
    lines.append("devices: " + ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items())))
    lines.append(f"offered after abort: {ro['devices_offered_after_abort']}   lost: {report['lost']}"
                 f"   conservation_ok: {report['conservation_ok']}")
    return "\n".join(lines)


__all__ = ["rollout_summary", "run_rollout"]
