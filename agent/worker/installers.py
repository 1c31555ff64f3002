"""The installer a worker's `[firmware] installer` names, built from its table. Only the named
backend's module is imported: a device carries one boot machinery, not four."""

from __future__ import annotations

from pathlib import Path

from agent.core.clock import Clock
from agent.core.config import FirmwareSection
from firmware_rollout.artifact.keys import VerifyKey
from firmware_rollout.device.reboot import CommandRebooter, ExecRebooter, Rebooter
from firmware_rollout.device.slots import DirectoryInstaller, Installer
from firmware_rollout.device.updater import SLOTS_DIR


def firmware_state_dir(fw: FirmwareSection, data_dir: Path) -> Path:
    return Path(fw.state_dir) if Path(fw.state_dir).is_absolute() else data_dir / fw.state_dir


def installer_from_config(fw: FirmwareSection, state_dir: Path, *, clock: Clock,
                          verify_key: VerifyKey | None, in_helper: bool = False) -> Installer:
    """The backend `installer` names, or (`helper_socket` set, outside the helper itself) the
    client of the root helper that runs it. Raises `InstallError` when the boot machinery cannot
    be read (a missing tool, no slot on the kernel command line, the helper not answering)."""
    if fw.helper_socket and not in_helper:
        from firmware_rollout.device.helper import HelperInstaller

        return HelperInstaller(fw.helper_socket, clock=clock)
    if fw.installer == "uboot":
        from firmware_rollout.device.uboot import UBootInstaller

        u = fw.uboot
        assert u is not None  # load_config checks the table is there
        return UBootInstaller(fw_env_config=u.fw_env_config, fw_env_defaults=u.fw_env_defaults, slot_a=u.slot_a,
                              slot_b=u.slot_b, cmdline_path=u.cmdline_path, boot_attempts=u.boot_attempts,
                              fw_printenv=u.fw_printenv, fw_setenv=u.fw_setenv, clock=clock, verify_key=verify_key)
    if fw.installer == "tryboot":
        from firmware_rollout.device.tryboot import PiSlot, TrybootInstaller

        t = fw.tryboot
        assert t is not None and t.slot_a is not None and t.slot_b is not None  # load_config checks them
        slots = [PiSlot(partition=s.partition, boot=Path(s.boot), root=Path(s.root) if s.root else None)
                 for s in (t.slot_a, t.slot_b)]
        return TrybootInstaller(autoboot_path=t.autoboot_path, partition_path=t.partition_path, slot_a=slots[0],
                                slot_b=slots[1], state_dir=state_dir, clock=clock, verify_key=verify_key)
    if fw.installer == "rauc":
        from firmware_rollout.device.rauc import RaucInstaller

        return RaucInstaller(state_dir=state_dir, rauc=fw.rauc.rauc, slot_class=fw.rauc.slot_class, clock=clock,
                             verify_key=verify_key)
    return DirectoryInstaller(state_dir / SLOTS_DIR, clock=clock, verify_key=verify_key)


def rebooter_for(installer: Installer, fw: FirmwareSection, *, clock: Clock) -> Rebooter:
    """The helper reboots when it installs; else `rebooter_from_config`."""
    if fw.helper_socket:
        from firmware_rollout.device.helper import HelperInstaller

        if isinstance(installer, HelperInstaller):
            return installer
    return rebooter_from_config(fw, clock=clock)


def rebooter_from_config(fw: FirmwareSection, *, clock: Clock) -> Rebooter:
    """`reboot_command`; empty: restart the agent in place for the directory installer (its
    "slots" need no reboot) and `systemctl reboot` for a real one. A Raspberry Pi boots its
    trial slot only through `trial_reboot_command` (`reboot "0 tryboot"`)."""
    argv = fw.reboot_command or ([] if fw.installer == "directory" else ["systemctl", "reboot"])
    if not argv:
        return ExecRebooter()
    trial = fw.tryboot.trial_reboot_command if fw.installer == "tryboot" and fw.tryboot is not None else []
    return CommandRebooter(argv, trial_argv=trial, clock=clock, settle_s=fw.reboot_timeout_s)


__all__ = ["firmware_state_dir", "installer_from_config", "rebooter_for", "rebooter_from_config"]
