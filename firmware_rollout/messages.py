"""What the leader and a device say to each other about one update.

    leader -> device   UpdateOffer   (kind "firmware.offer"): a rollout id and the signed manifest
    device -> leader   UpdateReport  (kind "firmware.report"): one state change of the updater

A report names the updater's exact `phase` and, in `state`, the orchestrator's per-device
vocabulary (`downloading`, `installing`, `rebooting`, `verifying`, `succeeded`, `failed`,
`rejected`, `rolled_back`). `seq` grows with every report a device makes (it survives restarts),
so the leader keeps the newest report per device and ignores a redelivered older one: send
reports with `conflict="overwrite"`, `key=report_key(device)` and `seq=report.seq`.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from agent.core.codec import MessageRegistry

UpdaterState = Literal[
    "idle",
    "downloading",
    "verifying",
    "installing",
    "rebooting",
    "verifying_health",
    "committed",
    "rolled_back",
    "failed",
    "rejected",
]
ReportState = Literal[
    "downloading", "installing", "rebooting", "verifying", "succeeded", "failed", "rejected", "rolled_back"
]

TERMINAL_STATES: Final[frozenset[str]] = frozenset({"committed", "rolled_back", "failed", "rejected"})
REPORT_STATE: Final[dict[str, ReportState]] = {
    "downloading": "downloading",
    "verifying": "installing",  # the download is complete; the device is preparing the install
    "installing": "installing",
    "rebooting": "rebooting",
    "verifying_health": "verifying",
    "committed": "succeeded",
    "rolled_back": "rolled_back",
    "failed": "failed",
    "rejected": "rejected",
}

KIND_UPDATE_OFFER = "firmware.offer"
KIND_UPDATE_REPORT = "firmware.report"

RolloutId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class UpdateOffer(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """Install the image described by `signed_manifest` (the artifact's first bytes); the chunks
    come from a `ChunkSource` the worker binds to `rollout_id`."""

    rollout_id: RolloutId
    signed_manifest: bytes


class UpdateReport(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """One state change of a device's updater, as the leader should see it."""

    device: str
    rollout_id: str
    version: str  # the version being installed (the offered one)
    state: ReportState
    phase: UpdaterState
    detail: str = ""
    ts_ms: int
    seq: int
    active_version: str = ""  # the version the device runs when it made the report

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_STATES


def report_key(device: str) -> str:
    """The OVERWRITE key of a device's update reports."""
    return f"firmware:{device}"


def register_messages(registry: MessageRegistry) -> None:
    registry.register(KIND_UPDATE_OFFER, UpdateOffer)
    registry.register(KIND_UPDATE_REPORT, UpdateReport)


__all__ = [
    "KIND_UPDATE_OFFER",
    "KIND_UPDATE_REPORT",
    "REPORT_STATE",
    "TERMINAL_STATES",
    "ReportState",
    "UpdateOffer",
    "UpdateReport",
    "UpdaterState",
    "register_messages",
    "report_key",
]
