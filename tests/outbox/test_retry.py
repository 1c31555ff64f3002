"""Full-jitter exponential backoff: bounds, floors, capacity hints, determinism."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.errors import Capacity, Permanent, Transient
from agent.outbox.retry import RetryPolicy


def test_defaults_match_the_spec() -> None:
    policy = RetryPolicy()
    assert (policy.base_s, policy.cap_s, policy.transient_floor_s) == (1.0, 300.0, 0.5)


@pytest.mark.parametrize(
    ("attempt", "ceiling"),
    [(0, 1.0), (1, 2.0), (2, 4.0), (8, 256.0), (9, 300.0), (40, 300.0), (10_000, 300.0)],
)
def test_ceiling_doubles_then_caps(attempt: int, ceiling: float) -> None:
    assert RetryPolicy().ceiling_s(attempt) == ceiling


@settings(deadline=None, max_examples=200)
@given(
    attempt=st.integers(min_value=0, max_value=100),
    base=st.floats(min_value=0.001, max_value=10),
    cap=st.floats(min_value=0.001, max_value=1000),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_full_jitter_stays_within_zero_and_the_ceiling(
    attempt: int, base: float, cap: float, seed: int
) -> None:
    policy = RetryPolicy(base_s=base, cap_s=cap, transient_floor_s=0)
    delay = policy.backoff_s(attempt, random.Random(seed))
    assert 0.0 <= delay <= min(cap, base * 2**attempt)


def test_full_jitter_spreads_over_the_whole_range() -> None:
    policy = RetryPolicy(base_s=1.0, cap_s=300.0)
    rng = random.Random(7)
    samples = [policy.backoff_s(3, rng) for _ in range(2000)]
    assert min(samples) < 0.5  # full jitter reaches near zero
    assert max(samples) > 7.5  # ... and near the ceiling of 8 s
    assert all(0 <= s <= 8.0 for s in samples)


def test_transient_delay_never_below_the_floor() -> None:
    policy = RetryPolicy(base_s=0.01, cap_s=10.0, transient_floor_s=0.5)
    rng = random.Random(1)
    for attempt in range(12):
        assert policy.delay_s(Transient("timeout"), attempt, rng) >= 0.5
        assert policy.delay_ms(Transient("timeout"), attempt, rng) >= 500


def test_capacity_delay_is_at_least_retry_after_plus_jitter() -> None:
    policy = RetryPolicy(base_s=1.0, cap_s=300.0)
    rng = random.Random(3)
    for attempt in range(10):
        ms = policy.delay_ms(Capacity("full", retry_after_ms=1234), attempt, rng)
        assert 1234 <= ms <= 1234 + policy.ceiling_s(attempt) * 1000 + 1
    # A zero hint still backs off by the jitter and never goes negative.
    assert policy.delay_ms(Capacity("full", retry_after_ms=0), 0, rng) >= 0


def test_other_delivery_errors_get_the_floor_too() -> None:
    policy = RetryPolicy(base_s=0.001, transient_floor_s=2.0)
    assert policy.delay_s(Permanent("bad"), 0, random.Random(0)) >= 2.0


def test_same_seed_same_delays() -> None:
    policy = RetryPolicy()
    a = [policy.delay_ms(Transient("x"), n, random.Random(42)) for n in range(10)]
    b = [policy.delay_ms(Transient("x"), n, random.Random(42)) for n in range(10)]
    assert a == b


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_s": 0},
        {"base_s": -1},
        {"cap_s": 0},
        {"cap_s": float("inf")},
        {"transient_floor_s": -0.1},
        {"base_s": float("nan")},
        {"base_s": "1"},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_negative_attempt_is_refused() -> None:
    with pytest.raises(ValueError, match="attempt"):
        RetryPolicy().ceiling_s(-1)
