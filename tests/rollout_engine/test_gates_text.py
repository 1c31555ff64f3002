"""Every text a user reads numbers waves from 1, as `edge-agent rollout list` does: the canary,
when there is one, is wave 1. Exact texts of the gates, the controls, the status screen and
the plan's errors."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rollout_support import Harness

from agent.cli import main as cli_main
from agent.core.errors import RolloutError
from rollout_engine.plan import wave_sizes
from rollout_engine.spec import WavesSection
from rollout_engine.status import describe, wave_label, wave_number


def detail(h: Harness) -> str:
    r = h.store.get(h.rid)
    assert r is not None
    return r.detail


def test_wave_numbers_and_labels() -> None:
    assert [wave_number(i) for i in range(3)] == [1, 2, 3]
    assert wave_label(0, canary=True) == "wave 1 (canary)"
    assert wave_label(0) == "wave 1"
    assert wave_label(3) == "wave 4"


async def test_a_failing_canary_is_named_wave_1(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        await h.start()
        assert detail(h) == "wave 1 of 3 running"
        await h.clock.advance(1.5)
        canary = h.wave_members(0)
        await h.report(canary[0], "succeeded")
        await h.report(canary[1], "rolled_back", detail="health check failed")
        await h.clock.advance(5)
        assert h.rollout_state() == "aborted"
        assert detail(h) == "wave 1 (canary) failed its success gate: 1 of 2 succeeded (50.0% < 100%)"
        status = describe(h.store, h.rid)
        assert [(w["index"], w["number"], w["canary"]) for w in status["waves"]] == [
            (0, 1, True), (1, 2, False), (2, 3, False)]
        assert status["current_wave"] == 0 and status["current_wave_number"] == 1


async def test_a_failing_later_wave_is_named_by_its_number(tmp_path: Path) -> None:
    async with Harness(tmp_path, 8, waves={"canary": 0, "counts": [4, 4]}) as h:
        await h.start()
        assert detail(h) == "wave 1 of 2 running"
        await h.clock.advance(1.5)
        await h.succeed(*h.wave_members(0))
        await h.clock.advance(5)
        assert detail(h) == "wave 2 of 2 running"
        await h.clock.advance(1.5)
        second = h.wave_members(1)
        await h.succeed(*second[:3])
        await h.report(second[3], "failed", detail="flash write failed")
        await h.clock.advance(5)
        assert detail(h) == "wave 2 failed its success gate: 3 of 4 succeeded (75.0% < 100%)"


async def test_approval_and_next_texts_count_from_1(tmp_path: Path) -> None:
    async with Harness(tmp_path, gates={"success_threshold_pct": 100.0, "manual_approval": True}) as h:
        await h.start()
        with pytest.raises(RolloutError) as not_yet:
            await h.orch.control(h.rid, "approve")
        assert str(not_yet.value) == "rollout r1: wave 1 is running, not awaiting approval"
        await h.clock.advance(1.5)
        await h.succeed(*h.wave_members(0))
        await h.clock.advance(5)
        assert detail(h) == "wave 1 (canary) passed; waiting for `rollout approve r1`"
        assert await h.orch.control(h.rid, "approve") == "r1: wave 2 started (approved by operator)"
        assert detail(h) == "wave 2 of 3 running"
        assert await h.orch.control(h.rid, "next") == "r1: wave 3 started (moved past by operator)"
        with pytest.raises(RolloutError) as last:
            await h.orch.control(h.rid, "next")
        assert str(last.value) == "rollout r1: wave 3 is the last wave"


async def test_status_screen_and_list_agree_on_the_wave(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from agent.commands.rollout import render_status

    async with Harness(tmp_path) as h:
        await h.start()
        await h.clock.advance(1.5)
        await h.succeed(*h.wave_members(0))
        await h.clock.advance(5)  # the canary passed (no soak): wave 2 runs
        assert detail(h) == "wave 2 of 3 running"
        out = io.StringIO()
        Console(file=out, width=120).print(render_status(describe(h.store, h.rid)))
        rows = [line.split()[:2] for line in out.getvalue().splitlines()[3:6]]
        assert rows == [["1", "canary"], ["2", "4"], ["3", "4"]]
        assert "wave 2 of 3 running" in out.getvalue()
        db = h.db
    assert cli_main(["rollout", "list", "--db", str(db)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[1].split()[4] == "2/3"


def test_plan_errors_number_waves_from_1() -> None:
    with pytest.raises(RolloutError) as empty:
        wave_sizes(WavesSection(canary=1, percents=[1.0, 99.0]), 11)
    assert str(empty.value) == "wave 2 (1% of 10 devices) would hold no device; use fewer or larger waves"
