"""Every view of a rollout says the same thing, and its end state matches its devices (hypothesis).

Random sequences of device reports (any device, any state, in any order), operator controls and
the passing of time drive a real orchestrator on a real store; after each step the per-wave
counts, the totals, `rollout list`, `/metrics` and the store's own per-state counts agree, and a
finished rollout's state is one its devices support."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_support import Harness

from agent.core.errors import RolloutError
from agent.leader.rollout import rollout_collector
from rollout_engine.errors import ReportRefused
from rollout_engine.messages import RolloutReport
from rollout_engine.status import describe
from rollout_engine.store import TERMINAL

REPORT_STATES = ("waiting_window", "downloading", "installing", "rebooting", "verifying", "succeeded", "failed",
                 "rejected", "rolled_back", "canceled")
PHASE = {"waiting_window": "idle", "downloading": "downloading", "installing": "installing", "rebooting": "rebooting",
         "verifying": "verifying_health", "succeeded": "committed", "failed": "failed", "rejected": "rejected",
         "rolled_back": "rolled_back", "canceled": "canceled"}
DEVICES = 6

steps = st.lists(
    st.one_of(
        st.tuples(st.just("report"), st.integers(0, DEVICES - 1), st.sampled_from(REPORT_STATES)),
        st.tuples(st.just("control"), st.sampled_from(["pause", "resume", "cancel", "next", "approve"])),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 30.0, 200.0])),
    ),
    min_size=1, max_size=25,
)


def check_views(h: Harness) -> dict[str, Any]:
    view = describe(h.store, h.rid)
    wave_totals: dict[str, int] = {}
    for w in view["waves"]:
        assert sum(w["counts"].values()) == w["size"], w  # every device of a wave is in one state
        assert w["finished"] == sum(n for s, n in w["counts"].items() if s in TERMINAL)
        assert w["succeeded"] == w["counts"].get("succeeded", 0)
        for s, n in w["counts"].items():
            wave_totals[s] = wave_totals.get(s, 0) + n
    assert view["counts"] == dict(sorted(wave_totals.items()))
    assert view["counts"] == dict(sorted(h.store.totals(h.rid).items()))  # the store's own count
    assert view["devices"] == DEVICES == sum(view["counts"].values())
    metrics = {f.name: f for f in rollout_collector(h.store)()}
    devices = [(dict(s.labels), s.value) for s in metrics["ea_rollout_devices"].samples]
    exported = {labels["state"]: value for labels, value in devices if labels["rollout"] == h.rid}
    assert exported == {s: float(n) for s, n in view["counts"].items()}
    info = [dict(s.labels) for s in metrics["ea_rollout_info"].samples if dict(s.labels)["rollout"] == h.rid]
    assert info == [{"rollout": h.rid, "state": view["state"], "version": view["version"]}]
    # the end state is one the devices support
    if view["state"] == "succeeded":
        assert all(w["state"] == "passed" for w in view["waves"]), view
        assert set(view["counts"]) <= TERMINAL
    if view["state"] in ("running", "paused"):
        assert view["cancel_pending"] == 0
    if view["state"] == "paused":
        assert "paused" in view["detail"]
    return view


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=steps)
def test_every_view_agrees_and_the_end_state_matches_the_devices(tmp_path_factory: Any, plan: list[tuple]) -> None:
    tmp = tmp_path_factory.mktemp("views")

    async def run() -> None:
        async with Harness(tmp, devices=DEVICES, waves={"canary": 1, "counts": [2, 3]},
                           gates={"success_threshold_pct": 100.0, "manual_approval": True},
                           device={"timeout_s": 60.0}) as h:
            await h.start()
            check_views(h)
            seq = 1000
            for step in plan:
                if step[0] == "report":
                    _, i, state = step
                    seq += 1
                    report = RolloutReport(device=h.ids[i], rollout_id=h.rid, version="1.1.0", state=state,
                                          phase=PHASE[state], ts_ms=h.clock.now_ms(), seq=seq)  # type: ignore[arg-type]
                    try:
                        await h.orch.on_report(f"m{seq}", report)
                    except ReportRefused:  # a device not offered anything yet: its row is as it was
                        row = h.store.device(h.rid, h.ids[i])
                        assert row is None or row.offers == 0
                elif step[0] == "control":
                    try:
                        await h.orch.control(h.rid, step[1])
                    except RolloutError:
                        pass  # a control that does not apply now is refused, changing nothing
                else:
                    await h.clock.advance(step[1])
                check_views(h)
            view = check_views(h)
            if view["state"] == "succeeded":  # 100 % success threshold: every device succeeded
                assert view["counts"] == {"succeeded": DEVICES}, view

    asyncio.run(run())
