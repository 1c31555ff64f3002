"""What the updater drives on its device: the seam between the updater and the hardware.

    UpdaterHardware(open_updater, rebooter, utc_offset_s, mirrors)

On a device the updater builds it from `[firmware]` (`agent.worker.updater_actor.device_hardware`:
the installer backend, the health check, the reboot command). The simulator and tests hand their
own through `agent.worker.env.DeviceEnv.updater_hardware`: an installer of slot directories, a
health check they decide, and `InProcessRebooter`. Light to import: the firmware library's types
are named here for the type checker only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from agent.worker.leader_watch import LeaderWatch
    from firmware_rollout.device.download import MirrorSettings
    from firmware_rollout.device.updater import ReportSink, Updater

log = logging.getLogger(__name__)


class OpenUpdater(Protocol):
    """Opens the device's updater at a boot (its installer and health check inside), reporting
    every state change to `sink`."""

    def __call__(self, sink: ReportSink, /) -> Awaitable[Updater]: ...


class InProcessRebooter:
    """A `Rebooter` that only records the request: the UpdaterActor opens the updater again
    (the simulated device "boots" its new slot)."""

    def __init__(self) -> None:
        self.requested = False
        self.count = 0

    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        self.requested = True
        self.count += 1
        log.debug("in-process reboot: %s", reason)


def system_utc_offset_s() -> float:
    """This machine's local time offset from UTC (maintenance windows are device-local)."""
    return float(time.localtime().tm_gmtoff)


@dataclass(frozen=True, kw_only=True)
class UpdaterHardware:
    """How the updater opens itself at every boot, the reboot (None: the updater reboots the
    device itself), the device's local time, and how downloads use HTTP(S) mirrors."""

    open_updater: OpenUpdater
    rebooter: InProcessRebooter | None = None
    utc_offset_s: Callable[[], float] = system_utc_offset_s
    mirrors: MirrorSettings | None = None
    leader_watch: LeaderWatch | None = None  # the leader's presence, for a trial boot (None: not watched)


__all__ = ["InProcessRebooter", "OpenUpdater", "UpdaterHardware", "system_utc_offset_s"]
