"""Where image chunks come from: the leader's ConfigServers over MQTT (`chunk_client`), HTTP(S)
mirrors (`http_source`), the two in order of preference with every chunk checked
(`fallback`); the CLI and the tests read them from an artifact file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from agent.core.clock import Clock, SystemClock
from agent.core.tasks import in_thread
from firmware_rollout.artifact.files import read_image_chunk, read_signed_manifest
from firmware_rollout.artifact.manifest import SignedManifest


@runtime_checkable
class ChunkSource(Protocol):
    def plan(self, indices: Sequence[int]) -> None:
        """The chunks the updater will ask for, in order: a source may fetch ahead within them
        (the rest come from the active slot). A chunk outside the plan may still be asked for."""

    async def fetch(self, index: int) -> bytes:
        """Chunk `index` of the image. Raise `Capacity` (busy: retry after its delay), `Transient`
        (retry with backoff) or `Permanent` (give up); the updater checks the bytes itself."""


class ArtifactChunkSource:
    """Serves the image chunks of a local artifact file."""

    def __init__(self, path: str | Path, *, clock: Clock | None = None) -> None:
        self.path = Path(path)
        self.signed: SignedManifest = read_signed_manifest(self.path)
        self._clock = clock or SystemClock()
        self._layout = self.signed.manifest.layout()

    @property
    def signed_manifest(self) -> bytes:
        """What to put in an `UpdateOffer` for this artifact."""
        return self.signed.raw

    def plan(self, indices: Sequence[int]) -> None:
        pass  # a local file: nothing to fetch ahead

    async def fetch(self, index: int) -> bytes:
        return await in_thread(self._clock, read_image_chunk, self.path, self.signed, index, self._layout)


__all__ = ["ArtifactChunkSource", "ChunkSource"]
