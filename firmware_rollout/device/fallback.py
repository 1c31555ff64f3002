"""Chunk sources in order of preference, every chunk checked, a budget for permanent errors.

`FallbackSource` is what the updater downloads from when an offer names mirrors:

    mirror 1 ─► mirror 2 ─► ... ─► MQTT chunks from the leader's ConfigServers

- Each chunk is checked against the signed manifest (length and sha256) before the updater
  sees it: a mirror is never trusted. A bad chunk is taken from the next source instead.
- A lost connection, a timeout or a 5xx moves on to the next source, which stays the source
  from then on; only when every source failed that way does the updater back off and retry.
- A busy answer (`Capacity`: a ConfigServer's busy, a mirror's 429/503 with Retry-After) goes to
  the updater as it is: it halves its window and waits at least as long as asked.
- A permanent error (404, a bad chunk, a file that is not this artifact) drops that source
  (for a bad chunk: for that chunk) and spends one of `retry_budget`. Once the budget is spent,
  the download stops with `Permanent`: the device reports `failed` with the reason and spends no
  more data on it (a metered link's bill stays bounded).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from agent.core.errors import Capacity, Permanent, Transient
from firmware_rollout.artifact.manifest import ChunkLayout, Manifest
from firmware_rollout.device.sources import ChunkSource

log = logging.getLogger(__name__)

DEFAULT_RETRY_BUDGET = 5


class FallbackSource:
    """`sources` as `(name, source)`, most preferred first; `closers` run on `aclose`."""

    def __init__(self, sources: Sequence[tuple[str, ChunkSource]], manifest: Manifest, *,
                 retry_budget: int = DEFAULT_RETRY_BUDGET, layout: ChunkLayout | None = None,
                 closers: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
        if not sources:
            raise ValueError("a download needs at least one source")
        self._sources = list(sources)
        self._manifest = manifest
        self._layout = layout or manifest.layout()
        self._dead: set[int] = set()  # sources that answered a permanent error
        self._current = 0
        self._closers = list(closers)
        self.retry_budget = retry_budget
        self.permanent_errors: list[str] = []
        self.fetched_from: dict[str, int] = {name: 0 for name, _ in self._sources}
        self.failovers = 0

    @property
    def current(self) -> str:
        return self._sources[self._current][0]

    def plan(self, indices: Sequence[int]) -> None:
        for _, source in self._sources:
            source.plan(indices)

    def _order(self) -> list[int]:
        n = len(self._sources)
        return [i for i in (*range(self._current, n), *range(self._current)) if i not in self._dead]

    def _spend(self, reason: str) -> None:
        self.permanent_errors.append(reason)
        log.warning("download: %s (%d of %d permanent errors allowed)", reason, len(self.permanent_errors),
                    self.retry_budget)
        if len(self.permanent_errors) >= self.retry_budget:
            raise Permanent(f"retry budget spent: {len(self.permanent_errors)} permanent errors; last: {reason}")

    async def fetch(self, index: int) -> bytes:
        transient: list[str] = []
        expected_length = self._layout.length(index)
        expected = self._manifest.chunks[index]
        for pos in self._order():
            name, source = self._sources[pos]
            try:
                data = await source.fetch(index)
            except Capacity:
                raise  # busy: the updater waits as asked and asks the same source again
            except Permanent as exc:
                self._dead.add(pos)
                self._spend(f"{name}: {exc}")
                continue
            except Exception as exc:  # connection lost, timeout, 5xx: the next source
                transient.append(f"{name}: {exc}")
                continue
            if len(data) != expected_length or hashlib.sha256(data).digest() != expected:
                self._spend(f"{name} served a bad chunk {index} (its sha256 is not the signed one)")
                continue
            if pos != self._current:
                self.failovers += 1
                log.info("download: chunk %d from %s (%s)", index, name,
                         "; ".join(transient) or f"{self.current} failed")
                self._current = pos
            self.fetched_from[name] += 1
            return data
        if transient:
            raise Transient(f"no source answered chunk {index}: {'; '.join(transient)}")
        raise Permanent(f"no source serves chunk {index}: {'; '.join(self.permanent_errors[-3:])}")

    async def aclose(self) -> None:
        for close in self._closers:
            try:
                await close()
            except Exception as exc:  # closing must not hide what ended the download
                log.debug("closing a download source: %r", exc)


__all__ = ["DEFAULT_RETRY_BUDGET", "FallbackSource"]
