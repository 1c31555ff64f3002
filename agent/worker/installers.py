"""The installer a worker's `[firmware] installer` names, built through the backend table
(`firmware_rollout.device.backends`), or the client of the root helper that runs it. Only the
named backend's module is imported: a device carries one boot machinery, not four."""

from __future__ import annotations

from pathlib import Path

from agent.core.clock import Clock
from agent.core.config import FirmwareSection
from firmware_rollout.artifact.keys import VerifyKey
from firmware_rollout.device.backends import InstallerContext, configured_backend
from firmware_rollout.device.reboot import CommandRebooter, ExecRebooter, Rebooter
from firmware_rollout.device.slots import Installer


def firmware_state_dir(fw: FirmwareSection, data_dir: Path) -> Path:
    return Path(fw.state_dir) if Path(fw.state_dir).is_absolute() else data_dir / fw.state_dir


def installer_from_config(fw: FirmwareSection, state_dir: Path, *, clock: Clock,
                          verify_key: VerifyKey | None, in_helper: bool = False, source: str = "config") -> Installer:
    """The backend `installer` names, or (`helper_socket` set, outside the helper itself) the
    client of the root helper that runs it. Raises `ConfigError` naming the key of a wrong
    table, `InstallError` when the boot machinery cannot be read (a missing tool, no slot on
    the kernel command line, the helper not answering)."""
    if fw.helper_socket and not in_helper:
        from firmware_rollout.device.helper import HelperInstaller

        return HelperInstaller(fw.helper_socket, clock=clock)
    return configured_backend(fw, source=source).build(InstallerContext(state_dir, clock, verify_key))


def rebooter_for(installer: Installer, fw: FirmwareSection, *, clock: Clock) -> Rebooter:
    """The helper reboots when it installs; else `rebooter_from_config`."""
    if fw.helper_socket:
        from firmware_rollout.device.helper import HelperInstaller

        if isinstance(installer, HelperInstaller):
            return installer
    return rebooter_from_config(fw, clock=clock)


def rebooter_from_config(fw: FirmwareSection, *, clock: Clock, source: str = "config") -> Rebooter:
    """`reboot_command`; empty: restart the agent in place for a backend whose updates need no
    reboot (the directory's "slots") and `systemctl reboot` for a real one. A backend may boot
    its trial slot only through its own command (tryboot: `reboot "0 tryboot"`)."""
    backend = configured_backend(fw, source=source)
    argv = fw.reboot_command or (["systemctl", "reboot"] if backend.backend.reboots else [])
    if not argv:
        return ExecRebooter()
    return CommandRebooter(argv, trial_argv=backend.trial_reboot_command(), clock=clock, settle_s=fw.reboot_timeout_s)


__all__ = ["firmware_state_dir", "installer_from_config", "rebooter_for", "rebooter_from_config"]
