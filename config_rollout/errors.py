"""Errors of configuration rollouts, under the project's one tree (`agent.core.errors`).

ConfigReleaseError              a config release is refused (the text says why, naming the file)
├── MalformedRelease            not a release, truncated, bad header or manifest, over a cap
└── ReleaseSignature            the signature does not verify against the fleet's key
"""

from __future__ import annotations

from agent.core.errors import EdgeAgentError


class ConfigReleaseError(EdgeAgentError):
    """A config release is refused; the message names the file and says why, in one line."""


class MalformedRelease(ConfigReleaseError):
    """The bytes are not a well-formed release: magic, header, manifest, a document's size or hash."""


class ReleaseSignature(ConfigReleaseError):
    """The release's signature does not verify against the fleet's key (another key, or tampered)."""


__all__ = ["ConfigReleaseError", "MalformedRelease", "ReleaseSignature"]
