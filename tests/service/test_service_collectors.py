"""Collectors over the real snapshot types of the mailbox, outbox and relay; health checks."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import msgspec
from promparse import parse

from agent.actors.mailbox import MailboxStatistics
from agent.core.clock import SystemClock
from agent.core.gate import Gate
from agent.outbox.metrics import LaneMetrics, RelayMetrics
from agent.outbox.types import ClassStats, OutboxStats
from agent.service.checks import (
    disk_space_check,
    gate_check,
    predicate_check,
    sqlite_writable_check,
    task_check,
)
from agent.service.collectors import (
    mailbox_collector,
    outbox_collector,
    relay_collector,
    snapshot_collector,
)
from agent.service.prom import collect, render


async def scrape(collector) -> dict[str, dict]:
    return parse(render(await collect(collector)))


async def test_mailbox_series_per_mailbox() -> None:
    stats = [
        MailboxStatistics(name="leader", depth=3, capacity=1024, enqueued=10, processed=7,
                          rejected=2, dropped=1, coalesced=4, high_water=9),
        MailboxStatistics(name="jobs", depth=0, capacity=64, enqueued=1, processed=1,
                          rejected=0, dropped=0, coalesced=0, high_water=1, failed=1),
    ]
    fams = await scrape(mailbox_collector(lambda: stats))
    assert fams["ea_mailbox_depth"]["type"] == "gauge"
    assert fams["ea_mailbox_depth"]["samples"] == [({"mailbox": "leader"}, 3.0),
                                                  ({"mailbox": "jobs"}, 0.0)]
    assert fams["ea_mailbox_rejected_total"]["type"] == "counter"
    assert fams["ea_mailbox_coalesced_total"]["samples"][0] == ({"mailbox": "leader"}, 4.0)
    assert fams["ea_mailbox_failed_total"]["samples"][1] == ({"mailbox": "jobs"}, 1.0)


async def test_outbox_series_from_async_stats() -> None:
    snap = OutboxStats(
        enqueued=100, delivered=80, dead_lettered=2, expired=1, dropped=3, overwritten=4,
        pending=10, in_flight=2, dead=2, replayed=0, duplicates=5, rejected_full=1,
        oldest_pending_age_ms=2500,
        by_class={"telemetry": ClassStats(pending=9, pending_bytes=900),
                  "heartbeat": ClassStats(pending=1, in_flight=1, pending_bytes=40)},
    )

    async def stats() -> OutboxStats:
        return snap

    fams = await scrape(outbox_collector(stats))
    assert fams["ea_outbox_enqueued_total"]["samples"] == [({}, 100.0)]
    assert fams["ea_outbox_pending"]["samples"] == [({}, 10.0)]
    assert fams["ea_outbox_oldest_pending_age_seconds"]["samples"] == [({}, 2.5)]
    assert fams["ea_outbox_conservation_ok"]["samples"] == [({}, 1.0)]
    assert fams["ea_outbox_class_pending"]["samples"] == [({"class": "heartbeat"}, 1.0),
                                                         ({"class": "telemetry"}, 9.0)]


async def test_relay_series_with_aimd_limit_per_lane() -> None:
    metrics = RelayMetrics(
        lanes=(LaneMetrics(partition=0, kind="telemetry", limit=12, in_flight=3, queued=5,
                           successes=40, capacity_rejections=2, transient_failures=1),),
        sending=True, delivered=40, retried=3, capacity_rejections=2,
    )
    fams = await scrape(relay_collector(lambda: metrics))
    assert fams["ea_relay_delivered_total"]["samples"] == [({}, 40.0)]
    assert fams["ea_relay_sending"]["samples"] == [({}, 1.0)]
    assert fams["ea_relay_aimd_limit"]["samples"] == [({"partition": "0", "class": "telemetry"},
                                                       12.0)]


async def test_snapshot_collector_on_structs_and_dataclasses() -> None:
    class Rollout(msgspec.Struct):
        devices_done: int
        devices_failed: int
        waves: dict[str, int]
        name: str

    fams = await scrape(snapshot_collector(
        "ea_rollout", lambda: Rollout(5, 1, {"canary": 2, "wave1": 3}, "r1"),
        counters=["devices_done"], label="wave",
    ))
    assert fams["ea_rollout_devices_done_total"]["type"] == "counter"
    assert fams["ea_rollout_devices_failed"]["samples"] == [({}, 1.0)]
    assert fams["ea_rollout_waves"]["samples"] == [({"wave": "canary"}, 2.0),
                                                  ({"wave": "wave1"}, 3.0)]
    assert "ea_rollout_name" not in fams


async def test_gate_predicate_and_task_checks() -> None:
    gate = Gate()
    assert await gate_check(gate)() == (False, "disconnected")
    gate.open()
    assert await gate_check(gate)() == (True, "connected")
    assert await predicate_check(lambda: False)() == (False, "dead")

    stop = asyncio.Event()
    task = asyncio.create_task(stop.wait())
    assert await task_check(task)() == (True, "running")
    stop.set()
    await task
    assert await task_check(task)() == (False, "finished")

    async def boom() -> None:
        raise RuntimeError("relay crashed")

    failed = asyncio.create_task(boom())
    await asyncio.gather(failed, return_exceptions=True)
    assert await task_check(lambda: failed)() == (False, "stopped: RuntimeError: relay crashed")
    assert await task_check(lambda: None)() == (False, "not started")


async def test_disk_space_check(tmp_path: Path) -> None:
    ok, detail = await disk_space_check(tmp_path, min_free_bytes=1)()
    assert ok and "free of" in detail
    ok, _ = await disk_space_check(tmp_path, min_free_bytes=2**62)()
    assert not ok
    ok, detail = await disk_space_check(tmp_path / "missing", min_free_bytes=1)()
    assert not ok and "cannot stat" in detail


async def test_sqlite_writable_check(tmp_path: Path) -> None:
    db = tmp_path / "outbox.db"
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("CREATE TABLE t (x)")
    check = sqlite_writable_check(db, clock=SystemClock(), timeout_s=0.05)
    assert await check() == (True, "writable")
    conn.execute("BEGIN IMMEDIATE")  # a writer holds the lock
    ok, detail = await check()
    assert not ok and "locked" in detail
    conn.execute("ROLLBACK")
    conn.close()
    ok, detail = await sqlite_writable_check(tmp_path / "nope.db", clock=SystemClock())()
    assert not ok and "cannot open" in detail
