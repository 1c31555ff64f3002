"""What the ConfigServers served, kept per rollout and added up across leader restarts."""

from __future__ import annotations

from pathlib import Path

from rollout_support import spec_data

from agent.core.clock import VirtualClock
from rollout_engine.spec import spec_from_dict
from rollout_engine.status import describe
from rollout_engine.store import RolloutStore


def test_serving_figures_add_up_and_keep_the_high_water_mark(tmp_path: Path) -> None:
    artifact = tmp_path / "fw.eafw"
    artifact.write_bytes(b"x")
    db = tmp_path / "leader.db"
    with RolloutStore.open(db, clock=VirtualClock()) as store:
        store.create_rollout("r1", spec=spec_from_dict(spec_data(artifact)), artifact=str(artifact), version="2.0.0",
                             signed_manifest=b"m", waves=[["d1"], ["d2"]], from_versions={})
        assert store.serving("r1") == {"chunks": 0, "bytes": 0, "busy": 0, "rejected": 0, "max_concurrent": 0}
        store.add_serving("r1", chunks=10, bytes_=40_960, busy=3, rejected=0, max_concurrent=4)
    with RolloutStore.open(db, clock=VirtualClock()) as store:  # the leader restarted: its pools count from 0
        store.add_serving("r1", chunks=5, bytes_=20_480, busy=0, rejected=1, max_concurrent=2)
        assert store.serving("r1") == {"chunks": 15, "bytes": 61_440, "busy": 3, "rejected": 1, "max_concurrent": 4}
        assert describe(store, "r1")["serving"]["bytes"] == 61_440
