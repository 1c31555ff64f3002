"""Pruning the rollout's processed report ids: by age, in bounded batches, never an active
rollout's."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_support import spec_data  # noqa: E402

from agent.core.clock import VirtualClock  # noqa: E402
from firmware_rollout.rollout_store import RolloutStore  # noqa: E402
from firmware_rollout.spec import spec_from_dict  # noqa: E402

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


async def test_old_reports_go_in_batches_and_an_active_rollouts_stay(tmp_path: Path) -> None:
    clock = VirtualClock()
    artifact = tmp_path / "fw.bin"
    artifact.write_bytes(b"x" * 64)
    store = RolloutStore.open(tmp_path / "leader.db", clock=clock)
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
