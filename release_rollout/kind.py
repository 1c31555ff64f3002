"""Releases as a rollout kind (`rollout_engine.kinds`): a signed release document whose parts the
leader admits each through its own kind (the firmware's artifact store, the config releases',
the applications' bundles), offered as one `ReleaseOffer` per device carrying each part's own
offer as its kind makes it for that device, canceled as `release.cancel`. A device converges on
it all or nothing (`agent.worker.releases`)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated

import msgspec

from agent.core.codec import decode, encode
from agent.core.errors import RolloutError
from release_rollout.build import file_digest
from release_rollout.document import FILE_MAX, PARTS_MAX, SUFFIX, ReleaseDocument, parse_release, peek_release
from release_rollout.errors import ReleaseError
from release_rollout.messages import KIND_RELEASE_CANCEL, KIND_RELEASE_OFFER, PartOffer, ReleaseOffer
from rollout_engine.keys import Verifier
from rollout_engine.kinds import Admitted, Described, KindTraits, OfferContext, Outgoing, RolloutKind
from rollout_engine.plan import DeviceInfo
from rollout_engine.store import DeviceRow, RolloutRow

FROM_MAX = 64  # a device's "from" in a plan and a status (what it runs of the parts that change)
PARTS_DIR = "release-parts"  # beside the kept documents: each part admitted, by its file's sha256


class AdmittedPart(msgspec.Struct, frozen=True):
    part: str  # as the document's order names it
    kind: str
    version: str
    artifact: str  # the leader's copy, as its kind kept it
    release: bytes  # what its kind offers from


class AdmittedRelease(msgspec.Struct, frozen=True):
    """What a release rollout stores: the signed document and each part as its kind admitted it."""

    document: Annotated[bytes, msgspec.Meta(max_length=FILE_MAX)]
    parts: Annotated[tuple[AdmittedPart, ...], msgspec.Meta(max_length=PARTS_MAX)]


def read_document(path: Path) -> bytes:
    """A release document's bytes, refused unread when larger than a document can be."""
    try:
        with path.open("rb") as f:
            data = f.read(FILE_MAX + 1)
    except OSError as exc:
        raise RolloutError(f"release {path}: {exc.strerror or exc}") from None
    if len(data) > FILE_MAX:
        raise RolloutError(f"release {path}: over {FILE_MAX} bytes: not a release document")
    return data


def describe_release(path: Path) -> Described:
    """A release document, read (not verified)."""
    try:
        d = peek_release(read_document(path), source=str(path))
    except ReleaseError as exc:
        raise RolloutError(str(exc)) from None
    return Described(name=d.name, version=d.version, size=sum(p.size for p in d.parts),
                     what=f"release {d.name}: {d.says()}", installs=f"release {d.name} {d.version}")


def admitted(release: bytes) -> tuple[ReleaseDocument, AdmittedRelease]:
    stored = decode(release, AdmittedRelease)
    return peek_release(stored.document), stored


def release_image(r: RolloutRow) -> tuple[str, bytes] | None:
    """The firmware part's copy and signed manifest (the leader serves its chunks)."""
    _, stored = admitted(r.signed_manifest)
    return next(((p.artifact, p.release) for p in stored.parts if p.kind == "firmware"), None)


RELEASE = KindTraits(name="release", installs="release", cancel_kind=KIND_RELEASE_CANCEL, describe=describe_release,
                     file_suffixes=(SUFFIX,), image=release_image)


