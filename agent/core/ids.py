"""Time-ordered unique message ids (ULID layout: 48-bit ms timestamp + 80 random bits).

Ids sort by creation time as plain strings, are unique across devices without coordination,
and, drawn from a seeded generator, are the same in every run of a simulation.
"""

from __future__ import annotations

import random

from agent.core.clock import Clock

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32
_RANDOM_BITS = 80
_RANDOM_MAX = (1 << _RANDOM_BITS) - 1


def _b32(value: int, length: int) -> str:
    chars = []
    for _ in range(length):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))


class IdGenerator:
    """Makes 26-character ids, strictly increasing within one generator."""

    def __init__(self, clock: Clock, rng: random.Random | None = None) -> None:
        self._clock = clock
        self._rng = rng if rng is not None else random.SystemRandom()
        self._last_ms = -1
        self._last_rand = 0

    def next(self) -> str:
        ms = self._clock.now_ms()
        if ms <= self._last_ms:
            # Same (or earlier, after a clock step) millisecond: count up within the last one.
            ms = self._last_ms
            rand = self._last_rand + 1
            if rand > _RANDOM_MAX:
                ms += 1
                rand = self._rng.getrandbits(_RANDOM_BITS - 1)
        else:
            rand = self._rng.getrandbits(_RANDOM_BITS - 1)  # headroom to count up
        self._last_ms, self._last_rand = ms, rand
        return _b32(ms, 10) + _b32(rand, 16)


def id_timestamp_ms(message_id: str) -> int:
    """The creation time encoded in an id."""
    value = 0
    for ch in message_id[:10]:
        value = value * 32 + _ALPHABET.index(ch)
    return value
