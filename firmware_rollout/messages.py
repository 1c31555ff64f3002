"""What the leader and a device say to each other about one firmware update.

    leader -> device   UpdateOffer    (kind "firmware.offer"): a rollout id and the signed manifest
    device -> leader   RolloutReport  (the engine's "rollout.report"): one state change of the updater,
                       its `phase` the updater's exact state (`UpdaterState`)
    leader -> device   RolloutCancel  (kind "firmware.cancel"): the rollout was canceled or aborted;
                       stop what has not booted yet (download, staged image, armed trial)
    device -> leader   ChunkRequest   (kind "firmware.chunk"): bytes of one image chunk; the
                       leader's ConfigServer answers in the reply body with a `Chunk`, or
                       `busy(retry_after_ms)` when its bounded mailbox is full

`REPORT_STATE` maps each updater state to the orchestrator's per-device vocabulary. A leader also
takes reports under the older name "firmware.report" (`KIND_UPDATE_REPORT`) from devices whose
agent is not updated yet.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from agent.core.codec import INT64_MAX, MessageRegistry
from rollout_engine.messages import (
    KIND_ROLLOUT_REPORT,
    ReportState,
    RolloutCancel,
    RolloutReport,
)

UpdaterState = Literal[
    "idle",
    "downloading",
    "verifying",
    "staged",
    "installing",
    "rebooting",
    "verifying_health",
    "committed",
    "rolled_back",
    "failed",
    "rejected",
    "canceled",
]

TERMINAL_STATES: Final[frozenset[str]] = frozenset({"committed", "rolled_back", "failed", "rejected", "canceled"})
REPORT_STATE: Final[dict[str, ReportState]] = {
    "downloading": "downloading",
    "verifying": "installing",  # the download is complete; the device is preparing the install
    "staged": "downloaded",  # a download-only offer: verified and kept, installed when the leader says
    "installing": "installing",
    "rebooting": "rebooting",
    "verifying_health": "verifying",
    "committed": "succeeded",
    "rolled_back": "rolled_back",
    "failed": "failed",
    "rejected": "rejected",
    "canceled": "canceled",
}

KIND_UPDATE_OFFER = "firmware.offer"
KIND_UPDATE_REPORT = "firmware.report"  # the reports of agents not yet updated (now "rollout.report")
KIND_CHUNK_REQUEST = "firmware.chunk"
KIND_UPDATE_CANCEL = "firmware.cancel"

RolloutId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
DeviceId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Version = Annotated[str, msgspec.Meta(max_length=64)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Window = Annotated[str, msgspec.Meta(max_length=16)]  # "HH:MM-HH:MM"


class UpdateOffer(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """Install the image described by `signed_manifest` (the artifact's first bytes); the chunks
    come from a `ChunkSource` the worker binds to `rollout_id`."""

    rollout_id: RolloutId
    signed_manifest: bytes
    # device-local "HH:MM-HH:MM"; empty: any time
    maintenance_windows: Annotated[tuple[Window, ...], msgspec.Meta(max_length=48)] = ()
    chunk_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 0  # bytes per ChunkRequest; 0: the manifest's
    # download and verify now, install when the same offer comes again without this flag
    download_only: bool = False
    # HTTP(S) mirrors serving the artifact as `{mirror}/{image sha256}.eafw`, most preferred
    # first (the leader's own artifact server among them); MQTT chunks are the last resort
    mirrors: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=512)], ...], msgspec.Meta(max_length=16)] = ()
    # the fleet's trust document the leader holds (`rollout_engine.trust`): a device
    # takes it when it is newer than its own and signed by a root it trusts
    trust: Annotated[bytes, msgspec.Meta(max_length=64 * 1024)] = b""


class ChunkRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """`length` bytes at `offset` of image chunk `index` of the rollout's artifact (0: to the
    chunk's end)."""

    rollout_id: RolloutId
    index: Count
    offset: Count = 0
    length: Count = 0


class Chunk(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """The answer to a `ChunkRequest` (in the reply body, not an envelope of its own)."""

    rollout_id: str
    index: int
    offset: int
    data: bytes


def register_messages(registry: MessageRegistry) -> None:
    """Teach `registry` the firmware kinds (tests and tools; an agent registers each kind with
    its route when the rollout service or the updater is attached)."""
    registry.register(KIND_UPDATE_OFFER, UpdateOffer)
    registry.register(KIND_ROLLOUT_REPORT, RolloutReport)
    registry.register(KIND_CHUNK_REQUEST, ChunkRequest)
    registry.register(KIND_UPDATE_CANCEL, RolloutCancel)


__all__ = [
    "KIND_CHUNK_REQUEST",
    "KIND_UPDATE_CANCEL",
    "KIND_UPDATE_OFFER",
    "KIND_UPDATE_REPORT",
    "REPORT_STATE",
    "TERMINAL_STATES",
    "Chunk",
    "ChunkRequest",
    "UpdateOffer",
    "UpdaterState",
    "register_messages",
]