class ReleaseKind:
    """Releases on a leader: documents checked against `keys` (the fleet's, as devices pin them)
    and kept in `directory`; each part admitted, held and offered by its own kind (`parts`:
    the part kinds' names in a document -> the kind on this leader)."""

    traits = RELEASE

    def __init__(self, *, keys: Verifier | None, directory: Path, parts: Mapping[str, RolloutKind]) -> None:
        self.keys = keys
        self.directory = directory
        self.parts = parts

    def admit(self, artifact: str, *, undone: RolloutRow | None) -> Admitted:
        if self.keys is None:
            raise RolloutError(f"cannot check release {artifact}: the leader's config has no [firmware] public_key"
                               " or trust_root (the fleet's key, as the devices pin it)")
        source = Path(artifact)
        data = read_document(source)
        try:
            signed = parse_release(data, self.keys, source=artifact)
        except ReleaseError as exc:
            raise RolloutError(str(exc)) from None
        kept_parts = []
        for p in signed.document.parts:
            kind = self.parts.get(p.kind)
            if kind is None:
                raise RolloutError(f"release {artifact}: part {p.id}: this leader has no {p.kind} kind")
            file = source.parent / p.file
            where = f"release {artifact}: part {p.id} ({file})"
            if not file.is_file():
                file = self.directory / PARTS_DIR / p.sha256  # (a release admitted before: its parts kept)
            if not file.is_file():
                raise RolloutError(f"{where}: not found beside it, nor in the leader's store (a release's parts go"
                                   " beside its document: start its folder with `edge-agent rollout start`)")
            kept = kind.admit(str(file), undone=None)
            if kept.version != p.version:
                raise RolloutError(f"{where}: version {kept.version}, the release says {p.version}")
            copy = Path(kept.artifact)
            held = copy if copy.is_file() else file  # (the kept copy: the source may change)
            if file_digest(held) != p.sha256:
                raise RolloutError(f"{where}: its sha256 differs from the signed release")
            kept_parts.append(AdmittedPart(part=p.id, kind=p.kind, version=p.version, artifact=kept.artifact,
                                           release=kept.release))
            self._keep_part(held, p.sha256)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o750)
        kept_document = self.directory / f"{signed.release_id}{SUFFIX}"
        partial = kept_document.with_name(f".{os.getpid()}-{kept_document.name}.partial")
        try:
            partial.write_bytes(data)
            os.replace(partial, kept_document)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            raise RolloutError(f"release {artifact}: cannot keep it: {exc.strerror or exc}") from None
        return Admitted(version=signed.version, artifact=str(kept_document),
                        release=encode(AdmittedRelease(document=data, parts=tuple(kept_parts))))

    def _keep_part(self, file: Path, sha256: str) -> None:
        """The part's file (its sha256 checked by the caller) kept by its sha256 in the store (a
        link: no second copy where the file system allows), so a release admitted once starts again
        from its document alone (the console's list of the store)."""
        parts = self.directory / PARTS_DIR
        kept = parts / sha256
        if kept.is_file():
            return
        parts.mkdir(parents=True, exist_ok=True, mode=0o750)
        partial = parts / f".{os.getpid()}-{sha256}.partial"
        try:
            try:
                os.link(file, partial)
            except OSError:
                shutil.copyfile(file, partial)
            os.replace(partial, kept)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            raise RolloutError(f"cannot keep {file} in the leader's store: {exc.strerror or exc}") from None

    def held(self, release: bytes, devices: Sequence[DeviceInfo]) -> dict[str, str]:
        """device -> the release's version where it runs every part of it (a device runs the
        release all of whose parts it states); elsewhere what it runs of the parts that change
        ("firmware 1.0.0, config:app none"): the plan's and the status's "from" of each device."""
        document, stored = admitted(release)
        changes: dict[str, list[str]] = {d.device_id: [] for d in devices}
        for p in stored.parts:
            held = self.parts[p.kind].held(p.release, devices)
            for device, said in changes.items():
                version = held.get(device, "")
                if version != p.version:
                    said.append(f"{p.part} {version or 'none'}")
        return {device: ", ".join(said)[:FROM_MAX] if said else document.version for device, said in changes.items()}

    def offers(self, r: RolloutRow, devices: Sequence[DeviceRow], context: OfferContext) -> list[Outgoing]:
        _, stored = admitted(r.signed_manifest)
        per_device: dict[str, list[PartOffer]] = {d.device_id: [] for d in devices}
        for p in stored.parts:
            row = dataclasses.replace(r, artifact=p.artifact, version=p.version, signed_manifest=p.release)
            for out in self.parts[p.kind].offers(row, devices, context):
                per_device[out.device].append(PartOffer(part=p.part, payload=out.payload))
        windows = tuple(r.spec.device.maintenance_windows)
        return [Outgoing(device, KIND_RELEASE_OFFER,
                         encode(ReleaseOffer(rollout_id=r.id, document=stored.document, parts=tuple(parts),
                                             maintenance_windows=windows, trust=context.trust)),
                         key=f"release.offer:{r.id}") for device, parts in per_device.items()]

    def in_sync(self, release: bytes, devices: Sequence[str]) -> set[str]:
        return set()


__all__ = ["RELEASE", "AdmittedPart", "AdmittedRelease", "ReleaseKind", "admitted", "describe_release"]
