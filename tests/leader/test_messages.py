"""The leader's store of application messages, its sinks, and the route that feeds them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import leader, until, worker

from agent.core.clock import VirtualClock
from agent.core.codec import Envelope, Reply, encode
from agent.core.errors import StoreError
from agent.leader.messages import MessageLog, read_messages
from agent.leader.sinks import MessageSinks
from agent.protocol import AppMessage
from agent.transport.memory import MemoryBroker
from agent.worker.messages import Submission


def msg(device: str = "pi-1", cls: str = "telemetry", payload: bytes = b"{}", *, key: str | None = None,
        overwrite: bool = False, seq: int = 1) -> AppMessage:
    return AppMessage(device_id=device, cls=cls, payload=payload, content_type="application/json", key=key,
                      overwrite=overwrite, seq=seq, ts_ms=1)


@pytest.fixture
def log(leader_store: Path | str) -> MessageLog:
    store = MessageLog.open(leader_store, clock=VirtualClock(), max_bytes_per_device=1000)
    yield store
    store.close()


def test_an_append_message_is_kept_once_by_its_id(log: MessageLog) -> None:
    assert log.apply_batch([("a", msg()), ("b", msg()), ("a", msg())]) == [True, True, False]
    assert log.apply_batch([("b", msg())]) == [False]
    assert log.count("pi-1", "telemetry") == 2


def test_an_overwrite_key_keeps_its_newest_seq(log: MessageLog, leader_store: Path | str) -> None:
    door = [("1", msg(cls="state", payload=b'"open"', key="door", overwrite=True, seq=5)),
            ("2", msg(cls="state", payload=b'"closed"', key="door", overwrite=True, seq=7)),
            ("3", msg(cls="state", payload=b'"late"', key="door", overwrite=True, seq=6))]
    assert log.apply_batch(door) == [True, True, False]
    total, rows = read_messages(leader_store, device_id="pi-1", cls="state")
    assert total == 1 and rows[0].payload == b'"closed"' and rows[0].seq == 7


def test_a_flooding_device_fills_only_its_own_budget(log: MessageLog) -> None:
    assert log.apply_batch([("quiet-1", msg("pi-2", payload=b"x" * 100))]) == [True]
    for i in range(50):  # 5,000 bytes from one device against a budget of 1,000
        log.apply_batch([(f"flood-{i}", msg("pi-1", payload=b"y" * 100))])
    assert log.count("pi-1") == 10  # its newest 1,000 bytes
    assert log.count("pi-2") == 1  # the other device lost nothing
    assert log.trimmed == 40


async def test_prune_removes_what_is_past_retention_and_frees_its_budget(tmp_path: Path) -> None:
    clock = VirtualClock()
    store = MessageLog.open(tmp_path / "leader.db", clock=clock, max_bytes_per_device=250)
    try:
        store.apply_batch([("old", msg(payload=b"o" * 200))])
        await clock.advance(3 * 86_400.0)
        store.apply_batch([("new", msg(payload=b"n" * 40))])
        assert store.prune(86_400.0, limit=10) == 1  # the old one only
        assert store.apply_batch([("next", msg(payload=b"x" * 200))]) == [True]
        assert store.count() == 2  # its bytes were given back: nothing trimmed
        assert store.trimmed == 0
    finally:
        store.close()


def test_read_messages_refuses_a_database_without_a_message_store(tmp_path: Path) -> None:
    import sqlite3

    other = tmp_path / "worker.db"
    sqlite3.connect(other).execute("CREATE TABLE x (a)").connection.commit()
    before = other.read_bytes()
    with pytest.raises(StoreError, match="no message store"):
        read_messages(other)
    assert other.read_bytes() == before  # read-only: nothing created


class FailingForwarder:
    name = "cloud"

    def __init__(self) -> None:
        self.fail = True
        self.got: list[str] = []

    async def forward(self, batch: Sequence[tuple[str, AppMessage]]) -> None:
        if self.fail:
            raise StoreError("queue full")
        self.got += [msg_id for msg_id, _ in batch]


async def test_a_forwarder_that_cannot_queue_fails_the_batch_and_stores_nothing(log: MessageLog) -> None:
    forwarder = FailingForwarder()
    sinks = MessageSinks(log, [forwarder])
    with pytest.raises(StoreError, match="not queued for cloud"):
        await sinks.apply([("a", msg())])
    assert log.count() == 0  # the device is told busy and sends it again
    forwarder.fail = False
    assert await sinks.apply([("a", msg())]) == [True]
    assert await sinks.apply([("a", msg()), ("b", msg())]) == [False, True]
    assert forwarder.got == ["a", "b"]  # a redelivery is not forwarded twice
    assert sinks.stats.snapshot()["telemetry"] == {"applied": 2, "duplicates": 1, "rejected": 0, "forwarded": 2}


async def test_the_leader_refuses_forged_and_mismatched_application_messages(tmp_path: Path) -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    gw = await leader(clock, tmp_path, broker=broker)
    device = await worker(clock, tmp_path, "pi-1", broker=broker)
    try:
        await until(clock, lambda: device.transport.connected.is_open, what="connected")
        forged = msg("pi-2")  # names another device
        mismatched = msg("pi-1", cls="events")  # in an envelope of another class
        for kind, body in (("app.telemetry", encode(forged)), ("app.telemetry", encode(mismatched)),
                           ("app.telemetry", b"\xc1junk")):
            env = Envelope(id=device.ids.next(), kind=kind, sender="pi-1", receiver="leader", payload=body)
            reply = gw._on_up(env, None)  # type: ignore[arg-type]
            assert isinstance(reply, Reply) and reply.status == "rejected", reply  # refused at once
        assert gw.sinks is not None and gw.sinks.stats.snapshot()["telemetry"]["rejected"] == 3
        assert gw.messages is not None and gw.messages.count() == 0
        assert gw.rejects.count == 3
        # and a real one, through the worker's intake, is stored
        accepted = await device.messages.submit(Submission("telemetry", b"{}", "application/json"))
        await until(clock, lambda: gw.messages is not None and gw.messages.count("pi-1") == 1, what="stored")
        assert accepted.path in ("direct", "outbox")
    finally:
        await device.stop()
        await gw.stop()
