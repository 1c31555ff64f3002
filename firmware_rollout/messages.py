"""What the leader and a device say to each other about one update.

    leader -> device   UpdateOffer   (kind "firmware.offer"): a rollout id and the signed manifest
    device -> leader   UpdateReport  (kind "firmware.report"): one state change of the updater
    leader -> device   UpdateCancel  (kind "firmware.cancel"): the rollout was canceled or aborted;
                       stop what has not booted yet (download, staged image, armed trial)
    device -> leader   ChunkRequest  (kind "firmware.chunk"): bytes of one image chunk; the
                       leader's ConfigServer answers in the reply body with a `Chunk`, or
                       `busy(retry_after_ms)` when its bounded mailbox is full

A report names the updater's exact `phase` and, in `state`, the orchestrator's per-device
vocabulary (`downloading`, `installing`, `rebooting`, `verifying`, `succeeded`, `failed`,
`rejected`, `rolled_back`). `seq` grows with every report a device makes (it survives restarts),
so the leader keeps the newest report per device and rollout and ignores a redelivered older
one: `report_message` wraps a report for the outbox (`conflict="overwrite"`,
`key=report_key(device, rollout_id)`, `seq=report.seq`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Final, Literal

import msgspec

from agent.core.codec import INT64_MAX, MessageRegistry, encode

if TYPE_CHECKING:
    from agent.outbox.types import OutboxMessage

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
ReportState = Literal[
    "waiting_window", "waiting_lock", "downloading", "downloaded", "installing", "rebooting", "verifying",
    "succeeded", "failed", "rejected", "rolled_back", "canceled",
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
KIND_UPDATE_REPORT = "firmware.report"
KIND_CHUNK_REQUEST = "firmware.chunk"
KIND_UPDATE_CANCEL = "firmware.cancel"

RolloutId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
DeviceId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Version = Annotated[str, msgspec.Meta(max_length=64)]
Detail = Annotated[str, msgspec.Meta(max_length=1024)]  # DETAIL_MAX
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
DETAIL_MAX = 1024
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


class UpdateCancel(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """The rollout is over for this device: stop downloading, discard what was staged, disarm a
    trial that has not booted, report `canceled`. A device already running the new slot on trial
    finishes its health check and reports what came of it."""

    rollout_id: RolloutId
    reason: Detail = ""


def cancel_key(device: str, rollout_id: str) -> str:
    """The outbox key of the leader's cancel to one device (once per rollout)."""
    return f"firmware.cancel:{device}:{rollout_id}"


class DownloadProgress(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """How far a download is: sent every few seconds or tenth of the image while it runs."""

    chunks_done: Count
    chunks_total: Count
    bytes_done: Count  # image bytes in the new slot, downloaded or copied from the active slot
    bytes_total: Count  # the image's size
    rate_bytes_per_s: Annotated[float, msgspec.Meta(ge=0, le=1e15)] = 0.0
    # what this download fetches over the network (the rest is a delta: copied from the active
    # slot) and how much of that it fetched; 0 and 0 from an agent that predates deltas
    bytes_to_fetch: Count = 0
    bytes_fetched: Count = 0


class UpdateReport(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """One state change of a device's updater, as the leader should see it (or, while it
    downloads, how far it got: `progress`)."""

    device: DeviceId
    rollout_id: RolloutId
    version: Version  # the version being installed (the offered one)
    state: ReportState
    phase: UpdaterState
    detail: Detail = ""
    ts_ms: Count
    seq: Count
    active_version: Version = ""  # the version the device runs when it made the report
    progress: DownloadProgress | None = None
    # `waiting_window`: when the device's maintenance window opens (ms since the epoch, its clock)
    until_ms: Count = 0

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_STATES


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


def report_key(device: str, rollout_id: str) -> str:
    """The OVERWRITE key of a device's reports about one rollout."""
    return f"firmware:{device}:{rollout_id}"


def report_message(report: UpdateReport, *, msg_id: str, receiver: str) -> OutboxMessage:
    """The outbox message carrying `report` to the leader `receiver`: OVERWRITE by device and
    rollout with the report's seq, never expiring (a device offline for a week still reports)."""
    from agent.outbox.types import OutboxMessage  # here: `edge-agent firmware` need not load the outbox

    return OutboxMessage(
        msg_id=msg_id,
        owner=report.device,
        receiver=receiver,
        kind=KIND_UPDATE_REPORT,
        payload=encode(report),
        key=report_key(report.device, report.rollout_id),
        conflict="overwrite",
        seq=report.seq,
        ttl_ms=0,
    )


def register_messages(registry: MessageRegistry) -> None:
    """Teach `registry` the firmware kinds (tests and tools; an agent registers each kind with
    its route when the rollout service or the updater is attached)."""
    registry.register(KIND_UPDATE_OFFER, UpdateOffer)
    registry.register(KIND_UPDATE_REPORT, UpdateReport)
    registry.register(KIND_CHUNK_REQUEST, ChunkRequest)
    registry.register(KIND_UPDATE_CANCEL, UpdateCancel)


__all__ = [
    "KIND_CHUNK_REQUEST",
    "KIND_UPDATE_CANCEL",
    "KIND_UPDATE_OFFER",
    "KIND_UPDATE_REPORT",
    "REPORT_STATE",
    "TERMINAL_STATES",
    "DownloadProgress",
    "ReportState",
    "UpdateCancel",
    "UpdateOffer",
    "UpdateReport",
    "UpdaterState",
    "Chunk",
    "ChunkRequest",
    "cancel_key",
    "register_messages",
    "report_key",
    "report_message",
]
