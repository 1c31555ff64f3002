"""The id encoder gives exactly the characters the original per-character encoder gave (ids are
stored and compared as strings), checked against that encoder kept here as the reference."""

from __future__ import annotations

import random

import pytest

from agent.core.clock import VirtualClock
from agent.core.ids import IdGenerator, _encode, id_timestamp_ms

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def reference_b32(value: int, length: int) -> str:
    """The original encoder: `length` Crockford characters of the low bits of `value`."""
    chars = []
    for _ in range(length):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def reference(ms: int, rand: int) -> str:
    return reference_b32(ms, 10) + reference_b32(rand, 16)


def test_encoder_matches_the_reference_on_random_values() -> None:
    rng = random.Random(20261130)
    for _ in range(20_000):
        ms = rng.getrandbits(rng.choice((41, 44, 50)))
        rand = rng.getrandbits(rng.choice((1, 40, 79, 80)))
        assert _encode(ms, rand) == reference(ms, rand), (ms, rand)


@pytest.mark.parametrize(
    ("ms", "rand"),
    [
        (0, 0),
        ((1 << 50) - 1, (1 << 80) - 1),
        (1 << 50, 1),  # beyond 10 characters: the low 50 bits, as before
        (1_700_000_000_000, 1 << 79),
        (-1, 5),  # a clock before the epoch: two's complement low bits, as before
        (31, 31),
    ],
)
def test_encoder_matches_the_reference_at_the_edges(ms: int, rand: int) -> None:
    assert _encode(ms, rand) == reference(ms, rand)


def test_generated_ids_are_unchanged_for_the_same_inputs() -> None:
    clock = VirtualClock(start_ms=1_700_000_000_000)
    gen = IdGenerator(clock, random.Random(42))
    rng = random.Random(42)  # the same draws the generator makes
    ms = clock.now_ms()
    rand = rng.getrandbits(79)
    assert gen.next() == reference(ms, rand)
    assert gen.next() == reference(ms, rand + 1)  # same millisecond: counts up
    assert id_timestamp_ms(reference(ms, rand)) == ms
