"""Scheduling and pacing (start_at, end_at, devices per minute), abort criteria per failure kind,
and a rollback started by an abort."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_support import Harness

from agent.core.errors import ConfigError, RolloutError
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.spec import spec_from_dict


def iso(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC).isoformat().replace("+00:00", "Z")


async def test_a_scheduled_rollout_waits_for_its_start_and_stops_at_its_end(tmp_path: Path) -> None:
    async with Harness(tmp_path, waves={"canary": 0, "counts": [10]}, device={"timeout_s": 3600.0}) as h:
        now = h.clock.now_ms()
        h.spec = spec_from_dict({**h.spec_data, "schedule": {"start_at": iso(now + 600_000),
                                                             "end_at": iso(now + 1_200_000)}})
        await h.start()
        r = h.store.get(h.rid)
        assert r is not None and r.state == "scheduled" and r.detail.startswith("scheduled to start at")
        with pytest.raises(RolloutError, match="scheduled to start at"):
            await h.orch.control(h.rid, "pause")
        await h.clock.advance(590)
        assert h.port.offers == []  # nothing before the start
        await h.clock.advance(15)
        assert h.rollout_state() == "running" and len(h.port.offers) == 10
        await h.succeed(*h.ids[:4])
        await h.clock.advance(600)  # end_at: stop offering; updates in progress are left to finish
        r = h.store.get(h.rid)
        assert r is not None and r.state == "stopped" and "end_at" in r.detail
        assert h.port.cancels == []  # "stop" sends no cancel


async def test_end_behavior_cancel_sends_the_cancels(tmp_path: Path) -> None:
    async with Harness(tmp_path, waves={"canary": 0, "counts": [10]}) as h:
        h.spec = spec_from_dict({**h.spec_data, "schedule": {"end_at": iso(h.clock.now_ms() + 60_000),
                                                             "end_behavior": "cancel"}})
        await h.start()
        await h.clock.advance(65)
        assert h.rollout_state() == "canceled"
        assert sorted(d for d, _ in h.port.cancels) == sorted(h.ids)  # all ten were still updating


async def test_offers_keep_to_the_devices_per_minute(tmp_path: Path) -> None:
    async with Harness(tmp_path, waves={"canary": 0, "counts": [10]}) as h:
        h.spec = spec_from_dict({**h.spec_data, "schedule": {"devices_per_minute": 3}})
        await h.start()
        await h.clock.advance(30)
        assert len(h.port.offers) == 3
        await h.clock.advance(35)
        assert len(h.port.offers) == 6
        starts = sorted(at for at, _, _ in h.port.offers)
        for i in range(len(starts) - 3):  # never 4 within a minute
            assert starts[i + 3] - starts[i] >= 60_000


async def test_an_abort_criterion_per_failure_kind(tmp_path: Path) -> None:
    async with Harness(tmp_path, waves={"canary": 0, "counts": [10]},
                       gates={"failure_threshold_pct": 100.0, "abort": {"rolled_back_pct": 10.0}}) as h:
        await h.start()
        await h.succeed(*h.ids[:4])
        await h.report(h.ids[4], "failed")  # 1 of 5 failed: not a criterion here
        await h.clock.advance(2)
        assert h.rollout_state() == "running"
        await h.report(h.ids[5], "rolled_back")  # 1 of 6 rolled back: over 10 %
        await h.clock.advance(2)
        r = h.store.get(h.rid)
        assert r is not None and r.state == "aborted"
        assert "abort criterion: 1 of 6 finished devices rolled_back (16.7% > 10%)" in r.detail


async def test_an_abort_rolls_back_the_devices_it_updated(tmp_path: Path) -> None:
    previous, _ = make_artifact(tmp_path, version="1.0.1", chunk_size=1024, size=4096, rollback=True,
                                rollback_from=("1.1.0",))
    async with Harness(tmp_path) as h:
        h.spec = spec_from_dict({**h.spec_data, "gates": {**h.spec_data["gates"], "on_abort": "rollback"},
                                 "rollout": {**h.spec_data["rollout"], "rollback_artifact": str(previous)}})
        await h.start()
        canary = h.wave_members(0)
        await h.succeed(*canary)
        await h.clock.advance(2)
        await h.report(h.wave_members(1)[0], "rolled_back")  # wave 2 cannot reach 100 %
        for device in h.wave_members(1)[1:]:
            await h.report(device, "succeeded")
        await h.clock.advance(3)
        r = h.store.get(h.rid)
        assert r is not None and r.state == "aborted" and "rolled back by r1-rollback" in r.detail
        back = h.store.get("r1-rollback")
        assert back is not None and back.rollback_of == "r1" and back.version == "1.0.1"
        updated = sorted(canary + h.wave_members(1)[1:])
        assert sorted(d.device_id for d in h.store.devices("r1-rollback")) == updated


def test_schedule_mistakes_name_the_key(tmp_path: Path) -> None:
    artifact, _ = make_artifact(tmp_path)
    base = {"rollout": {"name": "x", "artifact": str(artifact)}, "waves": {"counts": [1]}}
    for section, key, message in (
            ({"schedule": {"start_at": "tomorrow"}}, "schedule.start_at", "not a time"),
            ({"schedule": {"start_at": "2026-12-02T01:00:00"}}, "schedule.start_at", "no time zone"),
            ({"schedule": {"start_at": "2026-12-02T01:00:00Z", "end_at": "2026-12-01T01:00:00Z"}}, "schedule.end_at",
             "after schedule.start_at"),
            ({"gates": {"on_abort": "rollback"}}, "gates.on_abort", "rollback_artifact"),
            ({"schedule": {"end_behavior": "explode"}}, "schedule.end_behavior", "explode")):
        with pytest.raises(ConfigError) as err:
            spec_from_dict({**base, **section})
        assert f": {key}:" in str(err.value) and message in str(err.value), str(err.value)
