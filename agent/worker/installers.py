"""The installer a worker's `[firmware] installer` names, built from its table."""

from __future__ import annotations

from pathlib import Path

from agent.core.clock import Clock
from agent.core.config import FirmwareSection
from firmware_rollout.artifact.keys import VerifyKey
from firmware_rollout.device.slots import DirectoryInstaller, Installer
from firmware_rollout.device.uboot import UBootInstaller
from firmware_rollout.device.updater import SLOTS_DIR


def firmware_state_dir(fw: FirmwareSection, data_dir: Path) -> Path:
    return Path(fw.state_dir) if Path(fw.state_dir).is_absolute() else data_dir / fw.state_dir


def installer_from_config(fw: FirmwareSection, state_dir: Path, *, clock: Clock,
                          verify_key: VerifyKey | None) -> Installer:
    """Raises `InstallError` when the boot machinery cannot be read (a missing tool, no slot on
    the kernel command line)."""
    if fw.installer == "uboot":
        u = fw.uboot
        assert u is not None  # load_config checks the table is there
        return UBootInstaller(fw_env_config=u.fw_env_config, fw_env_defaults=u.fw_env_defaults, slot_a=u.slot_a,
                              slot_b=u.slot_b, cmdline_path=u.cmdline_path, boot_attempts=u.boot_attempts,
                              fw_printenv=u.fw_printenv, fw_setenv=u.fw_setenv, clock=clock, verify_key=verify_key)
    return DirectoryInstaller(state_dir / SLOTS_DIR, clock=clock, verify_key=verify_key)


__all__ = ["firmware_state_dir", "installer_from_config"]
