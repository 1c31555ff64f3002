"""A rollout starts only from an artifact the leader checked and copied, owns its devices, and
counts a device's download progress as life."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_support import Harness, spec_data

from agent.core.errors import RolloutError
from firmware_rollout.artifact.fixture import make_artifact
from firmware_rollout.orchestration.artifacts import ArtifactStore
from firmware_rollout.orchestration.kind import FirmwareKind
from rollout_engine.keys import generate_keypair, load_verify_key
from rollout_engine.spec import spec_from_dict


def with_store(h: Harness, key_dir: Path | None = None) -> Path:
    """Give the harness's orchestrator the leader's artifact store (the fleet key: the harness's)."""
    public = (key_dir or h.tmp_path / "keys") / "public.pem"
    store_dir = h.tmp_path / "artifacts"
    h.orch.kinds["firmware"] = FirmwareKind(ArtifactStore(store_dir, load_verify_key(public)))
    return store_dir


async def test_the_rollout_serves_the_leaders_copy_not_the_operators_file(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        store_dir = with_store(h)
        original = h.artifact.read_bytes()
        await h.start()
        r = h.store.get(h.rid)
        assert r is not None and Path(r.artifact).parent == store_dir
        assert Path(r.artifact).read_bytes() == original
        h.artifact.write_bytes(b"rebuilt by the operator mid-rollout")  # changes nothing served
        assert Path(r.artifact).read_bytes() == original
        assert [p.name for p in store_dir.iterdir()] == [Path(r.artifact).name]  # no temporary left


@pytest.mark.parametrize("damage", ["tampered", "other key", "truncated"])
async def test_a_damaged_or_foreign_artifact_starts_nothing(tmp_path: Path, db: Path | str, damage: str) -> None:
    async with Harness(tmp_path, db=db) as h:
        store_dir = with_store(h)
        data = bytearray(h.artifact.read_bytes())
        if damage == "tampered":
            data[-10] ^= 0xFF  # one image byte: its chunk no longer matches the signed hash
            h.artifact.write_bytes(bytes(data))
        elif damage == "truncated":
            h.artifact.write_bytes(bytes(data[: len(data) // 2]))
        else:
            other = tmp_path / "other"
            generate_keypair(other)
            with_store(h, key_dir=other)
        with pytest.raises(RolloutError, match="refused"):
            await h.start()
        assert h.store.rollouts() == []
        assert list(store_dir.iterdir()) == []


async def test_without_the_fleet_key_the_leader_refuses_to_start(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        h.orch.kinds["firmware"] = FirmwareKind(ArtifactStore(tmp_path / "artifacts", None))
        with pytest.raises(RolloutError, match=r"no \[firmware\] public_key"):
            await h.start()


async def test_a_rollback_must_be_signed_as_one(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        with_store(h)
        await h.start()
        await h.succeed(*h.wave_members(0))
        plain, _ = make_artifact(tmp_path, version="1.0.0", chunk_size=1024, size=4096)
        with pytest.raises(RolloutError, match="not signed as a rollback"):
            await h.orch.control(h.rid, "rollback", str(plain))
        anywhere, _ = make_artifact(tmp_path, version="1.0.1", chunk_size=1024, size=4096, rollback=True)
        with pytest.raises(RolloutError, match="names no version it may replace"):
            await h.orch.control(h.rid, "rollback", str(anywhere))
        other, _ = make_artifact(tmp_path, version="1.0.2", chunk_size=1024, size=4096, rollback=True,
                                 rollback_from=("1.0.9",))
        with pytest.raises(RolloutError, match=r"replaces only version 1.0.9; the devices to roll back run 1.1.0"):
            await h.orch.control(h.rid, "rollback", str(other))
        signed, _ = make_artifact(tmp_path, version="1.0.3", chunk_size=1024, size=4096, rollback=True,
                                  rollback_from=("1.1.0",))
        assert "offers the previous version to 2 devices" in await h.orch.control(h.rid, "rollback", str(signed))


async def test_a_second_rollout_may_not_take_the_devices_of_an_unfinished_one(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        await h.start()  # canary of 2 offered, 8 queued
        offered = set(h.wave_members(0))
        queued = [d for d in h.ids if d not in offered]
        spec = spec_from_dict(spec_data(h.artifact, waves={"canary": 0, "counts": [8]}))
        with pytest.raises(RolloutError) as conflict:
            await h.orch.start_rollout(spec, rollout_id="r2")
        text = str(conflict.value)
        assert "10 of its devices belong to an unfinished rollout" in text and "(queued in r1)" in text
        assert "supersede" in text
        await h.orch.control("r1", "pause")  # paused is not finished
        with pytest.raises(RolloutError, match="belong to an unfinished rollout"):
            await h.orch.start_rollout(spec, rollout_id="r2", devices=queued)
        assert h.store.get("r2") is None


async def test_supersede_takes_over_the_queued_devices_and_never_the_ones_in_progress(
        tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        await h.start()
        offered = set(h.wave_members(0))
        queued = sorted(d for d in h.ids if d not in offered)
        data = spec_data(h.artifact, waves={"canary": 0, "counts": [8]})
        data["rollout"]["supersede"] = "r1"
        spec = spec_from_dict(data)
        with pytest.raises(RolloutError, match=r"notified in r1: wait for it to finish, or cancel r1"):
            await h.orch.start_rollout(spec, rollout_id="r2")  # all ten: two are being updated by r1
        await h.orch.start_rollout(spec, rollout_id="r2", devices=queued)
        for device in queued:
            row = h.store.device("r1", device)
            assert row is not None and (row.state, row.detail) == ("canceled", "superseded by r2")
            assert h.store.device("r2", device) is not None
        for device in offered:
            assert h.state(device) == "notified"  # r1 keeps what it had started
        await h.succeed(*offered)
        await h.clock.advance(30)  # r1 goes on through its waves: none of the devices it gave up
        assert not [d for _, d, rollout in h.port.offers if rollout == "r1" and d in queued]
        assert {d for _, d, rollout in h.port.offers if rollout == "r2"} == set(queued)


async def test_a_slow_download_that_shows_progress_is_not_timed_out(tmp_path: Path, db: Path | str) -> None:
    from rollout_engine.messages import DownloadProgress, RolloutReport
    from rollout_engine.status import describe

    async with Harness(tmp_path, db=db, device={"timeout_s": 30.0}) as h:
        await h.start()
        device = h.wave_members(0)[0]
        for i in range(1, 11):  # 200 s of downloading, a progress report every 20 s
            report = RolloutReport(device=device, rollout_id=h.rid, version="1.1.0", state="downloading",
                                  phase="downloading", detail=f"{i * 10}%", ts_ms=h.clock.now_ms(), seq=i,
                                  progress=DownloadProgress(chunks_done=i, chunks_total=10, bytes_done=i * 400,
                                                            bytes_total=4000, rate_bytes_per_s=20.0))
            assert await h.orch.on_report(f"p{i}", report)
            await h.clock.advance(20)
            assert h.state(device) == "downloading", i
        wave = describe(h.store, h.rid)["waves"][0]
        assert wave["download"]["bytes_done"] == 4000 and wave["download"]["progress_reports"] == 10
        assert describe(h.store, h.rid)["progress_reports"] == 10
        await h.clock.advance(15)  # and 30 s without progress is a timeout
        assert h.state(device) == "timed_out"


async def test_a_rollback_no_device_took_ends_failed_not_succeeded(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        with_store(h)
        await h.start()
        canary = h.wave_members(0)
        await h.succeed(*canary)
        signed, _ = make_artifact(tmp_path, version="1.0.1", chunk_size=1024, size=4096, rollback=True,
                                  rollback_from=("1.1.0",))
        await h.orch.control(h.rid, "rollback", str(signed))
        h.rid = "r1-rollback"
        await h.clock.advance(1.5)  # offered
        for device in canary:  # every device refuses it
            await h.report(device, "rejected", detail="downgrade refused")
        await h.clock.advance(5)
        r = h.store.get("r1-rollback")
        assert r is not None and r.state == "failed", r
        assert r.detail == "no device went back to version 1.0.1: 2 rejected"


async def test_a_paused_rollout_starts_no_wave(tmp_path: Path, db: Path | str) -> None:
    async with Harness(tmp_path, db=db) as h:
        await h.start()
        await h.orch.control(h.rid, "pause")
        for action in ("next", "approve"):
            with pytest.raises(RolloutError, match="is paused: `rollout resume r1` first"):
                await h.orch.control(h.rid, action)
        assert h.wave_state(1) == "pending"
