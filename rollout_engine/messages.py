"""What a device and the leader say about a rollout, whatever its kind installs.

    leader -> device   the kind's own offer (`firmware.offer`, `config.offer`, ...): what to install
    device -> leader   RolloutReport  (kind "rollout.report"): one state change of the device's side
    leader -> device   RolloutCancel  (under the kind's cancel name, `firmware.cancel`, ...): the
                       rollout is over for this device; stop what has not taken effect yet

A report names, in `state`, the orchestrator's per-device vocabulary (`downloading`, `installing`,
`rebooting`, `verifying`, `succeeded`, `failed`, `rejected`, `rolled_back`, ...) and, in `phase`,
the exact step of the kind's device side (its own words, bounded). `seq` grows with every report a
device makes (it survives restarts), so the leader keeps the newest report per device and rollout
and ignores a redelivered older one: `report_message` wraps a report for the outbox
(`conflict="overwrite"`, `key=report_key(device, rollout_id)`, `seq=report.seq`).

A report that says `failed` or `rolled_back` carries, in `excerpt`, the device's log lines around
the failure (bounded: `EXCERPT_LINES_MAX` lines of `EXCERPT_LINE_MAX` characters).

A leader also takes reports under a kind's older name (`firmware.report`, from a device whose agent
is not updated yet: the same fields). A device's agent sends `rollout.report`, so its leader is
updated first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Final, Literal

import msgspec

from agent.core.codec import INT64_MAX, encode

if TYPE_CHECKING:
    from agent.outbox.types import OutboxMessage

KIND_ROLLOUT_REPORT: Final = "rollout.report"

ReportState = Literal[
    "waiting_window", "waiting_lock", "downloading", "downloaded", "installing", "rebooting", "verifying",
    "succeeded", "failed", "rejected", "rolled_back", "canceled",
]
#: The report states after which a device does nothing more for the rollout.
FINAL_REPORT_STATES: Final[frozenset[str]] = frozenset({"succeeded", "failed", "rejected", "rolled_back", "canceled"})

RolloutId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
DeviceId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Version = Annotated[str, msgspec.Meta(max_length=64)]
DETAIL_MAX = 1024
Detail = Annotated[str, msgspec.Meta(max_length=DETAIL_MAX)]
Phase = Annotated[str, msgspec.Meta(max_length=32)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
#: A failure report's log excerpt: at most this many lines of at most this many characters each.
EXCERPT_LINES_MAX = 80
EXCERPT_LINE_MAX = 300
ExcerptLine = Annotated[str, msgspec.Meta(max_length=EXCERPT_LINE_MAX)]
Excerpt = Annotated[tuple[ExcerptLine, ...], msgspec.Meta(max_length=EXCERPT_LINES_MAX)]


class RolloutCancel(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """The rollout is over for this device: stop what has not taken effect yet and report
    `canceled` (what already took effect finishes and reports what came of it)."""

    rollout_id: RolloutId
    reason: Detail = ""


class DownloadProgress(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """How far a download is: sent every few seconds or tenth of the payload while it runs."""

    chunks_done: Count
    chunks_total: Count
    bytes_done: Count  # payload bytes on the device, downloaded or copied from what it holds
    bytes_total: Count  # the payload's size
    rate_bytes_per_s: Annotated[float, msgspec.Meta(ge=0, le=1e15)] = 0.0
    # what this download fetches over the network (the rest is a delta: copied from the active
    # slot) and how much of that it fetched; 0 and 0 from an agent that predates deltas
    bytes_to_fetch: Count = 0
    bytes_fetched: Count = 0


class RolloutReport(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """One state change of a device's side of a rollout, as the leader should see it (or, while it
    downloads, how far it got: `progress`)."""

    device: DeviceId
    rollout_id: RolloutId
    version: Version  # the version being installed (the offered one)
    state: ReportState
    phase: Phase  # the kind's own step (the firmware updater's state, a config apply's step)
    detail: Detail = ""
    ts_ms: Count
    seq: Count
    active_version: Version = ""  # the version the device runs when it made the report
    progress: DownloadProgress | None = None
    # `waiting_window`: when the device's maintenance window opens (ms since the epoch, its clock)
    until_ms: Count = 0
    # `failed` or `rolled_back`: the lines of the device's logs that explain it (the agent's own
    # and the journal of the units involved, secrets redacted on the device: `agent.core.redact`)
    excerpt: Excerpt = ()

    @property
    def final(self) -> bool:
        return self.state in FINAL_REPORT_STATES


def report_key(device: str, rollout_id: str) -> str:
    """The OVERWRITE key of a device's reports about one rollout."""
    return f"rollout:{device}:{rollout_id}"


def cancel_key(device: str, rollout_id: str) -> str:
    """The outbox key of the leader's cancel to one device (once per rollout)."""
    return f"rollout.cancel:{device}:{rollout_id}"


def report_message(report: RolloutReport, *, msg_id: str, receiver: str) -> OutboxMessage:
    """The outbox message carrying `report` to the leader `receiver`: OVERWRITE by device and
    rollout with the report's seq, never expiring (a device offline for a week still reports)."""
    from agent.outbox.types import OutboxMessage  # here: a tool that only reads reports need not load the outbox

    return OutboxMessage(
        msg_id=msg_id,
        owner=report.device,
        receiver=receiver,
        kind=KIND_ROLLOUT_REPORT,
        payload=encode(report),
        key=report_key(report.device, report.rollout_id),
        conflict="overwrite",
        seq=report.seq,
        ttl_ms=0,
    )


__all__ = [
    "DETAIL_MAX",
    "EXCERPT_LINES_MAX",
    "EXCERPT_LINE_MAX",
    "FINAL_REPORT_STATES",
    "KIND_ROLLOUT_REPORT",
    "DownloadProgress",
    "Excerpt",
    "ReportState",
    "RolloutCancel",
    "RolloutReport",
    "cancel_key",
    "report_key",
    "report_message",
]
