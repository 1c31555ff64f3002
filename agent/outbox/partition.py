"""Which relay partition a receiver belongs to: FNV-1a (32 bits) of its id, modulo N.

The same function is used by the store (it keeps the hash in every row, so a partition's
`take_ready` filters in SQL) and by the relay, so both always agree.
"""

from __future__ import annotations

from functools import lru_cache

_FNV32_OFFSET = 0x811C9DC5
_FNV32_PRIME = 0x01000193
_MASK32 = 0xFFFFFFFF


@lru_cache(maxsize=65_536)
def fnv1a_32(s: str) -> int:
    """FNV-1a, 32 bits, over the UTF-8 bytes of `s`."""
    h = _FNV32_OFFSET
    for byte in s.encode("utf-8"):
        h = ((h ^ byte) * _FNV32_PRIME) & _MASK32
    return h


def partition_of(receiver: str, partitions: int) -> int:
    """The partition (0 .. partitions-1) that owns `receiver`."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return fnv1a_32(receiver) % partitions


__all__ = ["fnv1a_32", "partition_of"]
