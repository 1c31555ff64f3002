"""The worker's updater feature: its factory, light to import. The updater and the firmware
library load only when `[firmware]` pins a key (the import-budget test in `tests/service` says so)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.worker.agent import WorkerAgent
from agent.worker.env import DeviceEnv

if TYPE_CHECKING:
    from agent.worker.updater_actor import UpdaterPart


async def updater_part(worker: WorkerAgent, env: DeviceEnv) -> UpdaterPart | None:
    """The updater as `[firmware]` configures it, on the environment's hardware (the simulator's)
    or on the device's own (`device_hardware`); None when no public key is pinned."""
    if not worker.config.firmware.keyed:
        return None
    from agent.worker.updater_actor import UpdaterPart, device_hardware

    hardware = env.updater_hardware(worker) if env.updater_hardware is not None else device_hardware(worker)
    part = worker.kind_parts["firmware"] = UpdaterPart(worker, hardware)  # (its installer: at the first open)
    return part


__all__ = ["updater_part"]
