"""Metrics snapshots: the relay's counters and lanes joined with the store's stats."""

from __future__ import annotations

import random
from pathlib import Path

from relay_support import message

from agent.core.clock import VirtualClock
from agent.core.errors import Capacity, Permanent, Transient
from agent.core.gate import Gate
from agent.outbox.metrics import OutboxMetrics, RelayMetrics, collect_metrics
from agent.outbox.relay import Relay
from agent.outbox.retry import RetryPolicy
from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxRow, OutboxStats


async def test_snapshot_counts_every_outcome_and_conserves(tmp_path: Path) -> None:
    clock = VirtualClock()
    store = await OutboxStore.open(tmp_path / "m.db", clock=clock, max_attempts=2)
    seen: set[str] = set()

    async def deliver(row: OutboxRow) -> None:
        first = row.msg_id not in seen
        seen.add(row.msg_id)
        if row.msg_id.startswith("cap") and first:
            raise Capacity("full", retry_after_ms=100)
        if row.msg_id.startswith("flaky") and first:
            raise Transient("timeout")
        if row.msg_id.startswith("bad"):
            raise Permanent("malformed")
        if row.msg_id.startswith("poison"):
            raise Transient("chokes")

    kinds = {"ok": "status", "cap": "status", "flaky": "telemetry", "bad": "cmd", "poison": "cmd"}
    for prefix, kind in kinds.items():
        for i in range(3):
            await store.enqueue(message(f"{prefix}{i}", receiver=f"d{i}", kind=kind))
    relay = Relay(
        store, deliver, clock=clock, ready=Gate(is_open=True), partitions=2,
        retry=RetryPolicy(base_s=0.1, cap_s=1, transient_floor_s=0.1), rng=random.Random(9),
    )
    try:
        async with relay:
            for _ in range(20):
                await clock.advance(1)
            snap = await collect_metrics(store, relay)
    finally:
        await store.close()
    r = snap.relay
    assert r.delivered == 9  # ok, cap after its retry, flaky after its retry
    assert r.capacity_rejections == 3
    assert r.transient_failures == 3 + 6  # flaky once each, poison twice each
    assert r.permanent_failures == 3
    assert r.dead_lettered == 3 + 3  # bad at once, poison after max_attempts=2
    assert r.retried == 3 + 3 + 3  # cap, flaky, poison's first try
    assert r.in_flight == 0
    assert {lane.kind for lane in r.lanes} == {"status", "telemetry", "cmd"}
    assert all(lane.limit >= 1 for lane in r.lanes)
    assert set(r.limits()) == {(lane.partition, lane.kind) for lane in r.lanes}
    s = snap.store
    assert s.delivered == 9 and s.dead_lettered == 6 and s.pending == 0 and s.dead == 6
    assert snap.conservation_ok and snap.conservation_gap() == 0
    flat = snap.as_dict()
    assert flat["outbox_conservation_ok"] == 1.0
    assert flat["relay_capacity_rejections"] == 3
    assert flat["outbox_dead{class=cmd}"] == 6
    assert any(k.startswith("relay_limit{partition=") for k in flat)


async def test_without_a_relay_the_store_side_still_reports(tmp_path: Path) -> None:
    clock = VirtualClock()
    store = await OutboxStore.open(tmp_path / "m.db", clock=clock)
    try:
        await store.enqueue(message("a"))
        await clock.advance(2)
        snap = await collect_metrics(store)
    finally:
        await store.close()
    assert snap.relay == RelayMetrics()
    assert snap.store.pending == 1 and snap.conservation_ok
    assert snap.as_dict()["outbox_oldest_pending_age_ms"] >= 2000


def test_conservation_gap_names_the_missing_count() -> None:
    stats = OutboxStats(
        enqueued=10, delivered=5, dead_lettered=1, expired=1, dropped=1, overwritten=0,
        pending=1, in_flight=0, dead=1, replayed=0, duplicates=0, rejected_full=0,
        oldest_pending_age_ms=None,
    )
    snap = OutboxMetrics(relay=RelayMetrics(), store=stats)
    assert not snap.conservation_ok
    assert snap.conservation_gap() == 1
