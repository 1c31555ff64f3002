"""ActorSystem: tell/ask, ordering, one task per actor, graceful stop and hand-back."""

from __future__ import annotations

import asyncio

import pytest

from agent.actors import Actor, ActorRef, ActorSystem, Context, RestartPolicy
from agent.core.clock import VirtualClock
from agent.core.errors import ActorStopped, AskTimeout, MailboxFull


class Recorder(Actor):
    def __init__(self) -> None:
        self.seen: list[object] = []
        self.started = 0
        self.stopped = 0

    async def on_start(self, ctx: Context) -> None:
        self.started += 1

    async def receive(self, message: object, ctx: Context) -> object | None:
        if message == "boom":
            raise KeyError("boom")
        self.seen.append(message)
        return ("reply", message)

    async def on_stop(self, ctx: Context) -> None:
        self.stopped += 1


class Blocker(Actor):
    """Blocks on its first message until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.seen: list[object] = []

    async def receive(self, message: object, ctx: Context) -> object | None:
        self.entered.set()
        await self.release.wait()
        self.seen.append(message)
        return message


async def test_tell_returns_at_once_and_messages_are_processed_in_order(
    clock: VirtualClock,
) -> None:
    actor = Recorder()
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(actor, name="rec")
        for i in range(100):
            ref.tell(i)
        assert actor.seen == []  # tell did not run the actor
        assert ref.depth == 100
        await clock.settle()
        assert actor.seen == list(range(100))
        assert ref.statistics().processed == 100


async def test_ask_returns_the_receive_value(clock: VirtualClock) -> None:
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Recorder(), name="rec")
        assert await ref.ask("ping", timeout_s=1.0) == ("reply", "ping")


async def test_ask_reraises_the_receive_exception(clock: VirtualClock) -> None:
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Recorder(), name="rec", restart=RestartPolicy(backoff_base_s=0.0))
        with pytest.raises(KeyError, match="boom"):
            await ref.ask("boom", timeout_s=1.0)
        assert await ref.ask("after", timeout_s=1.0) == ("reply", "after")
        assert ref.statistics().failed == 1


async def test_ask_timeout_on_virtual_time(clock: VirtualClock) -> None:
    actor = Blocker()
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(actor, name="slow")
        asking = asyncio.ensure_future(ref.ask("q", timeout_s=2.0))
        await clock.advance(1.9)
        assert not asking.done()
        await clock.advance(0.2)
        with pytest.raises(AskTimeout, match="slow"):
            await asking
        actor.release.set()


async def test_ask_validates_timeout(clock: VirtualClock) -> None:
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Recorder(), name="rec")
        for bad in (0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="timeout_s"):
                await ref.ask("x", timeout_s=bad)


async def test_ask_on_a_full_mailbox(clock: VirtualClock) -> None:
    actor = Blocker()
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(actor, name="full", capacity=1, policy="reject")
        ref.tell("first")
        await actor.entered.wait()
        ref.tell("queued")
        with pytest.raises(MailboxFull) as info:
            await ref.ask("one too many", timeout_s=1.0)
        assert info.value.actor == "full" and info.value.retry_after_ms >= 1
        actor.release.set()


async def test_ask_dropped_by_drop_newest_fails_at_once(clock: VirtualClock) -> None:
    actor = Blocker()
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(actor, name="dn", capacity=1, policy="drop_newest")
        ref.tell("first")
        await actor.entered.wait()
        ref.tell("queued")
        with pytest.raises(MailboxFull):
            await ref.ask("dropped", timeout_s=1.0)
        assert ref.statistics().dropped == 1
        actor.release.set()


async def test_per_sender_order_under_many_concurrent_tellers() -> None:
    actor = Recorder()
    senders, per_sender = 20, 200
    async with ActorSystem() as system:
        ref = system.spawn(actor, name="sink", capacity=senders * per_sender)

        async def sender(s: int) -> None:
            for i in range(per_sender):
                ref.tell((s, i))
                if i % 7 == s % 7:
                    await asyncio.sleep(0)  # interleave the senders

        await asyncio.gather(*(sender(s) for s in range(senders)))
        await ref.ask("flush", timeout_s=10.0)
    seen: list[tuple[int, int]] = [m for m in actor.seen if isinstance(m, tuple)]
    assert len(seen) == senders * per_sender
    for s in range(senders):
        assert [i for (t, i) in seen if t == s] == list(range(per_sender))
    # The senders really did interleave.
    assert seen[: per_sender] != [(0, i) for i in range(per_sender)]


async def test_one_named_long_lived_task_per_actor(clock: VirtualClock) -> None:
    task_counts: list[int] = []

    class Counting(Actor):
        async def receive(self, message: object, ctx: Context) -> None:
            task_counts.append(len(asyncio.all_tasks()))

    async with ActorSystem(clock=clock, name="sys") as system:
        refs = [system.spawn(Counting(), name=f"a{i}") for i in range(3)]
        await clock.settle()
        names = {t.get_name() for t in asyncio.all_tasks()}
        assert {"sys/a0", "sys/a1", "sys/a2"} <= names
        for i in range(500):
            refs[i % 3].tell(i)
        await clock.settle()
    assert len(task_counts) == 500
    assert len(set(task_counts)) == 1  # no task per message


async def test_context_gives_self_system_and_clock(clock: VirtualClock) -> None:
    captured: list[Context] = []

    class Probe(Actor):
        async def receive(self, message: object, ctx: Context) -> None:
            captured.append(ctx)

    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Probe(), name="probe")
        await ref.ask("x", timeout_s=1.0)
        ctx = captured[0]
        assert ctx.self == ref and ctx.name == "probe"
        assert ctx.system is system and ctx.clock is clock
        assert system.lookup("probe") == ref
        assert system.lookup("nobody") is None
        assert [s.name for s in system.statistics()] == ["probe"]


async def test_spawn_validates(clock: VirtualClock) -> None:
    system = ActorSystem(clock=clock)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        system.spawn(Recorder(), name="zero", capacity=0)
    system.spawn(Recorder(), name="a")
    with pytest.raises(ValueError, match="already taken"):
        system.spawn(Recorder(), name="a")
    with pytest.raises(ValueError, match="non-empty"):
        system.spawn(Recorder(), name="")
    with pytest.raises(TypeError, match="Actor or a zero-argument factory"):
        system.spawn("not an actor", name="b")  # type: ignore[arg-type]
    await system.stop()


# -- graceful stop -------------------------------------------------------------------------------
async def test_stop_drains_queued_messages_and_runs_on_stop(clock: VirtualClock) -> None:
    actor = Recorder()
    system = ActorSystem(clock=clock)
    ref = system.spawn(actor, name="rec")
    for i in range(10):
        ref.tell(i)  # queued before start
    await system.start()
    undelivered = await system.stop(timeout_s=1.0)
    assert undelivered == {"rec": []}
    assert actor.seen == list(range(10))
    assert (actor.started, actor.stopped) == (1, 1)
    with pytest.raises(ActorStopped):
        ref.tell("late")
    with pytest.raises(ActorStopped):
        await ref.ask("late", timeout_s=1.0)
    assert not ref.alive
    with pytest.raises(ActorStopped):
        system.spawn(Recorder(), name="new")


async def test_stop_hands_back_what_did_not_drain_in_time(clock: VirtualClock) -> None:
    actor = Blocker()
    system = ActorSystem(clock=clock)
    ref = system.spawn(actor, name="stuck")
    await system.start()
    ref.tell("m0")
    await actor.entered.wait()
    for i in range(1, 4):
        ref.tell(f"m{i}")
    pending_ask = asyncio.ensure_future(ref.ask("question", timeout_s=100.0))
    await clock.settle()
    stopping = asyncio.ensure_future(system.stop(timeout_s=2.0))
    await clock.advance(1.0)
    assert not stopping.done()
    await clock.advance(1.5)
    undelivered = await stopping
    # The interrupted message comes first, then the queue in order; the ask is answered.
    assert undelivered == {"stuck": ["m0", "m1", "m2", "m3"]}
    with pytest.raises(ActorStopped):
        await pending_ask
    assert actor.seen == []


async def test_stop_before_start_hands_back_everything(clock: VirtualClock) -> None:
    system = ActorSystem(clock=clock)
    ref = system.spawn(Recorder(), name="idle")
    ref.tell("a")
    ref.tell("b")
    assert await system.stop() == {"idle": ["a", "b"]}


async def test_start_twice_is_an_error(clock: VirtualClock) -> None:
    system = ActorSystem(clock=clock)
    await system.start()
    with pytest.raises(RuntimeError, match="already started"):
        await system.start()
    await system.stop()
    with pytest.raises(ActorStopped):
        await system.start()


async def test_refs_compare_by_actor(clock: VirtualClock) -> None:
    async with ActorSystem(clock=clock) as system:
        a = system.spawn(Recorder(), name="a")
        b = system.spawn(Recorder(), name="b")
        assert a == system.lookup("a") and a != b
        assert len({a, system.lookup("a"), b}) == 2
        assert isinstance(a, ActorRef) and repr(a) == "ActorRef('a')"
