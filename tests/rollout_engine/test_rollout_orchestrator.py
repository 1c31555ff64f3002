"""The orchestrator's state machine on a virtual clock, with a fake leader (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_support import Harness

from agent.core.errors import RolloutError, StoreUnavailable
from rollout_engine.messages import RolloutReport
from rollout_engine.status import describe
from rollout_engine.store import RolloutReads


async def finish_wave(h: Harness, idx: int, *, soak_s: float = 0.0) -> None:
    members = h.wave_members(idx)
    await h.clock.advance(1.5)  # the tick offers them
    for d in members:
        assert h.state(d) == "notified"
    await h.succeed(*members)
    if soak_s:
        await h.clock.advance(soak_s / 2)
        h.port.heartbeat()
        await h.clock.advance(soak_s / 2 + 1.5)
    else:
        await h.clock.advance(1.5)


async def test_clean_rollout_goes_wave_by_wave_and_offers_each_device_once(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        await h.start()
        assert [len(h.wave_members(i)) for i in range(3)] == [2, 4, 4]
        await h.clock.advance(1.5)
        assert sorted(h.port.offered()) == h.wave_members(0)  # only the canary is offered
        for idx in range(3):
            await finish_wave(h, idx)
        assert h.rollout_state() == "succeeded"
        assert sorted(h.port.offered()) == sorted(h.ids)
        status = describe(h.store, h.rid)
        assert status["counts"] == {"succeeded": 10}
        assert [w["state"] for w in status["waves"]] == ["passed"] * 3


async def test_failing_canary_stops_everything(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        await h.start()
        await h.clock.advance(1.5)
        canary = h.wave_members(0)
        await h.report(canary[0], "succeeded")
        await h.report(canary[1], "rolled_back", detail="health check failed", excerpt=("-- edge-agent --", "why"))
        await h.clock.advance(5)
        assert h.rollout_state() == "aborted"
        # the lines its report carried, kept with the rollout for `rollout status --device`
        logs = RolloutReads(h.store.connection).logs_of(canary[1])
        assert logs[h.rid].lines == ("-- edge-agent --", "why") and logs[h.rid].state == "rolled_back"
        assert RolloutReads(h.store.connection).logs_of(canary[0]) == {}
        assert h.wave_state(0) == "failed"
        assert h.wave_state(1) == h.wave_state(2) == "canceled"
        assert sorted(h.port.offered()) == canary
        for d in h.wave_members(1) + h.wave_members(2):
            assert h.state(d) == "canceled"
        assert "canary" in describe(h.store, h.rid)["detail"]


async def test_failure_threshold_aborts_and_leaves_the_rest_untouched(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, 20, db=db, waves={"canary": 0, "counts": [10, 10]},
                       gates={"success_threshold_pct": 0.0, "failure_threshold_pct": 20.0, "min_finished": 5}) as h:
        await h.start()
        await h.clock.advance(1.5)
        first = h.wave_members(0)
        await h.succeed(*first[:3])
        await h.report(first[3], "failed")
        await h.clock.advance(1.5)
        assert h.rollout_state() == "running"  # 1 of 4 finished: below min_finished
        await h.report(first[4], "failed")  # 2 of 5 = 40% > 20%
        await h.clock.advance(1.5)
        assert h.rollout_state() == "aborted"
        await h.clock.advance(60)
        assert all(d in first for d in h.port.offered())
        assert all(h.state(d) == "canceled" for d in h.wave_members(1))
        assert describe(h.store, h.rid)["devices_offered_after_abort"] == 0


async def test_failure_threshold_can_pause_and_resume_counts_afresh(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, 20, db=db, waves={"canary": 0, "counts": [10, 10]},
                       gates={"success_threshold_pct": 0.0, "failure_threshold_pct": 20.0, "min_finished": 2,
                              "failure_action": "pause"}) as h:
        await h.start()
        await h.clock.advance(1.5)
        first = h.wave_members(0)
        await h.report(first[0], "failed")
        await h.report(first[1], "failed")
        await h.clock.advance(1.5)
        assert h.rollout_state() == "paused"
        await h.orch.control(h.rid, "resume")
        await h.succeed(*first[2:])
        await h.clock.advance(3)
        assert h.rollout_state() == "running"
        assert h.wave_state(1) == "running"


async def test_a_device_that_never_answers_times_out_and_is_retried(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, 3, db=db, waves={"canary": 0, "counts": [3]}, gates={"success_threshold_pct": 0.0},
                       device={"timeout_s": 100.0, "retries": 1, "retry_backoff_s": 30.0}) as h:
        await h.start()
        await h.clock.advance(1.5)
        a, b, c = h.ids
        await h.succeed(a, b)
        await h.report(c, "downloading")
        await h.clock.advance(99)
        assert h.state(c) == "downloading"  # progress re-armed the timer
        await h.clock.advance(5)
        assert h.state(c) == "queued"  # timed out; a retry after the backoff
        assert h.port.offered(c) == [c]
        await h.clock.advance(31)
        assert h.port.offered(c) == [c, c]
        await h.clock.advance(101)
        assert h.state(c) == "timed_out"
        assert "no progress" in h.store.device(h.rid, c).detail  # type: ignore[union-attr]
        assert h.rollout_state() == "succeeded"  # 2 of 3 and the threshold is 0


async def test_offline_devices_stay_queued_until_they_return_or_time_out(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, 3, db=db, waves={"canary": 0, "counts": [3]},
                       gates={"success_threshold_pct": 0.0}) as h:
        a, b, c = h.ids
        h.port.set_online(b, False)
        h.port.set_online(c, False)
        await h.start()
        await h.clock.advance(30)
        assert h.port.offered() == [a]
        assert h.state(b) == h.state(c) == "queued"
        h.port.set_online(b, True)
        await h.clock.advance(2)
        assert h.port.offered(b) == [b]
        await h.succeed(a, b)
        await h.clock.advance(80)
        assert h.state(c) == "timed_out"
        assert h.port.offered(c) == []
        assert h.rollout_state() == "succeeded"


async def test_pause_resume_cancel(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        await h.start()
        await h.clock.advance(1.5)
        await h.orch.control(h.rid, "pause")
        await h.succeed(*h.wave_members(0))
        await h.clock.advance(10)
        assert h.rollout_state() == "paused"
        assert h.wave_state(1) == "pending"  # gates wait while paused
        await h.orch.control(h.rid, "resume")
        await h.clock.advance(1.5)
        assert h.wave_state(1) == "running"
        await h.clock.advance(1.5)
        assert len(h.port.offered()) == 6
        await h.orch.control(h.rid, "cancel")
        assert h.rollout_state() == "canceled"
        assert all(h.state(d) == "canceled" for d in h.wave_members(2))
        with pytest.raises(RolloutError, match="canceled"):
            await h.orch.control(h.rid, "resume")
        await h.clock.advance(30)
        assert len(h.port.offered()) == 6


async def test_next_forces_the_next_wave_and_approve_gates_manual_waves(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db, gates={"success_threshold_pct": 100.0, "manual_approval": True}) as h:
        await h.start()
        with pytest.raises(RolloutError, match="not awaiting approval"):
            await h.orch.control(h.rid, "approve")
        await h.orch.control(h.rid, "next")  # the canary has not even finished
        assert h.wave_state(0) == "passed" and h.wave_state(1) == "running"
        await h.clock.advance(1.5)
        assert len(h.port.offered()) == 6
        await h.succeed(*h.wave_members(0), *h.wave_members(1))
        await h.clock.advance(5)
        assert h.wave_state(1) == "awaiting_approval"
        await h.clock.advance(300)
        assert h.wave_state(2) == "pending"
        await h.orch.control(h.rid, "approve")
        await h.clock.advance(1.5)
        assert h.wave_state(2) == "running"
        with pytest.raises(RolloutError, match="last wave"):
            await h.orch.control(h.rid, "next")
        await h.succeed(*h.wave_members(2))
        await h.clock.advance(2)
        assert h.rollout_state() == "succeeded"


async def test_controls_written_to_the_database_are_applied_on_the_tick(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        await h.start()
        control = h.store.add_control(h.rid, "pause")
        assert h.store.control(control).applied_ms is None  # type: ignore[union-attr]
        await h.clock.advance(1.1)
        row = h.store.control(control)
        assert row is not None and row.applied_ms is not None and row.result == "paused r1"
        bad = h.store.add_control(h.rid, "approve")
        await h.clock.advance(1.1)
        assert h.store.control(bad).refused  # type: ignore[union-attr]
        start = h.store.add_control("r2", "start", h.spec.to_json().decode())
        await h.clock.advance(1.1)
        refused = h.store.control(start)  # r1 is paused, not finished: it still owns its devices
        assert refused is not None and "belong to an unfinished rollout" in refused.result
        assert "(queued in r1)" in refused.result and h.store.get("r2") is None
        h.store.add_control(h.rid, "cancel")
        start = h.store.add_control("r2", "start", h.spec.to_json().decode())
        await h.clock.advance(1.1)
        assert h.store.control(start).result == "started r2"  # type: ignore[union-attr]
        assert h.store.get("r2") is not None


async def test_reports_are_deduplicated_by_id_and_ordered_by_seq(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        await h.start()
        await h.clock.advance(1.5)
        d = h.wave_members(0)[0]
        assert await h.report(d, "installing", msg_id="x", seq=5)
        assert not await h.report(d, "succeeded", msg_id="x", seq=9)  # same id: applied once only
        assert not await h.report(d, "downloading", msg_id="y", seq=3)  # older seq: stale
        assert h.state(d) == "installing"
        assert await h.report(d, "succeeded", msg_id="z", seq=6)
        assert h.state(d) == "succeeded"


async def test_soak_fails_devices_that_stop_heartbeating(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db, gates={"success_threshold_pct": 100.0, "soak_s": 60.0}) as h:
        await h.start()
        await h.clock.advance(1.5)
        canary = h.wave_members(0)
        await h.succeed(*canary)
        await h.clock.advance(2)
        assert h.wave_state(0) == "soaking"
        # the soak asked the wave's updated devices, once, for fast heartbeats until it ends (and a minute)
        paced = [(set(devices), for_s) for _, devices, for_s in h.port.paces]
        assert paced == [(set(canary), pytest.approx(120, abs=3))]
        await h.clock.advance(30)
        assert len(h.port.paces) == 1
        h.port.heartbeat(canary[0])  # the other one went quiet
        await h.clock.advance(35)
        assert h.state(canary[1]) == "failed"
        assert "heartbeat" in h.store.device(h.rid, canary[1]).detail  # type: ignore[union-attr]
        assert h.rollout_state() == "aborted"


async def test_timers_continue_from_their_stored_deadlines_after_a_restart(tmp_path: Path, db: Path | str) -> None:
    h = Harness(tmp_path, db=db, gates={"success_threshold_pct": 0.0}, device={"timeout_s": 100.0})
    await h.__aenter__()
    try:
        await h.start()
        await h.clock.advance(1.5)
        canary = h.wave_members(0)
        await h.report(canary[0], "downloading")
        await h.clock.advance(60)
        await h.restart()
        assert h.state(canary[0]) == "downloading"
        await h.clock.advance(30)
        assert h.state(canary[0]) == "downloading"
        await h.clock.advance(15)
        assert h.state(canary[0]) == "timed_out"  # 100 s after its last report, across the restart
        assert h.port.offered().count(canary[0]) == 1
    finally:
        await h.close()


async def test_devices_registering_during_the_rollout_join_the_last_wave(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db, targets={"include_new": True}) as h:
        await h.start()
        await h.clock.advance(1.5)
        h.port.register("late-1")
        await h.clock.advance(1.5)
        row = h.store.device(h.rid, "late-1")
        assert row is not None and row.wave == 2 and row.state == "queued"
        assert "late-1" not in h.port.offered()
        assert h.store.wave(h.rid, 2).size == 5  # type: ignore[union-attr]


async def test_rollback_offers_the_previous_version_to_devices_that_took_this_one(tmp_path: Path,
                                                                                  db: Path | str) -> None:
    from firmware_rollout.artifact.fixture import make_artifact

    async with Harness(tmp_path, db=db, gates={"success_threshold_pct": 0.0}) as h:
        previous, _ = make_artifact(tmp_path / "prev", version="1.0.0", rollback=True, chunk_size=1024, size=2048)
        await h.start()
        await h.clock.advance(1.5)
        canary = h.wave_members(0)
        await h.succeed(*canary)
        with pytest.raises(RolloutError, match="rollback_artifact"):
            await h.orch.control(h.rid, "rollback")
        result = await h.orch.control(h.rid, "rollback", str(previous))
        assert "r1-rollback" in result and "2 devices" in result
        assert h.rollout_state() == "canceled"
        back = h.store.get("r1-rollback")
        assert back is not None and back.version == "1.0.0" and back.rollback_of == "r1"
        await h.clock.advance(1.5)
        assert sorted(d for _, d, r in h.port.offers if r == "r1-rollback") == canary


async def test_unknown_rollout_and_bad_artifact_are_typed_errors(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        with pytest.raises(RolloutError, match="no rollout"):
            await h.orch.control("nope", "pause")
        h.artifact.write_bytes(b"garbage")
        with pytest.raises(RolloutError, match="artifact"):
            await h.start()


async def test_a_start_control_s_waves_are_the_rollout_s_waves_planned_once(tmp_path: Path, db: Path | str) -> None:
    """`rollout start` plans the waves against the registry and writes them with the spec; the
    leader starts the rollout on exactly those, and plans nothing again."""
    from rollout_engine.spec import StartControl

    async with Harness(tmp_path, db=db) as h:
        waves = [["d03"], ["d07", "d01"]]  # not what the leader's own plan of 10 devices would give
        start = h.store.add_control("r9", "start", StartControl(spec=h.spec, waves=waves).to_json().decode())
        await h.clock.advance(1.1)
        row = h.store.control(start)
        assert row is not None and row.outcome == "applied" and row.result == "started r9"
        h.rid = "r9"
        assert [sorted(h.wave_members(i)) for i in range(2)] == [["d03"], ["d01", "d07"]]
        assert sorted(d.device_id for d in h.store.devices("r9")) == ["d01", "d03", "d07"]


def test_controls_refused_before_the_outcome_column_read_as_refused(tmp_path: Path) -> None:
    from agent.core.clock import VirtualClock
    from agent.core.sqlite import connect, migrate
    from rollout_engine.schema import MIGRATIONS
    from rollout_engine.store import COMPONENT, RolloutStore

    db = tmp_path / "leader.db"
    conn = connect(db)
    migrate(conn, COMPONENT, MIGRATIONS[:9])  # a leader.db of the version before the outcome column
    with conn:
        conn.execute("INSERT INTO rollout_controls (rollout_id, action, arg, created_ms, applied_ms, result)"
                     " VALUES ('r1', 'approve', '', 1, 2, 'error: rollout r1 is paused'),"
                     " ('r1', 'pause', '', 1, 2, 'paused r1'), ('r1', 'cancel', '', 3, NULL, '')")
    conn.close()
    store = RolloutStore.open(db, clock=VirtualClock())
    try:
        refused, applied, pending = (store.control(n) for n in (1, 2, 3))
        assert refused is not None and refused.refused and refused.result == "rollout r1 is paused"
        assert applied is not None and applied.outcome == "applied" and applied.result == "paused r1"
        assert pending is not None and pending.outcome is None and not pending.refused
    finally:
        store.close()


async def test_a_report_about_a_rollout_that_offered_nothing_is_refused_and_changes_nothing(
        tmp_path: Path, db: Path | str) -> None:
    from rollout_engine.errors import ReportRefused

    async with Harness(tmp_path, db=db) as h:
        await h.start()
        later = h.wave_members(1)[0]  # in the rollout, not offered anything yet
        before = h.store.device(h.rid, later)
        assert before is not None and before.offers == 0
        with pytest.raises(ReportRefused, match="has offered .* nothing yet"):
            await h.report(later, "succeeded", msg_id="early")
        assert h.store.device(h.rid, later) == before
        with pytest.raises(ReportRefused, match="is not in a rollout 'no-such'"):
            await h.orch.on_report("stray", RolloutReport(device=later, rollout_id="no-such", version="1.1.0",
                                                          state="succeeded", phase="done", ts_ms=0, seq=9))
        await h.clock.advance(1.5)
        canary = h.wave_members(0)[0]  # offered: its reports count
        assert await h.report(canary, "downloading", msg_id="d1")


async def test_the_loop_outlives_a_database_that_goes_away_and_resumes_when_it_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL lost while a leader runs: every read the loop makes fails for a while; the
    loop keeps ticking (no task ended behind a healthy leader) and goes on when it returns."""
    async with Harness(tmp_path) as h:
        await h.start()
        await finish_wave(h, 0)
        away = StoreUnavailable("cannot connect to postgresql://ea@127.0.0.1/ea: refused (trying again shortly)")

        def fail(*_args: object, **_kwargs: object) -> None:
            raise away

        for name in ("next_deadline_ms", "rollouts", "due_devices", "pending_controls"):
            monkeypatch.setattr(h.store, name, fail)
        ticks, offered = h.orch.ticks, sorted(h.port.offered())
        await h.clock.advance(5)
        assert h.orch.ticks > ticks  # still ticking, each tick failing in one line
        assert sorted(h.port.offered()) == offered  # nothing goes on while it is away
        monkeypatch.undo()
        await finish_wave(h, 1)
        await finish_wave(h, 2)
        assert h.rollout_state() == "succeeded"


async def test_a_device_whose_tags_come_to_match_joins_the_last_wave(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db, targets={"select": "tags", "tags": ["cam"], "include_new": True}) as h:
        h.port.register("lab-1", tags=("lab",))  # known before the start, not one of its targets
        for n in range(4):
            h.port.register(f"cam-{n}", tags=("cam",))
        await h.start()
        await h.clock.advance(1.5)
        assert h.store.device(h.rid, "lab-1") is None
        h.port.register("lab-1", tags=("lab", "cam"))  # tagged into the group while the rollout runs
        await h.clock.advance(1.5)
        row = h.store.device(h.rid, "lab-1")
        assert row is not None and row.wave == h.store.get(h.rid).wave_count - 1  # type: ignore[union-attr]
