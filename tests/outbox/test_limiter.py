"""AIMD arithmetic and permits."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.outbox.limiter import AimdLimiter, AimdSettings


def test_defaults() -> None:
    limiter = AimdLimiter()
    assert (limiter.limit, limiter.min, limiter.max, limiter.in_flight) == (10, 1, 50, 0)
    assert AimdSettings() == AimdSettings(initial=10, min=1, max=50)


def test_additive_increase_up_to_max() -> None:
    limiter = AimdLimiter(initial=10, min=1, max=13)
    for expected in (11, 12, 13, 13, 13):
        limiter.record("success")
        assert limiter.limit == expected


def test_multiplicative_decrease_down_to_min() -> None:
    limiter = AimdLimiter(initial=50, min=3, max=50)
    for expected in (25, 12, 6, 3, 3):
        limiter.record("capacity")
        assert limiter.limit == expected


def test_transient_leaves_the_limit_alone() -> None:
    limiter = AimdLimiter(initial=7)
    for _ in range(5):
        limiter.record("transient")
    assert limiter.limit == 7
    assert limiter.transients == 5


def test_halve_then_recover() -> None:
    limiter = AimdLimiter()
    limiter.record("capacity")
    assert limiter.limit == 5
    for _ in range(5):
        limiter.record("success")
    assert limiter.limit == 10


@settings(deadline=None, max_examples=100)
@given(st.lists(st.sampled_from(["success", "capacity", "transient", "none"]), max_size=200))
def test_limit_matches_a_reference_model(outcomes: list[str]) -> None:
    limiter = AimdLimiter(initial=10, min=2, max=40)
    model = 10
    for outcome in outcomes:
        limiter.record(outcome)  # type: ignore[arg-type]
        if outcome == "success":
            model = min(40, model + 1)
        elif outcome == "capacity":
            model = max(2, model // 2)
        assert limiter.limit == model
        assert 2 <= limiter.limit <= 40


def test_try_acquire_respects_the_limit() -> None:
    limiter = AimdLimiter(initial=2, min=1, max=5)
    assert limiter.try_acquire()
    assert limiter.try_acquire()
    assert not limiter.try_acquire()
    assert limiter.in_flight == 2
    assert limiter.available == 0
    limiter.release("success")  # limit 3, in flight 1
    assert (limiter.limit, limiter.in_flight, limiter.available) == (3, 1, 2)


def test_shrinking_below_in_flight_blocks_new_permits() -> None:
    limiter = AimdLimiter(initial=8, min=1, max=8)
    for _ in range(8):
        assert limiter.try_acquire()
    limiter.release("capacity")  # limit 4, in flight 7
    assert limiter.limit == 4
    assert not limiter.try_acquire()
    for _ in range(4):
        limiter.release()
    assert limiter.in_flight == 3
    assert limiter.try_acquire()


def test_release_without_acquire_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        AimdLimiter().release()


def test_unknown_outcome_is_refused() -> None:
    with pytest.raises(ValueError, match="outcome"):
        AimdLimiter().record("maybe")  # type: ignore[arg-type]


async def test_acquire_waits_for_a_release_in_order() -> None:
    limiter = AimdLimiter(initial=1, min=1, max=1)
    await limiter.acquire()
    order: list[int] = []

    async def waiter(n: int) -> None:
        await limiter.acquire()
        order.append(n)

    tasks = [asyncio.create_task(waiter(n)) for n in range(3)]
    await asyncio.sleep(0)
    assert order == [] and limiter.in_flight == 1
    for expected in ([0], [0, 1], [0, 1, 2]):
        limiter.release()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert order == expected
    await asyncio.gather(*tasks)
    assert limiter.in_flight == 1


async def test_growth_wakes_waiters() -> None:
    limiter = AimdLimiter(initial=1, min=1, max=3)
    await limiter.acquire()
    waiter = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0)
    assert not waiter.done()
    limiter.record("success")  # limit 2: room for the waiter without any release
    await asyncio.sleep(0)
    assert waiter.done()
    assert limiter.in_flight == 2


async def test_cancelled_waiter_does_not_leak_a_permit() -> None:
    limiter = AimdLimiter(initial=1, min=1, max=1)
    await limiter.acquire()
    waiter = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    limiter.release()
    assert limiter.in_flight == 0
    assert limiter.try_acquire()


async def test_waiter_cancelled_after_grant_hands_the_permit_on() -> None:
    limiter = AimdLimiter(initial=1, min=1, max=1)
    await limiter.acquire()
    first = asyncio.create_task(limiter.acquire())
    second = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0)
    limiter.release()  # grants `first` (its future is resolved, task not yet resumed)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.sleep(0)
    assert second.done()
    assert limiter.in_flight == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"initial": 0}, {"min": 0}, {"initial": 60}, {"min": 11}, {"max": 5}, {"initial": 1.5}],
)
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="AimdSettings"):
        AimdSettings(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="AimdSettings"):
        AimdLimiter(**kwargs)  # type: ignore[arg-type]
