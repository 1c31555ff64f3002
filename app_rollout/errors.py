"""Errors of applications, under the project's one tree (`agent.core.errors`).

AppBundleError (ArtifactError)   a bundle is refused (the text names the file and says why)
├── MalformedBundle              not a bundle, truncated, bad manifest, a file of another size or hash
├── BundleSignature              not signed by the fleet's key
└── UnitRefused                  its unit asks for more than an application may
AppInstallError                  the device could not install, start or take back an application
"""

from __future__ import annotations

from agent.core.errors import ArtifactError, EdgeAgentError


class AppBundleError(ArtifactError):
    """An application bundle is refused; the message names it and says why, in one line."""


class MalformedBundle(AppBundleError):
    """The bytes are not a well-formed bundle: magic, header, manifest, a file's size or hash."""


class BundleSignature(AppBundleError):
    """The bundle's signature does not verify against the fleet's key (another key, or tampered)."""


class UnitRefused(AppBundleError):
    """The bundle's unit asks for something an application may not have (a key, a path, a user)."""


class AppInstallError(EdgeAgentError):
    """An application could not be installed, started, checked or taken back on this device."""


__all__ = ["AppBundleError", "AppInstallError", "BundleSignature", "MalformedBundle", "UnitRefused"]
