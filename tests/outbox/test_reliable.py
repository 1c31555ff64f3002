"""tell_reliable: direct when the actor takes it, the outbox otherwise, an error only if both fail."""

from __future__ import annotations

import asyncio

import pytest
from relay_support import MemoryOutbox, message

from agent.actors import Actor, ActorSystem, Context
from agent.core.clock import VirtualClock
from agent.core.errors import MailboxFull, NotConnected, StoreClosed
from agent.outbox.reliable import tell_reliable


class Sink(Actor):
    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.got: list[object] = []
        self.gate = gate

    async def receive(self, message: object, ctx: Context) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.got.append(message)


async def test_direct_when_the_mailbox_has_room() -> None:
    clock = VirtualClock()
    outbox = MemoryOutbox(clock)
    sink = Sink()
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(sink, name="sink", capacity=4)
        path = await tell_reliable(ref, "hello", outbox=outbox, msg=message("m1", receiver="sink"))
        await clock.advance(0)
    assert path == "direct"
    assert sink.got == ["hello"]
    assert outbox.enqueued == 0


async def test_full_mailbox_falls_back_to_the_outbox() -> None:
    clock = VirtualClock()
    outbox = MemoryOutbox(clock)
    hold = asyncio.Event()
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Sink(hold), name="sink", capacity=2)
        paths = [
            await tell_reliable(ref, i, outbox=outbox, msg=message(f"m{i}", receiver="sink"))
            for i in range(6)
        ]
        hold.set()
    # One in receive (blocked), two queued, the rest stored.
    assert paths.count("direct") in (2, 3)
    assert paths[-1] == "outbox"
    stored = sorted(r.row.msg_id for r in outbox.recs.values())
    assert stored == [f"m{i}" for i in range(6) if paths[i] == "outbox"]


async def test_stopped_actor_falls_back_to_the_outbox() -> None:
    clock = VirtualClock()
    outbox = MemoryOutbox(clock)
    system = ActorSystem(clock=clock)
    await system.start()
    ref = system.spawn(Sink(), name="sink")
    await system.stop()
    path = await tell_reliable(ref, "x", outbox=outbox, msg=message("m1", receiver="sink"))
    assert path == "outbox"
    assert outbox.enqueued == 1


class RecordingRef:
    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[tuple[object, str | None, int]] = []
        self.error = error

    def tell(self, message: object, *, coalesce_key: str | None = None, seq: int = 0) -> None:
        self.calls.append((message, coalesce_key, seq))
        if self.error is not None:
            raise self.error


async def test_overwrite_passes_its_key_and_seq_as_the_coalescing_key() -> None:
    outbox = MemoryOutbox(VirtualClock())
    ref = RecordingRef()
    hb = message("m1", key="hb:dev1", conflict="overwrite", seq=7)
    await tell_reliable(ref, "hb", outbox=outbox, msg=hb)
    plain = message("m2", key="idem-2", conflict="append", seq=3)
    await tell_reliable(ref, "cmd", outbox=outbox, msg=plain)
    assert ref.calls == [("hb", "hb:dev1", 7), ("cmd", None, 3)]


async def test_awaitable_tell_failure_goes_to_the_outbox() -> None:
    outbox = MemoryOutbox(VirtualClock())

    class RemoteRef:
        def tell(self, message: object, *, coalesce_key: str | None = None, seq: int = 0):  # type: ignore[no-untyped-def]
            async def send() -> None:
                raise NotConnected("offline")

            return send()

    path = await tell_reliable(RemoteRef(), "x", outbox=outbox, msg=message("m1"))
    assert path == "outbox"


async def test_both_failing_raises_the_store_error_with_the_tell_error_chained() -> None:
    outbox = MemoryOutbox(VirtualClock())
    await outbox.close()
    ref = RecordingRef(MailboxFull("sink", retry_after_ms=5))
    with pytest.raises(StoreClosed) as info:
        await tell_reliable(ref, "x", outbox=outbox, msg=message("m1"))
    assert isinstance(info.value.__cause__, MailboxFull)


async def test_a_bug_in_tell_is_not_hidden_in_the_outbox() -> None:
    outbox = MemoryOutbox(VirtualClock())
    ref = RecordingRef(TypeError("bad call"))
    with pytest.raises(TypeError):
        await tell_reliable(ref, "x", outbox=outbox, msg=message("m1"))
    assert outbox.enqueued == 0
