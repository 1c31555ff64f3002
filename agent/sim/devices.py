"""What a simulated device swaps for its hardware: the installer, the health check and the reboot.

A simulated device runs the real `WorkerAgent` with the real updater, assembled as `edge-agent
run` assembles it (`agent.app.assemble`): its SQLite state, A/B slot directories
(`DirectoryInstaller`), signature and chunk checks, and the commit or revert after the trial
boot. Only three seams are injected, each as a device's fate decides:

* the installer: `DirectoryInstaller` under the device's state dir, or one whose slot write
  fails (`install_fails`);
* the health check: connected to the broker, unless the new image is broken (`health_fails`);
* the reboot: `InProcessRebooter`, so the updater actor "boots" the new slot by opening the
  updater again.

`sim_hardware` hands the three to the updater's part (`agent.worker.env.DeviceEnv.updater_hardware`).

A `silent` device runs no updater at all (a device without a pinned firmware key): it refuses
every offer and never reports, and the leader times it out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from agent.core.clock import Clock
from agent.core.gate import Gate
from agent.sim.apps import SimApps
from agent.worker.agent import WorkerAgent
from agent.worker.hardware import InProcessRebooter, OpenUpdater, UpdaterHardware
from firmware_rollout.device.health import HealthResult
from firmware_rollout.device.slots import DirectoryInstaller
from firmware_rollout.device.updater import ReportSink, Updater, UpdaterSettings
from firmware_rollout.errors import InstallError
from rollout_engine.keys import VerifyKey, load_verify_key


@dataclass(frozen=True)
class DeviceFate:
    health_fails: bool = False
    install_fails: bool = False
    silent: bool = False

    @property
    def failing(self) -> bool:
        return self.health_fails or self.install_fails or self.silent


@dataclass(frozen=True)
class SimConfigTargets:
    """A fleet whose devices each declare `[config_targets.app]` (their documents under their
    own folder, `etc/app/app.toml`); the devices of `cuts` lose their uplink once a release is
    applied to it (the config cuts them off: their confirm cannot pass) until it is reverted."""

    confirm_s: float = 60.0
    settle_s: float = 5.0
    cuts: frozenset[str] = frozenset()
    factory: bytes = b"mode = 'factory'\n"  # what every device's app.toml holds at the start


def default_updater_settings() -> UpdaterSettings:
    return UpdaterSettings(health_timeout_s=30.0, fetch_timeout_s=30.0, fetch_backoff_base_s=1.0,
                           fetch_backoff_cap_s=30.0)


@dataclass(frozen=True, kw_only=True)
class SimFirmware:
    """The firmware side of a simulated fleet: the pinned key (the file every device's and the
    leader's `[firmware] public_key` names), the version every device starts on, and the fate of
    named devices (every other device is healthy)."""

    public_key: Path
    base_version: str = "1.0.0"
    fates: dict[str, DeviceFate] = field(default_factory=dict)
    settings: UpdaterSettings = field(default_factory=default_updater_settings)
    config_targets: SimConfigTargets | None = None  # the key signs config releases for these too
    apps: SimApps | None = None  # and application bundles for these

    def fate(self, device: str) -> DeviceFate:
        return self.fates.get(device, HEALTHY)

    @functools.cached_property
    def verify_key(self) -> VerifyKey:
        """The pinned key, read once for the whole fleet."""
        return load_verify_key(self.public_key)


HEALTHY = DeviceFate()


class SimHealth:
    """Passes when the device is connected, unless its fate says the new image is broken."""

    def __init__(self, fate: DeviceFate, connected: Gate) -> None:
        self._fate = fate
        self._connected = connected

    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        if self._fate.health_fails:
            return HealthResult(False, "service did not come up on the new image (simulated)")
        if not self._connected.is_open:
            return HealthResult(False, "broker not reached")
        return HealthResult(True, "connected")


class FailingInstaller(DirectoryInstaller):
    """Slot directories whose write always fails (a worn-out SD card)."""

    async def write_chunk(self, slot: str, index: int, data: bytes) -> None:
        raise InstallError(f"cannot write slot {slot}: simulated flash failure")


def sim_hardware(firmware: SimFirmware, worker: WorkerAgent, *, state_dir: Path) -> UpdaterHardware:
    """The simulated device's hardware: its installer and health check as its fate decides, and
    an in-process reboot; maintenance windows on UTC."""
    rebooter = InProcessRebooter()
    opener = sim_updater(firmware, device=worker.device_id, state_dir=state_dir, clock=worker.clock,
                         connected=worker.transport.connected, rebooter=rebooter)
    return UpdaterHardware(open_updater=opener, rebooter=rebooter, utc_offset_s=_utc)


def _utc() -> float:
    """Simulated devices keep UTC as their local time (maintenance windows are device-local)."""
    return 0.0


def sim_updater(firmware: SimFirmware, *, device: str, state_dir: Path, clock: Clock, connected: Gate,
                rebooter: InProcessRebooter) -> OpenUpdater:
    """How the simulated device `device` opens its updater (at every simulated boot)."""
    fate = firmware.fate(device)

    async def open_updater(sink: ReportSink) -> Updater:
        installer = FailingInstaller(state_dir / "slots", clock=clock) if fate.install_fails else None
        return await Updater.open(
            state_dir, device_id=device, verify_key=firmware.verify_key, clock=clock,
            health=SimHealth(fate, connected), rebooter=rebooter, installer=installer,
            initial_version=firmware.base_version, settings=firmware.settings, on_report=sink)

    return open_updater


__all__ = ["HEALTHY", "DeviceFate", "FailingInstaller", "SimConfigTargets", "SimFirmware", "SimHealth",
           "default_updater_settings", "sim_hardware", "sim_updater"]
