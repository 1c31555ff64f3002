"""Errors of the firmware side, all under the project's one tree (`agent.core.errors`).

ArtifactError                       a firmware artifact is refused (the text says why)
├── MalformedArtifact               not an artifact, truncated, bad header or manifest
├── BadSignature                    the signature does not verify against the pinned key
│   ├── WrongKey                    signed by another key than the pinned one (rollout_engine)
│   ├── TrustError                  a trust document refused (rollout_engine)
│   └── Unsigned                    built without a key and never signed
├── ChunkMismatch                   a chunk, the whole image or its size differs from the manifest
├── Incompatible                    wrong hardware, or installed version below the minimum
├── Downgrade                       older than the installed version and not a signed rollback
├── InvalidVersion                  a version string is not a strict semantic version (rollout_engine)
└── KeyFileError                    a key file is missing, unreadable or not an ed25519 key (rollout_engine)
UpdaterError                        the device-side updater cannot proceed
└── InstallError                    writing a slot or switching the boot target failed
"""

from __future__ import annotations

from agent.core.errors import ArtifactError, BadSignature, Downgrade, EdgeAgentError
from rollout_engine.errors import InvalidVersion, KeyFileError, TrustError, WrongKey


class MalformedArtifact(ArtifactError):
    """The bytes are not a well-formed artifact: bad magic, header, manifest or length."""


class Unsigned(BadSignature):
    """The artifact carries no signature."""


class ChunkMismatch(ArtifactError):
    """A chunk's or the whole image's hash or size differs from the signed manifest."""


class Incompatible(ArtifactError):
    """The image is not for this hardware, or needs a newer installed version first."""


class UpdaterError(EdgeAgentError):
    """The device-side updater cannot proceed."""


class InstallError(UpdaterError):
    """Writing the inactive slot or changing the boot target failed."""


__all__ = [
    "ArtifactError",
    "BadSignature",
    "ChunkMismatch",
    "Downgrade",
    "Incompatible",
    "InstallError",
    "InvalidVersion",
    "KeyFileError",
    "MalformedArtifact",
    "TrustError",
    "Unsigned",
    "UpdaterError",
    "WrongKey",
]
