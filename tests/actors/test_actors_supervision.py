"""Supervision: restart with exponential backoff on the clock, give-up, failure reports."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.actors import Actor, ActorFailure, ActorSystem, Context, RestartPolicy
from agent.core.clock import VirtualClock
from agent.core.errors import ActorStopped


class Flaky(Actor):
    """Raises on messages that start with 'bad'; records its lifecycle."""

    instances = 0

    def __init__(self) -> None:
        Flaky.instances += 1
        self.events: list[str] = []
        self.received: list[object] = []

    async def on_start(self, ctx: Context) -> None:
        self.events.append("start")

    async def receive(self, message: object, ctx: Context) -> object | None:
        self.received.append(message)
        if isinstance(message, str) and message.startswith("bad"):
            raise RuntimeError(f"cannot handle {message}")
        return message

    async def on_stop(self, ctx: Context) -> None:
        self.events.append("stop")


async def test_restart_waits_an_exponential_backoff_on_the_clock(clock: VirtualClock) -> None:
    actor = Flaky()
    policy = RestartPolicy(max_restarts=5, window_s=60.0, backoff_base_s=1.0, backoff_cap_s=3.0)
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(actor, name="flaky", restart=policy)
        ref.tell("bad-1")
        ref.tell("ok-1")
        await clock.settle()
        assert actor.events == ["start", "stop"]  # stopped, waiting its 1 s backoff
        assert actor.received == ["bad-1"]
        await clock.advance(0.99)
        assert actor.received == ["bad-1"]
        await clock.advance(0.02)
        assert actor.events == ["start", "stop", "start"]
        assert actor.received == ["bad-1", "ok-1"]  # the failing message is not retried

        ref.tell("bad-2")  # second failure in the window: 2 s
        ref.tell("ok-2")
        await clock.advance(1.99)
        assert actor.received[-1] == "bad-2"
        await clock.advance(0.02)
        assert actor.received[-1] == "ok-2"

        ref.tell("bad-3")  # third: 4 s, capped at 3 s
        ref.tell("ok-3")
        await clock.advance(2.99)
        assert actor.received[-1] == "bad-3"
        await clock.advance(0.02)
        assert actor.received[-1] == "ok-3"
        assert ref.restarts == 3
        assert ref.statistics().failed == 3
        assert system.failures == []


async def test_failing_message_is_logged_with_the_exception(
    clock: VirtualClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Flaky(), name="flaky", restart=RestartPolicy(backoff_base_s=0.0))
        with caplog.at_level(logging.WARNING, logger="agent.actors"):
            ref.tell("bad-payload")
            await clock.settle()
    failures = [r for r in caplog.records if "failed on message" in r.getMessage()]
    assert len(failures) == 1
    assert "'bad-payload'" in failures[0].getMessage() and "flaky" in failures[0].getMessage()
    assert failures[0].exc_info is not None and failures[0].exc_info[0] is RuntimeError


async def test_gives_up_after_more_than_max_restarts_in_the_window(clock: VirtualClock) -> None:
    reported: list[ActorFailure] = []
    actor = Flaky()
    policy = RestartPolicy(max_restarts=2, window_s=60.0, backoff_base_s=0.5, backoff_cap_s=1.0)
    async with ActorSystem(clock=clock, on_failure=reported.append) as system:
        ref = system.spawn(actor, name="doomed", restart=policy)
        for m in ("bad-1", "bad-2", "bad-3", "ok-a", "ok-b"):
            ref.tell(m)
        await clock.advance(10.0)
        assert actor.received == ["bad-1", "bad-2", "bad-3"]
        assert len(system.failures) == 1 and reported == system.failures
        failure = system.failures[0]
        assert failure.name == "doomed" and failure.restarts == 2
        assert isinstance(failure.error, RuntimeError)
        assert failure.undelivered == ["ok-a", "ok-b"]  # handed back, not lost
        assert not ref.alive
        with pytest.raises(ActorStopped):
            ref.tell("more")
        s = ref.statistics()
        assert (s.failed, s.processed, s.drained) == (3, 3, 2)
        assert actor.events == ["start", "stop", "start", "stop", "start", "stop"]


async def test_failures_outside_the_window_do_not_accumulate(clock: VirtualClock) -> None:
    policy = RestartPolicy(max_restarts=1, window_s=10.0, backoff_base_s=0.1, backoff_cap_s=0.1)
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Flaky(), name="f", restart=policy)
        for _ in range(4):
            ref.tell("bad")
            await clock.advance(11.0)
        assert system.failures == []
        assert ref.alive and ref.restarts == 4
        ref.tell("bad")
        ref.tell("bad")  # two within 10 s: more than one restart
        await clock.advance(1.0)
        assert len(system.failures) == 1


async def test_no_restart_policy_stops_at_the_first_failure(clock: VirtualClock) -> None:
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Flaky(), name="once", restart=None)
        ref.tell("bad")
        ref.tell("next")
        await clock.settle()
        assert [f.undelivered for f in system.failures] == [["next"]]
        assert ref.restarts == 0 and not ref.alive


async def test_factory_gives_a_fresh_instance_on_restart(clock: VirtualClock) -> None:
    made: list[Flaky] = []

    def factory() -> Flaky:
        made.append(Flaky())
        return made[-1]

    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(factory, name="fresh", restart=RestartPolicy(backoff_base_s=0.0))
        assert await ref.ask("a", timeout_s=1.0) == "a"
        ref.tell("bad")
        assert await ref.ask("b", timeout_s=1.0) == "b"
    assert len(made) == 2
    assert made[0].received == ["a", "bad"] and made[0].events == ["start", "stop"]
    assert made[1].received == ["b"] and made[1].events == ["start", "stop"]


async def test_on_start_failure_is_retried_with_backoff(clock: VirtualClock) -> None:
    attempts: list[float] = []

    class Fragile(Actor):
        async def on_start(self, ctx: Context) -> None:
            attempts.append(ctx.clock.monotonic())
            if len(attempts) < 3:
                raise OSError("device not ready")

        async def receive(self, message: object, ctx: Context) -> object:
            return message

    policy = RestartPolicy(max_restarts=5, backoff_base_s=1.0, backoff_cap_s=10.0)
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Fragile(), name="fragile", restart=policy)
        await clock.advance(5.0)
        assert attempts == [0.0, 1.0, 3.0]
        assert await ref.ask("up", timeout_s=1.0) == "up"


async def test_on_failure_callback_errors_are_contained(clock: VirtualClock) -> None:
    def explode(failure: ActorFailure) -> None:
        raise ValueError("callback broke")

    async with ActorSystem(clock=clock, on_failure=explode) as system:
        ref = system.spawn(Flaky(), name="x", restart=None)
        ref.tell("bad")
        await clock.settle()
        assert len(system.failures) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_restarts": -1},
        {"window_s": 0.0},
        {"backoff_base_s": -0.1},
        {"backoff_base_s": 2.0, "backoff_cap_s": 1.0},
        {"window_s": float("inf")},
    ],
)
def test_restart_policy_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RestartPolicy"):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(backoff_base_s=0.1, backoff_cap_s=1.0)
    assert [policy.backoff_s(n) for n in range(1, 7)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    )
    assert policy.backoff_s(10_000) == 1.0


async def test_stop_cuts_a_restart_backoff_short_and_drains(clock: VirtualClock) -> None:
    actor = Flaky()
    policy = RestartPolicy(backoff_base_s=30.0, backoff_cap_s=30.0)
    system = ActorSystem(clock=clock)
    ref = system.spawn(actor, name="f", restart=policy)
    await system.start()
    ref.tell("bad")
    ref.tell("ok-1")
    ref.tell("ok-2")
    await clock.advance(1.0)
    assert actor.received == ["bad"]  # waiting out its backoff
    undelivered = await system.stop(timeout_s=5.0)  # no clock advance needed
    assert undelivered == {"f": []}
    assert actor.received == ["bad", "ok-1", "ok-2"]
    assert actor.events == ["start", "stop", "start", "stop"]


async def test_a_stray_cancelled_error_from_receive_is_a_failure(clock: VirtualClock) -> None:
    class Stray(Actor):
        async def receive(self, message: object, ctx: Context) -> object:
            if message == "cancel-inside":
                raise asyncio.CancelledError()
            return message

    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(Stray(), name="s", restart=RestartPolicy(backoff_base_s=0.0))
        with pytest.raises(RuntimeError, match="CancelledError"):
            await ref.ask("cancel-inside", timeout_s=1.0)
        assert await ref.ask("still here", timeout_s=1.0) == "still here"
        assert ref.statistics().failed == 1 and ref.restarts == 1


async def test_an_actor_task_cancelled_from_outside_refuses_messages(clock: VirtualClock) -> None:
    async with ActorSystem(clock=clock, name="sys") as system:
        ref = system.spawn(Flaky(), name="victim")
        await clock.settle()
        (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "sys/victim"]
        task.cancel()
        await clock.settle()
        with pytest.raises(ActorStopped):
            ref.tell("anyone there?")


class _Waits(Actor):
    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def receive(self, message: object, ctx: Context) -> None:
        await self.release.wait()


async def test_only_an_actor_with_a_stall_deadline_is_ever_stuck(clock: VirtualClock) -> None:
    system = ActorSystem(clock=clock)
    patient, hurried = _Waits(), _Waits()
    async with system:
        system.spawn(patient, name="updater").tell("wait for the window")  # may wait hours
        system.spawn(hurried, name="intake", stall_s=10.0).tell("commit")
        await clock.advance(10.0)
        assert system.problem() is None  # at its deadline, not beyond
        await clock.advance(1.0)
        assert system.problem() == "actor 'intake' stuck on one message for 11s (stall_s 10)"
        hurried.release.set()
        await asyncio.sleep(0)
        assert system.problem() is None
        await clock.advance(3600.0)
        assert system.problem() is None
        patient.release.set()
    with pytest.raises(ValueError, match="stall_s must be a finite number > 0"):
        ActorSystem(clock=clock).spawn(_Waits(), name="x", stall_s=0.0)
