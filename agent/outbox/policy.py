"""Limits, delivery order and durability of one message class (caps, TTL, FIFO, power or crash)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FullPolicy = Literal["reject", "drop_oldest"]
# What an enqueue's return promises: "power" (its commit is synced to the disk: it survives a
# power cut), "crash" (committed, not synced: it survives the agent's crash; a power cut may
# take the last seconds).
Durability = Literal["power", "crash"]
DURABILITIES: tuple[Durability, ...] = ("power", "crash")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassPolicy:
    """Limits of one message class. Defaults fit an SD card: 100k messages and 64 MiB of
    payload per class. `ttl_ms` 0 means messages never expire; `fifo` delivers one message per
    receiver at a time, in order."""

    max_messages: int = 100_000
    max_bytes: int = 64 * 1024 * 1024
    full_policy: FullPolicy = "drop_oldest"
    ttl_ms: int = 0
    fifo: bool = False
    durability: Durability | None = None  # None: the store's

    def __post_init__(self) -> None:
        if self.max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {self.max_messages}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if self.full_policy not in ("reject", "drop_oldest"):
            raise ValueError(f"full_policy must be reject or drop_oldest: {self.full_policy!r}")
        if self.durability is not None and self.durability not in DURABILITIES:
            raise ValueError(f"durability must be power or crash: {self.durability!r}")
        if self.ttl_ms < 0:
            raise ValueError(f"ttl_ms must be >= 0, got {self.ttl_ms}")


DEFAULT_CLASS = ClassPolicy()

__all__ = ["DEFAULT_CLASS", "DURABILITIES", "ClassPolicy", "Durability", "FullPolicy"]
