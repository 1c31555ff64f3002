"""The installer backends: a table of names, each backend one module with one `Backend` entry.

    BACKENDS = {"directory": ...slots, "uboot": ...uboot, "tryboot": ...tryboot, "rauc": ...rauc}

`[firmware] installer` names a backend; its own table (`[firmware.uboot]` for "uboot") is the
backend's settings, a msgspec Struct the backend declares. An entry says everything the rest of
the product needs to know of a backend:

    settings              its table, decoded (a missing table: the defaults, unless required)
    check(s, fail)        the table's own rules, at every load (`fail(key, reason)` names the key)
    preflight(s, fail)    this host has the tools and files the table names (`run`, `config check`)
    build(s, context)     the installer
    reboots               an update boots the new slot (the directory backend restarts the agent)
    trial_reboot_command  how the device reboots into a trial (default: the plain reboot)

Only the named backend's module is imported: a device carries one boot machinery, not four.
Adding a backend is one module with its `BACKEND` and one line in `BACKENDS`; the agent's config
knows no backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, NoReturn, Protocol, TypeVar

import msgspec

from agent.core.clock import Clock
from agent.core.config import FirmwareSection, convert
from agent.core.errors import ConfigError
from firmware_rollout.device.reboot import CommandRebooter, ExecRebooter, Rebooter
from rollout_engine.keys import Verifier

if TYPE_CHECKING:
    from firmware_rollout.device.slots import Installer

BACKENDS: dict[str, str] = {
    "directory": "firmware_rollout.device.slots",
    "uboot": "firmware_rollout.device.uboot",
    "tryboot": "firmware_rollout.device.tryboot",
    "rauc": "firmware_rollout.device.rauc",
}


class BackendSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The base of a backend's table: frozen, and an unknown key is an error naming it."""


class Fail(Protocol):
    """Refuse the table: `key` within it (e.g. "slot_b"), and why."""

    def __call__(self, key: str, reason: str, /) -> NoReturn: ...


@dataclass(frozen=True)
class InstallerContext:
    """What every installer is built with besides its settings."""

    state_dir: Path  # the updater's (or the root helper's) state directory
    clock: Clock
    verify_key: Verifier | None


S = TypeVar("S", bound=BackendSettings)


def _nothing(settings: Any, fail: Fail) -> None:
    return None


def _no_trial_command(settings: Any) -> list[str]:
    return []


@dataclass(frozen=True, kw_only=True)
class Backend(Generic[S]):
    name: str
    settings: type[S]
    build: Callable[[S, InstallerContext], Installer]
    table_required: bool = False
    reboots: bool = True
    check: Callable[[S, Fail], None] = _nothing
    preflight: Callable[[S, Fail], None] = _nothing
    trial_reboot_command: Callable[[S], list[str]] = _no_trial_command


@dataclass(frozen=True)
class ConfiguredBackend:
    """The backend `[firmware] installer` names, with its table decoded and checked."""

    backend: Backend[Any]
    settings: BackendSettings
    source: str

    @property
    def name(self) -> str:
        return self.backend.name

    def build(self, context: InstallerContext) -> Installer:
        return self.backend.build(self.settings, context)

    def preflight(self) -> None:
        """Raise `ConfigError` naming the key when a tool or file the table names is not here."""
        self.backend.preflight(self.settings, _failing(self.source, self.name))

    def trial_reboot_command(self) -> list[str]:
        return self.backend.trial_reboot_command(self.settings)


def backend_named(name: str, *, source: str) -> Backend[Any]:
    """The backend `name`, its module imported now; `ConfigError` on `firmware.installer`."""
    module = BACKENDS.get(name)
    if module is None:
        raise ConfigError(source, "firmware.installer",
                          f"no installer {name!r} (the installers are {', '.join(sorted(BACKENDS))})")
    found = importlib.import_module(module).BACKEND
    assert isinstance(found, Backend) and found.name == name, f"{module}.BACKEND is not the {name} backend"
    return found


def configured_backend(fw: FirmwareSection, *, source: str = "config") -> ConfiguredBackend:
    """The backend of `fw`, its `[firmware.NAME]` table decoded and checked: a mistake is one
    `ConfigError` naming the key (`firmware.uboot.slot_b`)."""
    backend = backend_named(fw.installer, source=source)
    prefix = f"firmware.{backend.name}"
    raw = fw.installer_settings
    if raw is None:
        if backend.table_required:
            raise ConfigError(source, prefix, f'installer = "{backend.name}" needs a [{prefix}] table')
        raw = {}
    try:
        settings = convert(raw, backend.settings, source=source)
    except ConfigError as exc:
        raise ConfigError(source, f"{prefix}.{exc.key}" if exc.key else prefix, exc.reason) from None
    backend.check(settings, _failing(source, backend.name))
    return ConfiguredBackend(backend, settings, source)


def rebooter_from_config(fw: FirmwareSection, *, clock: Clock, source: str = "config") -> Rebooter:
    """`reboot_command`; empty: restart the agent in place for a backend whose updates need no
    reboot (the directory's "slots") and `systemctl reboot` for a real one. A backend may boot
    its trial slot only through its own command (tryboot: `reboot "0 tryboot"`)."""
    backend = configured_backend(fw, source=source)
    argv = fw.reboot_command or (["systemctl", "reboot"] if backend.backend.reboots else [])
    if not argv:
        return ExecRebooter()
    return CommandRebooter(argv, trial_argv=backend.trial_reboot_command(), clock=clock, settle_s=fw.reboot_timeout_s)


def _failing(source: str, name: str) -> Fail:
    def fail(key: str, reason: str) -> NoReturn:
        raise ConfigError(source, f"firmware.{name}.{key}", reason)

    return fail


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendSettings",
    "ConfiguredBackend",
    "Fail",
    "InstallerContext",
    "backend_named",
    "configured_backend",
    "rebooter_from_config",
]
