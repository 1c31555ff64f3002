"""Where a download's chunks come from: the offer's HTTP(S) mirrors, then the signed manifest's,
in order, with the leader's ConfigServers over MQTT as the last resort (`FallbackSource`: a
mirror that fails is left for the next, within `retry_budget` permanent errors); MQTT alone when
no mirror is named or the manifest is not a checked one. httpx loads only when a mirror is used.

    source = download_source(manifest, mirrors=offer.mirrors, mqtt=remote, settings=MirrorSettings())
    await updater.offer(offer, source)
    await source.aclose()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from firmware_rollout.artifact.manifest import Manifest
from firmware_rollout.device.chunk_client import RemoteChunkSource
from firmware_rollout.device.fallback import DEFAULT_RETRY_BUDGET, FallbackSource
from firmware_rollout.device.sources import ChunkSource


@dataclass(frozen=True, slots=True)
class MirrorSettings:
    """How a download uses HTTP(S) mirrors (`[firmware]` mirror_timeout_s, mirror_ca, retry_budget)."""

    timeout_s: float = 10.0
    ca: str = ""  # a CA bundle for https mirrors; empty: the system's
    # the certificate and key shown to https mirrors that ask for one (the device's broker
    # credentials, `[mqtt] tls_cert/tls_key`: the leader's artifact server may require them)
    client_cert: str = ""
    client_key: str = ""
    retry_budget: int = DEFAULT_RETRY_BUDGET


class DownloadSource(ChunkSource, Protocol):
    async def aclose(self) -> None: ...


class MqttOnly:
    """The leader's ConfigServers alone (an offer without mirrors)."""

    def __init__(self, source: RemoteChunkSource) -> None:
        self._source = source

    def plan(self, indices: Sequence[int]) -> None:
        self._source.plan(indices)

    async def fetch(self, index: int) -> bytes:
        return await self._source.fetch(index)

    async def aclose(self) -> None:
        self._source.close()


def download_source(manifest: Manifest | None, *, mirrors: Sequence[str], mqtt: RemoteChunkSource,
                    settings: MirrorSettings) -> DownloadSource:
    """The source of a download whose checked manifest is `manifest` (None: MQTT alone; the
    updater refuses the offer with the reason)."""
    urls = list(dict.fromkeys([*mirrors, *(manifest.mirrors if manifest is not None else ())]))
    urls = [u for u in urls if u.startswith(("http://", "https://"))]
    if manifest is None or not urls:
        return MqttOnly(mqtt)
    from firmware_rollout.device.http_source import MirrorSource, make_client  # httpx: only when updating

    client = make_client(timeout_s=settings.timeout_s, ca=settings.ca, client_cert=settings.client_cert,
                         client_key=settings.client_key)
    layout = manifest.layout()
    sources = [MirrorSource(client, url, manifest, layout) for url in urls]

    async def close_mqtt() -> None:
        mqtt.close()

    return FallbackSource([*((s.mirror, s) for s in sources), ("mqtt", mqtt)], manifest, layout=layout,
                          retry_budget=settings.retry_budget,
                          closers=[*(s.close for s in sources), client.aclose, close_mqtt])


__all__ = ["DownloadSource", "MirrorSettings", "MqttOnly", "download_source"]
