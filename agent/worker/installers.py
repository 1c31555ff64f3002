"""The installer a worker's `[firmware] installer` names, built through the backend table
(`firmware_rollout.device.backends`), or the client of the root helper that runs it. Only the
named backend's module is imported: a device carries one boot machinery, not four."""

from __future__ import annotations

from pathlib import Path

from agent.core.clock import Clock
from agent.core.config import FirmwareSection
from firmware_rollout.device.backends import InstallerContext, configured_backend, rebooter_from_config
from firmware_rollout.device.reboot import Rebooter
from firmware_rollout.device.slots import Installer
from rollout_engine.keys import Verifier


def firmware_state_dir(fw: FirmwareSection, data_dir: Path) -> Path:
    return Path(fw.state_dir) if Path(fw.state_dir).is_absolute() else data_dir / fw.state_dir


def installer_from_config(fw: FirmwareSection, state_dir: Path, *, clock: Clock,
                          verify_key: Verifier | None, source: str = "config") -> Installer:
    """The backend `installer` names, or (`helper_socket` set) the client of the root helper that
    runs it (the helper builds the backend itself, from the table). Raises `ConfigError` naming the key of a wrong
    table, `InstallError` when the boot machinery cannot be read (a missing tool, no slot on
    the kernel command line, the helper not answering)."""
    if fw.helper_socket:
        from firmware_rollout.device.helper import HelperInstaller
        from rollout_engine.trust import TrustedKeys

        held = verify_key if isinstance(verify_key, TrustedKeys) else None  # sent along: the helper checks it
        return HelperInstaller(fw.helper_socket, clock=clock, settle_s=fw.reboot_timeout_s,
                               trust=(lambda: held.document_bytes) if held is not None else None)
    return configured_backend(fw, source=source).build(InstallerContext(state_dir, clock, verify_key))


def rebooter_for(installer: Installer, fw: FirmwareSection, *, clock: Clock) -> Rebooter:
    """The helper reboots when it installs; else `rebooter_from_config`."""
    if fw.helper_socket:
        from firmware_rollout.device.helper import HelperInstaller

        if isinstance(installer, HelperInstaller):
            return installer
    return rebooter_from_config(fw, clock=clock)


__all__ = ["firmware_state_dir", "installer_from_config", "rebooter_for"]
