"""The leader's own copies of the artifacts it rolls out: verified, content-addressed, immutable.

`ArtifactStore.admit(path)` copies the operator's file into the store's directory (a temporary
name, fsynced), then checks the copy, never the original (which may change under us), against
the fleet's public key as a device would: header, signature, manifest, every chunk, the image
hash. Only then is the copy renamed to `<first 32 hex of the file's sha256>.eafw`; the same
artifact admitted twice is one file. A rollout serves chunks from that copy alone, so rebuilding
or deleting the operator's file mid-rollout changes nothing the devices receive.

A rollback's artifact must be signed as a rollback (`Manifest.rollback`), or the devices would
refuse it as a downgrade and the rollback could only fail, and must name the version it undoes
among those it may replace (`Manifest.rollback_from`): a device running another refuses it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from agent.core.errors import ArtifactError, RolloutError
from agent.core.files import fsync_dir, fsync_path
from firmware_rollout.artifact.files import verify_artifact
from firmware_rollout.artifact.manifest import SignedManifest
from rollout_engine.keys import Verifier

log = logging.getLogger(__name__)

SUFFIX = ".eafw"
_COPY_BLOCK = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Admitted:
    path: Path  # the store's copy
    signed: SignedManifest
    sha256: str


class ArtifactStore:
    def __init__(self, directory: str | Path, key: Verifier | None, *, key_source: str = "[firmware] public_key"):
        self.directory = Path(directory)
        self._key = key
        self._key_source = key_source

    def admit(self, source: str | Path, *, rollback: bool = False, replaces: str = "") -> Admitted:
        """The verified copy of `source`; `RolloutError` saying why not (nothing is kept then).
        A rollback must also name `replaces` (the version the devices run) among the versions it
        may replace."""
        src = Path(source)
        self._need_key(src)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o750)
        tmp = self.directory / f".admit-{os.getpid()}-{id(self):x}.tmp"
        try:
            digest = _copy(src, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self._keep(src, tmp, digest, rollback=rollback, replaces=replaces)

    def take(self, received: Path, *, shown: str) -> Admitted:
        """Admit a file already written into the store's directory by its owner (an upload the
        console received): checked where it lies and renamed into place, never copied; removed
        when it is refused. `shown` names it in a refusal."""
        self._need_key(Path(shown))
        if received.parent.resolve() != self.directory.resolve():
            raise RolloutError(f"{shown}: not in the artifact store's directory {self.directory}")
        try:
            os.chmod(received, 0o644)  # as a copy is made: the leader reads what the console took
            fsync_path(received)
        except OSError as exc:
            received.unlink(missing_ok=True)
            raise RolloutError(f"cannot keep {shown}: {exc.strerror or exc}") from None
        return self._keep(Path(shown), received, _sha256(received), rollback=False, replaces="")

    def _need_key(self, src: Path) -> None:
        if self._key is None:
            raise RolloutError(f"cannot check artifact {src}: the leader's config has no {self._key_source} (the"
                               " fleet's public key, as the devices pin it)")

    def _keep(self, src: Path, tmp: Path, digest: str, *, rollback: bool, replaces: str) -> Admitted:
        """Check `tmp` (a file in the store's directory), rename it to its content address."""
        assert self._key is not None
        try:
            try:
                signed = verify_artifact(tmp, self._key)
            except ArtifactError as exc:
                raise RolloutError(f"artifact {src} refused: {exc}") from None
            m = signed.manifest
            if rollback and not m.rollback:
                raise RolloutError(f"artifact {src} (version {m.version}) is not signed as a rollback:"
                                   " the devices would refuse it as a downgrade (build it with --rollback)")
            if rollback and not m.rollback_from:
                raise RolloutError(f"artifact {src} (version {m.version}) names no version it may replace: build it"
                                   " with --rollback-from VERSION, so it cannot downgrade any other")
            if rollback and replaces and replaces not in m.rollback_from:
                raise RolloutError(f"artifact {src} replaces only version {', '.join(m.rollback_from)}; the"
                                   f" devices to roll back run {replaces}")
            final = self.directory / f"{digest[:32]}{SUFFIX}"
            os.replace(tmp, final)
            fsync_dir(self.directory)
        finally:
            tmp.unlink(missing_ok=True)
        log.info("artifact %s admitted as %s (version %s)", src, final.name, signed.manifest.version)
        return Admitted(final, signed, digest)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(_COPY_BLOCK):
                h.update(block)
    except OSError as exc:
        raise RolloutError(f"cannot read artifact {path}: {exc.strerror or exc}") from None
    return h.hexdigest()


def _copy(src: Path, dst: Path) -> str:
    """Copy `src` to `dst` durably; the sha256 of the bytes copied."""
    h = hashlib.sha256()
    try:
        with open(src, "rb") as inp, open(dst, "wb") as out:
            while block := inp.read(_COPY_BLOCK):
                h.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        raise RolloutError(f"cannot copy artifact {src}: {exc.strerror or exc}") from None
    return h.hexdigest()


__all__ = ["Admitted", "ArtifactStore"]
