"""Firmware as a rollout kind (`rollout_engine.kinds`): a signed artifact, admitted into the
leader's artifact store, offered as an `UpdateOffer` whose chunks the leader serves, canceled as
`firmware.cancel`, reported by the device's updater."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agent.core.codec import encode
from agent.core.errors import EdgeAgentError, RolloutError
from firmware_rollout.artifact.files import read_signed_manifest
from firmware_rollout.messages import KIND_UPDATE_CANCEL, KIND_UPDATE_OFFER, KIND_UPDATE_REPORT, UpdateOffer
from firmware_rollout.orchestration.artifacts import ArtifactStore
from rollout_engine.kinds import Admitted, Described, KindTraits, OfferContext, Outgoing
from rollout_engine.plan import DeviceInfo
from rollout_engine.store import DeviceRow, RolloutRow
from rollout_engine.version import ahead_of

SUFFIX = ".eafw"


def describe_artifact(path: Path) -> Described:
    """A firmware artifact's manifest, read (not verified)."""
    try:
        m = read_signed_manifest(path).manifest
    except EdgeAgentError as exc:
        raise RolloutError(f"artifact {path}: {exc}") from None
    what = (f"firmware rollback of {', '.join(m.rollback_from)}" if m.rollback
            else f"firmware: {len(m.chunks)} chunks")
    return Described(name=m.name, version=m.version, size=m.size, what=what, installs=f"version {m.version}",
                     rollback=m.rollback, rollback_from=tuple(m.rollback_from))


def check_downgrade(artifact: Described, source: str, targets: Sequence[DeviceInfo]) -> list[str]:
    """Every device refuses an image older than the one it runs unless it is signed as a
    rollback: a rollout of one to targets that all run newer versions could only fail (refused);
    to some of them, a warning naming how many will refuse it (returned)."""
    if artifact.rollback:
        return []
    ahead = set(ahead_of(artifact.version, {d.firmware_version for d in targets}))
    newer = [d for d in targets if d.firmware_version in ahead]
    if not newer:
        return []
    what = f"artifact {source} is version {artifact.version}"
    if len(newer) == len(targets):
        running = ", ".join(sorted({d.firmware_version for d in newer}))
        raise RolloutError(f"{what}, older than every targeted device ({running}): each would refuse it as a"
                           " downgrade; to go back, sign it as a rollback"
                           " (`edge-agent firmware build --rollback --rollback-from VERSION`)")
    return [f"{what}, older than {len(newer)} of the {len(targets)} targeted devices: they will refuse it as a"
            " downgrade (failures that count against the rollout's gates)"]


FIRMWARE = KindTraits(
    name="firmware", installs="firmware", cancel_kind=KIND_UPDATE_CANCEL, describe=describe_artifact,
    file_suffixes=(SUFFIX,), download_only=True, skips_held=True, report_kinds=(KIND_UPDATE_REPORT,),
    check_targets=check_downgrade, image=lambda r: (r.artifact, r.signed_manifest))


class FirmwareKind:
    """Firmware on a leader: artifacts checked into `artifacts` (None: the artifact's path is
    served as given, unchecked: the library's own tests and tools that check artifacts themselves)."""

    traits = FIRMWARE

    def __init__(self, artifacts: ArtifactStore | None) -> None:
        self.artifacts = artifacts

    def admit(self, artifact: str, *, undone: RolloutRow | None) -> Admitted:
        if self.artifacts is not None:
            kept = self.artifacts.admit(Path(artifact), rollback=undone is not None,
                                        replaces=undone.version if undone is not None else "")
            return Admitted(version=kept.signed.manifest.version, artifact=str(kept.path), release=kept.signed.raw)
        try:
            signed = read_signed_manifest(Path(artifact))
        except EdgeAgentError as exc:
            raise RolloutError(f"artifact {artifact}: {exc}") from exc
        return Admitted(version=signed.manifest.version, artifact=artifact, release=signed.raw)

    def held(self, release: bytes, devices: Sequence[DeviceInfo]) -> dict[str, str]:
        return {d.device_id: d.firmware_version for d in devices}

    def offers(self, r: RolloutRow, devices: Sequence[DeviceRow], context: OfferContext) -> list[Outgoing]:
        spec = r.spec
        return [Outgoing(d.device_id, KIND_UPDATE_OFFER, encode(UpdateOffer(
            rollout_id=r.id,
            signed_manifest=r.signed_manifest,
            maintenance_windows=tuple(spec.device.maintenance_windows),
            chunk_size=spec.download.chunk_size,
            download_only=spec.rollout.download_only and d.wave not in context.approved_waves,
            mirrors=context.mirrors,
            trust=context.trust,
        )), key=f"firmware.offer:{r.id}") for d in devices]

    def in_sync(self, release: bytes, devices: Sequence[str]) -> set[str]:
        return set()  # (no compliance gate: `traits.compliance` is False)


__all__ = ["FIRMWARE", "SUFFIX", "FirmwareKind", "check_downgrade", "describe_artifact"]
