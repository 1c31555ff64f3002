"""Pruning the rollout's processed report ids: by age, in bounded batches, never an active
rollout's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_support import spec_data

from agent.core.clock import VirtualClock
from rollout_engine.spec import spec_from_dict
from rollout_engine.store import RolloutStore

DAY = 86_400.0


def _create(store: RolloutStore, rollout_id: str, artifact: Path) -> None:
    spec = spec_from_dict(spec_data(artifact))
    store.create_rollout(rollout_id, spec=spec, artifact=str(artifact), version="2.0.0", signed_manifest=b"m",
                         waves=[["d1"], ["d2"]], from_versions={})


def _claim(store: RolloutStore, *ids: str) -> None:
    with store.atomic():
        for msg_id in ids:
            assert store.claim(msg_id)


def _prune_all(store: RolloutStore, limit: int) -> list[int]:
    batches = []
    while True:
        n = store.prune_processed(DAY, limit=limit)
        batches.append(n)
        if n < limit:
            return batches


async def test_old_reports_go_in_batches_and_an_active_rollouts_stay(tmp_path: Path, db: Path | str) -> None:
    clock = VirtualClock()
    artifact = tmp_path / "fw.bin"
    artifact.write_bytes(b"x" * 64)
    store = RolloutStore.open(db, clock=clock)
    try:
        _create(store, "r-old", artifact)
        _claim(store, *(f"old-{i}" for i in range(10)))
        store.set_rollout("r-old", state="succeeded")
        await clock.advance(3600)
        _create(store, "r-new", artifact)  # running from here on
        _claim(store, *(f"new-{i}" for i in range(6)))
        await clock.advance(3 * DAY)  # everything is older than the one-day window now

        assert _prune_all(store, 4) == [4, 4, 2]  # the finished rollout's, four at a time
        assert store.processed_count() == 6
        assert not store.claim("new-0")  # the running rollout's ids still deduplicate
        store.set_rollout("r-new", state="paused")
        assert store.prune_processed(DAY, limit=100) == 0  # paused is still active
        store.set_rollout("r-new", state="aborted")
        assert store.prune_processed(DAY, limit=100) == 6
        assert store.processed_count() == 0
        _claim(store, "fresh")
        assert store.prune_processed(DAY) == 0  # inside the window: kept
    finally:
        store.close()


# -- per-device rows of finished rollouts ------------------------------------------------------
def _rows(store: RolloutStore, rollout_id: str) -> tuple[int, int, int]:
    """(devices, offers, controls) held for `rollout_id`."""
    return (len(store.devices(rollout_id)), len(store.offers(rollout_id)),
            int(store._q("SELECT COUNT(*) FROM rollout_controls WHERE rollout_id = ?", (rollout_id,))[0][0]))


def _fill(store: RolloutStore, rollout_id: str, artifact: Path, devices: int) -> None:
    spec = spec_from_dict(spec_data(artifact))
    names = [f"{rollout_id}-d{i}" for i in range(devices)]
    store.create_rollout(rollout_id, spec=spec, artifact=str(artifact), version="2.0.0", signed_manifest=b"m",
                         waves=[names[:1], names[1:]], from_versions={})
    with store.atomic():
        for i, name in enumerate(names):
            store.record_offer(rollout_id, name, 1)
            store.set_device(rollout_id, name, state="succeeded" if i % 3 else "failed")
        store.finish_control(store.add_control(rollout_id, "pause"), "paused")


def _finish(store: RolloutStore, rollout_id: str, state: str, now_ms: int) -> None:
    store.set_rollout(rollout_id, state=state, finished_ms=now_ms)


async def test_finished_rollouts_lose_their_device_rows_in_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.cli import main as cli

    clock = VirtualClock()
    artifact = tmp_path / "fw.bin"
    artifact.write_bytes(b"x" * 64)
    db = tmp_path / "leader.db"
    store = RolloutStore.open(db, clock=clock)
    try:
        for rid, state in (("r-ok", "succeeded"), ("r-abort", "aborted"), ("r-cancel", "canceled")):
            _fill(store, rid, artifact, 6)
            _finish(store, rid, state, clock.now_ms())
        _fill(store, "r-paused", artifact, 4)
        store.set_rollout("r-paused", state="paused")
        _fill(store, "r-busy", artifact, 3)  # aborted while a device was still installing
        store.set_device("r-busy", "r-busy-d1", state="installing")
        _finish(store, "r-busy", "aborted", clock.now_ms())
        store.add_control("r-ok", "resume")  # not applied yet: the leader still answers it
        await clock.advance(10 * DAY)
        _fill(store, "r-recent", artifact, 5)
        _finish(store, "r-recent", "succeeded", clock.now_ms())
        await clock.advance(DAY)
        assert store.prune_finished(30 * DAY, limit=100) == 0  # nothing finished 30 days ago
        assert _rows(store, "r-ok") == (6, 6, 2)

        batches = []
        while True:
            n = store.prune_finished(5 * DAY, limit=5)
            batches.append(n)
            if n < 5:
                break
        # three rollouts x (6 devices + 6 offers + 6 state changes) = 54 rows, five at a time
        assert sum(batches) == 54 and max(batches) == 5 and batches[-1] == 4
        for rid in ("r-ok", "r-abort", "r-cancel"):
            assert _rows(store, rid)[:2] == (0, 0) and store.state_changes(rid) == []
        assert _rows(store, "r-ok")[2] == 2  # the controls stay: the audit record, and the pending one
        assert store.pending_controls()[0].rollout_id == "r-ok"
        assert _rows(store, "r-abort")[2] == 1
        assert _rows(store, "r-paused") == (4, 4, 1)  # active: untouched however old
        assert _rows(store, "r-busy") == (3, 3, 1)  # a device mid-update: untouched
        assert _rows(store, "r-recent") == (5, 5, 1)  # finished one day ago: kept
        assert store.prune_finished(5 * DAY, limit=5) == 0

        # the summaries stay: list and status still show every rollout, with how it ended
        r = store.get("r-ok")
        assert r is not None and r.state == "succeeded" and r.wave_count == 2
        assert r.detail.endswith("device rows pruned: 6 devices (failed 2, succeeded 4)")
        assert [w.size for w in store.waves("r-ok")] == [1, 5]

        store.set_device("r-busy", "r-busy-d1", state="failed")  # the device reported at last
        assert store.prune_finished(5 * DAY) == 3 + 3 + 5  # devices, offers, state changes (3 + installing, failed)
        assert _rows(store, "r-busy") == (0, 0, 1)  # its control stays: the audit record
    finally:
        store.close()

    assert cli(["rollout", "list", "--db", str(db), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [i["id"] for i in listed] == ["r-ok", "r-abort", "r-cancel", "r-paused", "r-busy", "r-recent"]
    assert listed[0]["state"] == "succeeded" and listed[0]["devices"] == 0
    assert cli(["rollout", "status", "r-abort", "--db", str(db), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "aborted" and status["devices"] == 0 and len(status["waves"]) == 2
    assert "device rows pruned: 6 devices" in status["detail"]
    assert [(c["action"], c["outcome"]) for c in status["audit"]] == [("pause", "applied")]  # who did what stays
    assert cli(["rollout", "status", "r-ok", "--db", str(db), "--devices"]) == 0
    assert "SUCCEEDED" in capsys.readouterr().out
