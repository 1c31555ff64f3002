"""Errors of what every rollout kind signs and versions, under the project's one tree
(`agent.core.errors`):

ArtifactError (agent.core.errors)   a signed thing (an artifact, a release, a key) is refused
├── BadSignature                    the signature does not verify against the pinned key
│   ├── WrongKey                    signed by another key than the pinned one
│   └── TrustError                  a trust document refused
├── InvalidVersion                  a version string is not a strict semantic version
└── KeyFileError                    a key file is missing, unreadable or not an ed25519 key
RolloutError (agent.core.errors)
└── ReportRefused                   a device's report about a rollout that offered it nothing
"""

from __future__ import annotations

from agent.core.errors import ArtifactError, BadSignature, RolloutError


class WrongKey(BadSignature):
    """Signed by a key other than the pinned one."""


class TrustError(BadSignature):
    """A trust document refused: malformed, not newer, not signed by a trusted root."""


class InvalidVersion(ArtifactError):
    """A version is not a strict semantic version (MAJOR.MINOR.PATCH[-pre][+build])."""


class KeyFileError(ArtifactError):
    """A key file cannot be read or does not hold the expected ed25519 key."""


class ReportRefused(RolloutError):
    """A device's report about a rollout it is not in, or one that offered it nothing yet: it
    changes nothing, and the device is answered `rejected` with the reason."""


__all__ = ["InvalidVersion", "KeyFileError", "ReportRefused", "TrustError", "WrongKey"]
