"""How a download tells its progress (`DownloadProgress` every PROGRESS_EVERY_S, every tenth of
the image and at its end) and keeps to a rate cap (`Throttle`)."""

from __future__ import annotations

from agent.core.clock import Clock
from firmware_rollout.artifact.manifest import ChunkLayout, Manifest
from rollout_engine.messages import DownloadProgress

PROGRESS_EVERY_S = 5.0  # a download reports how far it got at least this often...
PROGRESS_STEP = 0.1  # ...and at every tenth of the image


class Progress:
    """When a download reports how far it got (every PROGRESS_EVERY_S or PROGRESS_STEP of the
    image, and at its end), and what it says."""

    def __init__(self, clock: Clock, manifest: Manifest, layout: ChunkLayout, done: int, *, to_fetch: int,
                 fetched: int) -> None:
        self._clock = clock
        self._manifest = manifest
        self._layout = layout
        self.to_fetch = to_fetch  # bytes the download fetches over the network (the rest it copies)
        self.fetched = fetched
        self._t0 = clock.monotonic()
        self._start_bytes = self._bytes(done)
        self._last_t = self._t0
        self._last_step = self._step(done)
        self._logged: set[int] = set()

    def _bytes(self, chunks: int) -> int:
        return self._manifest.size if chunks >= self._manifest.chunk_count else self._layout.offset(chunks)

    def _step(self, chunks: int) -> int:
        return int(chunks / max(1, self._manifest.chunk_count) / PROGRESS_STEP)

    def after(self, chunks: int) -> DownloadProgress | None:
        """The progress to report after `chunks` chunks, or None while none is due."""
        now = self._clock.monotonic()
        step = self._step(chunks)
        if chunks < self._manifest.chunk_count and step == self._last_step and now - self._last_t < PROGRESS_EVERY_S:
            return None
        self._last_t, self._last_step = now, step
        done = self._bytes(chunks)
        elapsed = now - self._t0
        rate = (done - self._start_bytes) / elapsed if elapsed > 0 else 0.0
        return DownloadProgress(chunks_done=chunks, chunks_total=self._manifest.chunk_count, bytes_done=done,
                                bytes_total=self._manifest.size, rate_bytes_per_s=round(rate, 1),
                                bytes_to_fetch=self.to_fetch, bytes_fetched=self.fetched)

    @staticmethod
    def text(p: DownloadProgress) -> str:
        pct = 100 * p.bytes_done // max(1, p.bytes_total)
        rate = f", {p.rate_bytes_per_s / 1024:.1f} KiB/s" if p.rate_bytes_per_s else ""
        fetch = (f"; {p.bytes_fetched} of the {p.bytes_to_fetch} bytes to download (the rest copied from the"
                 " active slot)" if p.bytes_to_fetch < p.bytes_total else "")
        return (f"{pct}%: chunk {p.chunks_done} of {p.chunks_total}, {p.bytes_done} of {p.bytes_total} bytes"
                f"{rate}{fetch}")

    def milestone(self, p: DownloadProgress) -> bool:
        """Once each past 10 %, 50 % and at 100 %: logged at INFO (the other reports only go to
        the leader)."""
        pct = 100 * p.bytes_done // max(1, p.bytes_total)
        mark = 100 if p.chunks_done == p.chunks_total else 50 if pct >= 50 else 10 if pct >= 10 else 0
        if mark == 0 or mark in self._logged:
            return False
        self._logged.add(mark)
        return True


class Throttle:
    """Keeps a download's average rate within `kbps` kilobits per second (0: no cap) by sleeping
    after each chunk; the sender is slowed by TCP's flow control meanwhile."""

    def __init__(self, clock: Clock, kbps: int) -> None:
        self._clock = clock
        self._rate = kbps * 1000 / 8  # bytes per second
        self._t0 = clock.monotonic()
        self._bytes = 0

    async def spent(self, n: int) -> None:
        if self._rate <= 0:
            return
        self._bytes += n
        ahead = self._bytes / self._rate - (self._clock.monotonic() - self._t0)
        if ahead > 0:
            await self._clock.sleep(ahead)


__all__ = ["PROGRESS_EVERY_S", "PROGRESS_STEP", "Progress", "Throttle"]
