"""`edge-agent firmware install|status|commit|revert --config CONFIG`: the device's own updater
at the console, through the installer `[firmware] installer` names (an operator's manual path
and a recovery path). The same checks as a rollout: the signature against the pinned key, every
chunk, the whole image, the device policy; the updater's records stay the truth, so the agent
carries on from them at its next start (a manual install is health-checked on its trial boot).

install, commit and revert refuse while the agent runs (its local API answers): one updater per
state directory. status only reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.core.clock import SystemClock
from agent.core.config import AgentConfig, load_config, local_api_socket
from agent.core.errors import EdgeAgentError
from firmware_rollout.device.health import HealthResult
from firmware_rollout.device.slots import Installer
from firmware_rollout.device.updater import Updater, UpdaterStatus
from firmware_rollout.errors import UpdaterError
from firmware_rollout.messages import UpdateOffer
from rollout_engine.messages import RolloutReport

if TYPE_CHECKING:
    from rollout_engine.keys import VerifyKey


def add_device_actions(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    install = sub.add_parser("install", help="install a local artifact into the inactive slot and arm a trial boot")
    install.add_argument("artifact", type=Path, metavar="ARTIFACT")
    status = sub.add_parser("status", help="the installer's slots: booted, default, trial, attempts, versions")
    status.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser("commit", help="keep the new slot this device booted on its trial (no health check)")
    sub.add_parser("revert", help="give up the update in progress: the old slot is the default again")
    for parser in (install, status, sub.choices["commit"], sub.choices["revert"]):
        parser.add_argument("--config", required=True, type=Path, metavar="CONFIG", help="the worker's config file")


class _ConsoleDecides:
    """The console's updater never runs the trial's health check (the agent does, at its start)."""

    async def check(self, clock: object, timeout_s: float) -> HealthResult:
        return HealthResult(False, "the health check runs in the agent")


class _RebootByHand:
    """An install from the console stops once the trial is armed: the operator reboots."""

    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        return None


async def _keep(report: RolloutReport) -> None:
    """Reports of a console install are the device's own: kept in its records, not sent."""


def _config(args: argparse.Namespace) -> AgentConfig:
    config = load_config(args.config)
    if not config.firmware.public_key:
        raise UpdaterError(f"{args.config}: [firmware] public_key is not set: no image can be checked")
    return config


def _refuse_while_running(config: AgentConfig) -> None:
    from agent.client import AgentUnavailable, Client

    sock = local_api_socket(config, data_dir=Path(config.agent.data_dir))
    try:
        with Client(sock, timeout_s=2) as client:
            client.status()
    except (AgentUnavailable, OSError, EdgeAgentError):
        return
    raise UpdaterError(f"the agent is running (its local API answers at {sock}): stop it first "
                       "(systemctl stop edge-agent), one updater per state directory")


@dataclass(frozen=True)
class _Device:
    state_dir: Path
    installer: Installer
    key: VerifyKey
    clock: SystemClock


def _device(config: AgentConfig) -> _Device:
    from agent.worker.installers import firmware_state_dir, installer_from_config
    from rollout_engine.keys import load_verify_key

    fw = config.firmware
    clock = SystemClock()
    key = load_verify_key(fw.public_key)
    state_dir = firmware_state_dir(fw, Path(config.agent.data_dir))
    return _Device(state_dir, installer_from_config(fw, state_dir, clock=clock, verify_key=key), key, clock)


async def _open(config: AgentConfig) -> Updater:
    fw = config.firmware
    d = _device(config)
    return await Updater.open(d.state_dir, device_id=config.agent.device_id, verify_key=d.key, clock=d.clock,
                              health=_ConsoleDecides(), rebooter=_RebootByHand(), installer=d.installer,
                              hardware=fw.hardware or None, image=fw.image or None,
                              initial_version=config.agent.firmware_version, on_report=_keep)


async def _open_read_only(config: AgentConfig) -> Updater:
    """status while the agent may run: the updater opened only to read (no boot accounting)."""
    d = _device(config)
    return await Updater.inspect(d.state_dir, installer=d.installer, device_id=config.agent.device_id,
                                 verify_key=d.key, clock=d.clock, initial_version=config.agent.firmware_version)


def _view(updater: Updater, status: UpdaterStatus) -> dict[str, object]:
    installer = updater.installer
    return {"installer": installer.name, "booted_slot": installer.booted_slot(),
            "default_slot": installer.default_slot(), "trial_slot": installer.trial_slot(),
            "active_version": status.active_version, "slot_versions": updater.slot_versions(),
            "update": {"state": status.state, "rollout_id": status.rollout_id, "version": status.version,
                       "detail": status.detail},
            **installer.describe()}


async def install(args: argparse.Namespace) -> int:
    from firmware_rollout.artifact.files import verify_artifact
    from firmware_rollout.device.sources import ArtifactChunkSource
    from rollout_engine.keys import load_verify_key

    config = _config(args)
    _refuse_while_running(config)
    fw = config.firmware
    # a local file is checked whole before a byte of the slot changes
    signed = verify_artifact(args.artifact, load_verify_key(fw.public_key), hardware=fw.hardware or None,
                             image=fw.image or None)
    updater = await _open(config)
    try:
        source = ArtifactChunkSource(args.artifact)
        offer = UpdateOffer(rollout_id=f"console-{signed.manifest.version}", signed_manifest=source.signed_manifest)
        report = await updater.offer(offer, source)
        status = updater.status()
    finally:
        await updater.close()
    if status.state != "rebooting":
        print(f"edge-agent firmware install: {report.state}: {report.detail}", file=sys.stderr)
        return 0 if status.state == "committed" else 2
    print(f"installed {signed.manifest.name} {signed.manifest.version} into slot {updater.installer.trial_slot()}"
          f" ({updater.installer.name}); reboot to try it: the agent checks its health and commits or reverts")
    return 0


async def status(args: argparse.Namespace) -> int:
    config = _config(args)
    updater = await _open_read_only(config)
    try:
        view = _view(updater, updater.status())
    finally:
        await updater.close()
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    for label, value in view.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items() if v not in (None, ""))
        print(f"{label:<15} {value if value not in (None, '') else '-'}")
    return 0


async def commit(args: argparse.Namespace) -> int:
    config = _config(args)
    _refuse_while_running(config)
    updater = await _open(config)
    try:
        done = await updater.operator_commit()
    finally:
        await updater.close()
    print(f"committed slot {done.booted_slot}: version {done.active_version} is the default")
    return 0


async def revert(args: argparse.Namespace) -> int:
    config = _config(args)
    _refuse_while_running(config)
    updater = await _open(config)
    try:
        done = await updater.operator_revert()
    finally:
        await updater.close()
    back = "" if done.booted_slot == done.default_slot else f"; reboot to return to slot {done.default_slot}"
    print(f"reverted: slot {done.default_slot} is the default again{back}")
    return 0


__all__ = ["add_device_actions", "commit", "install", "revert", "status"]
