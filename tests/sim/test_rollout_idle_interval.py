"""A rollout over devices at the shipped idle heartbeat (300 s): each device heartbeats fast while
its update runs and through its wave's 60 s soak (the soak asks for it), so every gate hears from
every device in time and the rollout passes as it does at a 5 s heartbeat."""

from __future__ import annotations

from pathlib import Path

from agent.core.config import HeartbeatSection
from agent.sim import SimOptions
from agent.sim.rollout import run_rollout


async def test_a_rollout_passes_its_soaks_over_devices_at_the_idle_interval(tmp_path: Path) -> None:
    opts = SimOptions(devices=20, seed=3, heartbeat_s=HeartbeatSection().interval_s, progress=False)
    assert opts.heartbeat_s == 300.0
    report = await run_rollout(opts, workdir=tmp_path)
    assert report["rollout"]["state"] == "succeeded", report["rollout"]
    assert report["lost"] == 0 and report["conservation_ok"] is True
    waves = report["rollout"]["waves"]
    assert len(waves) == 4 and all(w["state"] == "passed" for w in waves)
