"""Errors of releases, under the project's one tree (`agent.core.errors`).

ReleaseError (RolloutError)     a release document is refused (the text names the file and says why)
├── MalformedRelease            not a release document, truncated, a bad document, an order that does not fit
└── ReleaseSignature            not signed by the fleet's key
"""

from __future__ import annotations

from agent.core.errors import RolloutError


class ReleaseError(RolloutError):
    """A release document is refused; the message names it and says why, in one line."""


class MalformedRelease(ReleaseError):
    """The bytes are not a well-formed release document, or its parts and order do not fit."""


class ReleaseSignature(ReleaseError):
    """The document's signature does not verify against the fleet's key (another key, or changed)."""


__all__ = ["MalformedRelease", "ReleaseError", "ReleaseSignature"]
