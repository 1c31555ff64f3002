"""Firmware rollouts: a library in three rooms over a shared artifact format.

Layer 5: imports the engine's library (`rollout_engine`: keys, trust, versions, windows),
`agent.core`, `agent.actors`, `agent.outbox`, `agent.transport` and `agent.service` (the HTTP
layer), never the worker, leader, simulator or CLI, nor its peer `config_rollout` (the import
contracts in `pyproject.toml` say so).

    messages, errors  shared: the wire messages, the error tree
    artifact/       the format: manifest, files (build, sign, verify), fixture
    device/         the device's updater: its store, A/B slots (`Installer`), staging, chunk
                    sources and the MQTT chunk client, health checks, rebooters
    orchestration/  the leader's side of the kind: admitting artifacts, serving them over HTTP
                    and MQTT chunks (ConfigServers); the rollout itself is the engine's

`device/` and `orchestration/` never import each other. This face names what callers use and
loads each name's module on first use, so importing one room never loads the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.core.lazy import lazy_attributes

if TYPE_CHECKING:
    from firmware_rollout.artifact.files import (
        ArtifactInfo,
        build_artifact,
        inspect_artifact,
        read_signed_manifest,
        sign_artifact,
        verify_artifact,
    )
    from firmware_rollout.artifact.fixture import make_artifact
    from firmware_rollout.artifact.manifest import (
        ImageVerifier,
        Manifest,
        SignedManifest,
        check_policy,
        parse_signed_manifest,
        verify_signed_manifest,
    )
    from firmware_rollout.device.health import AllChecks, CommandCheck, ConnectivityCheck, HealthCheck, HealthResult
    from firmware_rollout.device.reboot import CommandRebooter, ExecRebooter, Rebooter
    from firmware_rollout.device.slots import DirectoryInstaller, Installer
    from firmware_rollout.device.sources import ArtifactChunkSource, ChunkSource
    from firmware_rollout.device.updater import Updater, UpdaterSettings, UpdaterStatus
    from firmware_rollout.errors import (
        ChunkMismatch,
        Incompatible,
        InstallError,
        InvalidVersion,
        KeyFileError,
        MalformedArtifact,
        Unsigned,
        UpdaterError,
        WrongKey,
    )
    from firmware_rollout.messages import (
        KIND_UPDATE_OFFER,
        KIND_UPDATE_REPORT,
        TERMINAL_STATES,
        UpdateOffer,
        register_messages,
    )
    from rollout_engine.keys import (
        SigningKey,
        VerifyKey,
        generate_keypair,
        load_signing_key,
        load_verify_key,
    )
    from rollout_engine.version import Version

_LAZY: dict[str, tuple[str, ...]] = {
    "firmware_rollout.artifact.files": (
        "ArtifactInfo", "build_artifact", "inspect_artifact", "read_signed_manifest", "sign_artifact",
        "verify_artifact",
    ),
    "firmware_rollout.artifact.fixture": (
        "make_artifact",
    ),
    "firmware_rollout.errors": (
        "ChunkMismatch", "Incompatible", "InstallError", "InvalidVersion", "KeyFileError", "MalformedArtifact",
        "Unsigned", "UpdaterError", "WrongKey",
    ),
    "firmware_rollout.device.health": (
        "AllChecks", "CommandCheck", "ConnectivityCheck", "HealthCheck", "HealthResult",
    ),
    "rollout_engine.keys": (
        "SigningKey", "VerifyKey", "generate_keypair", "load_signing_key", "load_verify_key",
    ),
    "firmware_rollout.artifact.manifest": (
        "ImageVerifier", "Manifest", "SignedManifest", "check_policy", "parse_signed_manifest",
        "verify_signed_manifest",
    ),
    "firmware_rollout.messages": (
        "KIND_UPDATE_OFFER", "KIND_UPDATE_REPORT", "TERMINAL_STATES", "UpdateOffer", "register_messages",
    ),
    "firmware_rollout.device.reboot": (
        "CommandRebooter", "ExecRebooter", "Rebooter",
    ),
    "firmware_rollout.device.slots": (
        "DirectoryInstaller", "Installer",
    ),
    "firmware_rollout.device.sources": (
        "ArtifactChunkSource", "ChunkSource",
    ),
    "firmware_rollout.device.updater": (
        "Updater", "UpdaterSettings", "UpdaterStatus",
    ),
    "rollout_engine.version": (
        "Version",
    ),
}


__getattr__ = lazy_attributes(__name__, {name: module for module, names in _LAZY.items() for name in names})


__all__ = [
    "AllChecks",
    "ArtifactChunkSource",
    "ArtifactInfo",
    "ChunkMismatch",
    "ChunkSource",
    "CommandCheck",
    "CommandRebooter",
    "ConnectivityCheck",
    "DirectoryInstaller",
    "ExecRebooter",
    "HealthCheck",
    "HealthResult",
    "ImageVerifier",
    "Incompatible",
    "InstallError",
    "Installer",
    "InvalidVersion",
    "KIND_UPDATE_OFFER",
    "KIND_UPDATE_REPORT",
    "KeyFileError",
    "MalformedArtifact",
    "Manifest",
    "Rebooter",
    "SignedManifest",
    "SigningKey",
    "TERMINAL_STATES",
    "Unsigned",
    "UpdateOffer",
    "Updater",
    "UpdaterError",
    "UpdaterSettings",
    "UpdaterStatus",
    "VerifyKey",
    "Version",
    "WrongKey",
    "build_artifact",
    "check_policy",
    "generate_keypair",
    "inspect_artifact",
    "load_signing_key",
    "load_verify_key",
    "make_artifact",
    "parse_signed_manifest",
    "read_signed_manifest",
    "register_messages",
    "sign_artifact",
    "verify_artifact",
    "verify_signed_manifest",
]
