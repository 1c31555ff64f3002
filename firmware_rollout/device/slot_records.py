"""What the root helper knows of each slot by itself: the version and image it wrote and read back
there, or that the running system booted from it. Kept in the helper's own root-owned state
directory, so nothing the agent says decides which image is older or which slot may become the
default:

    writing   the helper opened the slot for an image and has not read it back whole yet
    checked   the helper read the whole image back and it matched its signed manifest
    booted    the running system came from this slot (its version: the checked image's, else the
              config's `[agent] firmware_version`, the image the device was made with); `trial`
              while the image booted is one the helper checked and has not committed since

A slot with no record, or one being written, is never made the default. Nor, once the booted
image is committed, is a slot holding an older version (the floor): a compromised agent cannot
undo a security fix by reverting to the slot it replaced. Only a signed rollback the helper
wrote there (`rollback`: its manifest named the booted version) goes back.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import msgspec

from agent.core.files import atomic_write
from firmware_rollout.artifact.manifest import Manifest
from firmware_rollout.errors import InstallError

log = logging.getLogger(__name__)

RECORDS_FILE = "slots.json"
SlotState = Literal["writing", "checked", "booted"]


class SlotRecord(msgspec.Struct, kw_only=True, frozen=True):
    state: SlotState
    version: str
    image: str = ""  # the signed manifest's image sha256 (hex); "" for the image the device was made with
    trial: bool = False  # booted: the checked image on its trial boot, not committed yet
    rollback: bool = False  # checked: signed as a rollback that named the version it replaces


_encode = msgspec.json.Encoder().encode  # (the defaults are left out: older files read the same)
_decode = msgspec.json.Decoder(dict[str, SlotRecord]).decode


class SlotRecords:
    """The records of one helper's slots in `state_dir/slots.json`; every change is written
    (atomically, fsynced) before the step it describes goes on."""

    def __init__(self, state_dir: Path, *, slots: tuple[str, str], booted: str, made_with: str) -> None:
        self._path = state_dir / RECORDS_FILE
        self._slots = slots
        self._booted = booted
        self._records = self._load()
        found = self._records.get(booted)
        if found is None or found.state == "writing":  # nothing the helper checked: the image it was made with
            self._save(booted, SlotRecord(state="booted", version=made_with))
        elif found.state == "checked":  # its first boot: on trial until the helper commits it
            self._save(booted, SlotRecord(state="booted", version=found.version, image=found.image, trial=True))

    def _load(self) -> dict[str, SlotRecord]:
        try:
            records = _decode(self._path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, msgspec.DecodeError) as exc:
            # unreadable: start from what the helper can see (the booted slot); the other slot
            # gets no record, so it cannot become the default until written and checked again
            log.warning("%s: unreadable slot records (%s): starting afresh", self._path, exc)
            return {}
        return {slot: r for slot, r in records.items() if slot in self._slots}

    def _save(self, slot: str, record: SlotRecord | None) -> None:
        records = dict(self._records)
        if record is None:
            records.pop(slot, None)
        else:
            records[slot] = record
        try:
            atomic_write(self._path, _encode(records))
        except OSError as exc:
            raise InstallError(f"cannot record slot {slot} in {self._path}: {exc.strerror or exc}") from exc
        self._records = records

    @property
    def booted_version(self) -> str:
        return self._records[self._booted].version

    def get(self, slot: str) -> SlotRecord | None:
        return self._records.get(slot)

    def opening(self, slot: str, manifest: Manifest) -> None:
        """The slot is about to be written: whatever it held is gone."""
        current = self._records.get(slot)
        if current is None or current.state != "writing" or current.image != manifest.sha256.hex():
            self._save(slot, SlotRecord(state="writing", version=manifest.version, image=manifest.sha256.hex()))

    def checked(self, slot: str, manifest: Manifest) -> None:
        self._save(slot, SlotRecord(state="checked", version=manifest.version, image=manifest.sha256.hex(),
                                    rollback=manifest.rollback))

    def committed(self, slot: str) -> None:
        """The booted image was committed: from now on the floor holds."""
        record = self._records.get(slot)
        if slot == self._booted and record is not None and record.trial:
            self._save(slot, msgspec.structs.replace(record, trial=False))

    def refuse_default(self, slot: str) -> None:
        """An `InstallError` unless `slot` is the booted one, or holds an image read back and
        checked that is not below a committed booted image (unless signed as its rollback)."""
        if slot == self._booted:
            return
        record = self._records.get(slot)
        if record is None:
            raise InstallError(f"refusing to make slot {slot} the default: this helper never wrote and checked an "
                               "image there and the system did not boot from it")
        if record.state == "writing":
            raise InstallError(f"refusing to make slot {slot} the default: its image ({record.version}) was not "
                               "read back and checked since it was written")
        self.refuse_older(slot, what="the default")

    def refuse_older(self, slot: str, *, what: str) -> None:
        """The floor: an `InstallError` when `slot` holds an image older than the booted one and
        that one is committed, unless the slot's image was signed as its rollback."""
        record = self._records.get(slot)
        booted = self._records[self._booted]
        if slot == self._booted or record is None or booted.trial or record.rollback \
                or not _older(record.version, booted.version):
            return
        raise InstallError(f"refusing to make slot {slot} {what}: it holds {record.version}, older than the committed"
                           f" {booted.version} the system runs; only an image signed as a rollback of {booted.version}"
                           " goes back")

    def describe(self) -> dict[str, object]:
        return {slot: {"state": r.state, "version": r.version} for slot, r in sorted(self._records.items())}


def _older(version: str, than: str) -> bool:
    from firmware_rollout.errors import InvalidVersion
    from rollout_engine.version import Version

    try:
        return Version.parse(version) < Version.parse(than)
    except InvalidVersion:  # a version the helper cannot order: not known to be newer, so refused
        return True


__all__ = ["RECORDS_FILE", "SlotRecord", "SlotRecords", "SlotState"]
