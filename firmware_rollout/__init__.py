"""Firmware rollouts: signed artifacts and the device-side A/B updater.

Layer 6: imports `agent.core` (and may import `agent.actors`, `agent.outbox`), never the
worker, leader, simulator or CLI. Modules:

    version     strict semantic versions
    keys        ed25519 key pairs as PEM files (`SigningKey`, `VerifyKey`)
    manifest    the signed manifest: byte layout, signature, device policy, chunk verifier
    artifact    artifact files: build, sign, verify (streaming), inspect
    messages    `UpdateOffer` (leader -> device) and `UpdateReport` (device -> leader)
    sources     `ChunkSource` protocol; `ArtifactChunkSource` for a local file
    slots       `Installer` protocol (A/B boot hook); `DirectoryInstaller`
    health      `HealthCheck` protocol; connectivity, command and combined checks
    reboot      `Rebooter` protocol; exec and command rebooters
    updater     `Updater`: the durable download / install / trial boot / commit-or-revert machine
"""

from firmware_rollout.artifact import (
    ArtifactInfo,
    build_artifact,
    inspect_artifact,
    read_signed_manifest,
    sign_artifact,
    verify_artifact,
)
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
from firmware_rollout.health import AllChecks, CommandCheck, ConnectivityCheck, HealthCheck, HealthResult
from firmware_rollout.keys import SigningKey, VerifyKey, generate_keypair, load_signing_key, load_verify_key
from firmware_rollout.manifest import (
    ImageVerifier,
    Manifest,
    SignedManifest,
    check_policy,
    parse_signed_manifest,
    verify_signed_manifest,
)
from firmware_rollout.messages import (
    KIND_UPDATE_OFFER,
    KIND_UPDATE_REPORT,
    TERMINAL_STATES,
    UpdateOffer,
    UpdateReport,
    register_messages,
    report_key,
    report_message,
)
from firmware_rollout.reboot import CommandRebooter, ExecRebooter, Rebooter
from firmware_rollout.slots import DirectoryInstaller, Installer
from firmware_rollout.sources import ArtifactChunkSource, ChunkSource
from firmware_rollout.updater import Updater, UpdaterSettings, UpdaterStatus
from firmware_rollout.version import Version

__all__ = [
    "KIND_UPDATE_OFFER",
    "KIND_UPDATE_REPORT",
    "TERMINAL_STATES",
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
    "KeyFileError",
    "MalformedArtifact",
    "Manifest",
    "Rebooter",
    "SignedManifest",
    "SigningKey",
    "Unsigned",
    "UpdateOffer",
    "UpdateReport",
    "Updater",
    "UpdaterError",
    "UpdaterSettings",
    "UpdaterStatus",
    "Version",
    "VerifyKey",
    "WrongKey",
    "build_artifact",
    "check_policy",
    "generate_keypair",
    "inspect_artifact",
    "load_signing_key",
    "load_verify_key",
    "parse_signed_manifest",
    "read_signed_manifest",
    "register_messages",
    "report_key",
    "report_message",
    "sign_artifact",
    "verify_artifact",
    "verify_signed_manifest",
]
