"""The worker's releases feature: its factory, light to import. The release module and the
release library load only when the worker has a rollout kind's part to drive (the import-budget
test in `tests/service` says so)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.worker.agent import WorkerAgent
from agent.worker.env import DeviceEnv

if TYPE_CHECKING:
    from agent.worker.releases import ReleasesPart


async def release_part(worker: WorkerAgent, env: DeviceEnv) -> ReleasesPart | None:
    """Releases, when the worker has a rollout kind's part (firmware, config targets,
    applications) and the fleet's key; else None."""
    if not worker.kind_parts or not worker.config.firmware.keyed:
        return None
    from agent.core.tasks import in_thread
    from agent.worker.fleet_keys import fleet_keys
    from agent.worker.releases import ReleasesPart

    # (on the loop under the simulator's clock: its fleets start no thread work)
    return ReleasesPart(worker, await in_thread(worker.clock, fleet_keys, worker))


__all__ = ["release_part"]
