"""Which part of a simulated fleet one process runs.

A fleet spread over `processes` processes puts the leader in process 0 with a smaller share of the
devices (the leader costs about as much CPU as a third of the fleet's devices), and divides the
rest evenly, in blocks of consecutive device numbers. The same device count and process count
always give the same split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The share of the devices the leader's process runs beside the leader, against 1 for the others.
LEADER_PROCESS_WEIGHT = 0.45


@dataclass(frozen=True, slots=True)
class FleetPart:
    rank: int  # this process, 0 = the leader's
    processes: int
    indices: Sequence[int]  # the device numbers run here

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def scoped(self, name: str) -> str:
        """`name` for a random generator of this process's own (as it is with one process)."""
        return name if self.processes == 1 else f"{name}@{self.rank}"


def split(devices: int, processes: int) -> list[FleetPart]:
    """The parts of a fleet of `devices` over `processes` processes."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if processes == 1:
        return [FleetPart(rank=0, processes=1, indices=range(devices))]
    weights = [LEADER_PROCESS_WEIGHT] + [1.0] * (processes - 1)
    total = sum(weights)
    bounds = [0]
    acc = 0.0
    for w in weights:
        acc += w
        bounds.append(round(devices * acc / total))
    bounds[-1] = devices
    return [FleetPart(rank=r, processes=processes, indices=range(bounds[r], bounds[r + 1])) for r in range(processes)]


__all__ = ["LEADER_PROCESS_WEIGHT", "FleetPart", "split"]
