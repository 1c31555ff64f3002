"""Property: whatever the devices do, the rollout never exceeds the download bound, never goes
past a failed gate, and ends with every targeted device in a terminal state."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.core.clock import VirtualClock
from agent.sim.devices import DeviceFate
from agent.sim.rollout import device_ids, wave_rollout_scenario
from rollout_engine.store import TERMINAL, RolloutStore

FATES = {
    "ok": DeviceFate(),
    "health": DeviceFate(health_fails=True),
    "install": DeviceFate(install_fails=True),
    "silent": DeviceFate(silent=True),
}


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(min_value=6, max_value=14))
    outcomes = draw(st.lists(st.sampled_from(["ok", "ok", "ok", "health", "install", "silent"]),
                             min_size=n, max_size=n))
    canary = draw(st.integers(min_value=0, max_value=2))
    counts = draw(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=3))
    overrides = {
        "waves": {"canary": canary, "counts": counts, "percents": None},
        "gates": {"success_threshold_pct": draw(st.sampled_from([0.0, 50.0, 90.0, 100.0])),
                  "failure_threshold_pct": draw(st.sampled_from([10.0, 30.0, 100.0])),
                  "min_finished": draw(st.integers(min_value=1, max_value=5)),
                  "soak_s": draw(st.sampled_from([0.0, 30.0]))},
        "device": {"timeout_s": 120.0, "retries": draw(st.integers(min_value=0, max_value=1)),
                   "retry_backoff_s": 10.0},
        "download": {"servers": draw(st.integers(min_value=1, max_value=2)),
                     "mailbox_capacity": draw(st.integers(min_value=1, max_value=3))},
    }
    fates = {d: FATES[o] for d, o in zip(device_ids(n), outcomes, strict=True)}
    return {"devices": n, "overrides": overrides, "fates": fates, "seed": draw(st.integers(0, 1000))}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_rollout_invariants_hold_for_random_device_outcomes(case: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        report = asyncio.run(wave_rollout_scenario(
            devices=case["devices"], seed=case["seed"], work_dir=work, spec_overrides=case["overrides"],
            fates=case["fates"], max_fleet_s=4 * 3600.0))
        downloads = report["downloads"]
        assert downloads["max_concurrent"] <= downloads["bound"]
        assert downloads["mailbox_high_water"] <= downloads["mailbox_capacity"]
        assert report["completed"]
        rollout = report["rollout"]
        assert rollout["state"] in ("succeeded", "aborted")
        assert rollout["devices_offered_after_abort"] == 0

        store = RolloutStore.open(work / "leader" / "leader.db", clock=VirtualClock())
        try:
            devices = store.devices("wave-rollout")
            assert len(devices) == case["devices"]
            assert all(d.state in TERMINAL for d in devices)  # every targeted device ended
            waves = store.waves("wave-rollout")
            threshold = case["overrides"]["gates"]["success_threshold_pct"]
            offered_waves = {d.wave for d in devices if d.offers > 0}
            for w in waves:
                members = [d for d in devices if d.wave == w.idx]
                if w.state == "passed":
                    ok = sum(d.state == "succeeded" for d in members)
                    assert ok * 100.0 >= threshold * w.size - 1e-9
                if w.idx > 0 and w.idx in offered_waves:
                    before = waves[w.idx - 1]
                    assert before.state == "passed", (w.idx, before.state)  # never past a failed gate
                    assert w.started_ms is not None and before.finished_ms is not None
                    assert w.started_ms >= before.finished_ms
                if w.state in ("failed", "canceled") or w.state == "pending":
                    later = [d for d in devices if d.wave > w.idx]
                    assert all(d.offers == 0 for d in later)
        finally:
            store.close()
