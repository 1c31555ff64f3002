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
_TIME_MASK = (1 << 50) - 1  # 10 characters of timestamp
_HALF_MASK = (1 << 40) - 1
# Every 10-bit value as its two characters: an id is 13 lookups and one join.
_PAIRS = tuple(a + b for a in _ALPHABET for b in _ALPHABET)


def _encode(ms: int, rand: int) -> str:
    """The 26 characters of an id: the low 50 bits of `ms` (10 characters), then the low 80
    bits of `rand` (16), most significant first. `rand` is split in two 40-bit halves first so
    the shifts work on small ints."""
    t = _PAIRS
    ms &= _TIME_MASK
    hi = (rand >> 40) & _HALF_MASK
    lo = rand & _HALF_MASK
    return "".join((
        t[ms >> 40], t[(ms >> 30) & 1023], t[(ms >> 20) & 1023], t[(ms >> 10) & 1023],
        t[ms & 1023],
        t[hi >> 30], t[(hi >> 20) & 1023], t[(hi >> 10) & 1023], t[hi & 1023],
        t[lo >> 30], t[(lo >> 20) & 1023], t[(lo >> 10) & 1023], t[lo & 1023],
    ))


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
        return _encode(ms, rand)


def id_timestamp_ms(message_id: str) -> int:
    """The creation time encoded in an id."""
    value = 0
    for ch in message_id[:10]:
        value = value * 32 + _ALPHABET.index(ch)
    return value
