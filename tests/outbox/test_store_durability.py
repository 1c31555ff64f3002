"""Durability per class: an enqueue of a "power" class returns once its commit is synced; a
"crash" class's commit is not synced; a round of many enqueues shares one sync (group commit).
The power cut itself is approximated in tests/outbox/test_power_cut.py."""

from __future__ import annotations

import asyncio

import pytest
from store_support import OpenStore, make_msg

from agent.outbox.policy import ClassPolicy


def synchronous_of(store: object) -> int:
    engine = store._writer.engine  # type: ignore[attr-defined]
    return int(engine.books.conn.execute("PRAGMA synchronous").fetchone()[0])


async def test_a_power_class_commit_is_synced_a_crash_class_commit_is_not(open_store: OpenStore) -> None:
    store = await open_store(classes={"fast": ClassPolicy(durability="crash")})
    assert store.durability_of("telemetry") == "power" and store.durability_of("fast") == "crash"
    before = store.synced_commits
    await store.enqueue(make_msg(kind="fast"))
    assert store.synced_commits == before
    assert synchronous_of(store) == 1  # NORMAL
    await store.enqueue(make_msg(kind="telemetry"))
    assert store.synced_commits == before + 1
    assert synchronous_of(store) == 2  # FULL


async def test_one_round_of_concurrent_enqueues_shares_one_sync(open_store: OpenStore) -> None:
    store = await open_store()
    before = store.synced_commits
    await asyncio.gather(*(store.enqueue(make_msg(kind="telemetry")) for _ in range(200)))
    assert store.synced_commits == before + 1
    assert (await store.stats()).pending == 200


async def test_a_round_with_one_power_message_is_synced_for_all(open_store: OpenStore) -> None:
    store = await open_store(classes={"fast": ClassPolicy(durability="crash")})
    before = store.synced_commits
    await asyncio.gather(store.enqueue(make_msg(kind="fast")), store.enqueue(make_msg(kind="telemetry")))
    assert store.synced_commits == before + 1


async def test_a_crash_store_syncs_only_its_power_classes(open_store: OpenStore) -> None:
    store = await open_store(durability="crash", classes={"orders": ClassPolicy(durability="power")})
    assert store.durability_of("telemetry") == "crash" and store.durability_of("orders") == "power"
    before = store.synced_commits
    await store.enqueue(make_msg(kind="telemetry"))
    assert store.synced_commits == before
    await store.enqueue_many([make_msg(kind="orders"), make_msg(kind="telemetry")])
    assert store.synced_commits == before + 1


async def test_acks_are_not_synced(open_store: OpenStore) -> None:
    store = await open_store(ack_delay_ms=0)
    await store.enqueue(make_msg(kind="telemetry"))
    rows = await store.take_ready(limit=10)
    before = store.synced_commits
    await store.ack([r.row_id for r in rows])
    assert store.synced_commits == before
    assert (await store.stats()).pending == 0


@pytest.mark.parametrize("bad", ["battery", "FULL"])
async def test_an_unknown_durability_is_refused(open_store: OpenStore, bad: str) -> None:
    with pytest.raises(ValueError, match="durability must be power or crash"):
        await open_store(durability=bad)
    with pytest.raises(ValueError, match="durability must be power or crash"):
        ClassPolicy(durability=bad)  # type: ignore[arg-type]


def test_the_config_says_each_kind_durability_heartbeats_crash_unless_told() -> None:
    from agent.core.config import AgentConfig, convert
    from agent.outbox.settings import durability, outbox_classes

    def cfg(**outbox: object) -> AgentConfig:
        return convert({"agent": {"device_id": "d"}, "outbox": outbox,
                        "classes": {"readings": {"durability": "crash"}, "orders": {}}}, AgentConfig, source="t")

    plain = cfg()
    assert outbox_classes(plain)["heartbeat"].durability == "crash"
    assert [durability(plain, k) for k in ("heartbeat", "telemetry", "app.orders", "app.readings")] == [
        "crash", "power", "power", "crash"]
    told = cfg(classes={"heartbeat": {"durability": "power"}}, durability="crash")
    assert [durability(told, k) for k in ("heartbeat", "telemetry", "app.orders")] == ["power", "crash", "crash"]
