"""Which part of a simulated fleet one process runs.

A fleet spread over `processes` processes puts the leader in process 0, and gives every process
the same CPU to spend: the leader costs about a third of what all the devices cost together
(`LEADER_LOAD`, measured with `scripts/bench_sim.py`: 10,000 devices for an hour, 194 s of CPU
for the leader against 574 s for the devices), so process 0 runs fewer devices beside it, and
none from four processes on. The devices go in blocks of consecutive numbers. The same device
count and process count always give the same split.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

# The leader's CPU against the CPU of all the devices it serves.
LEADER_LOAD = 0.34


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


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def split(devices: int, processes: int) -> list[FleetPart]:
    """The parts of a fleet of `devices` over `processes` processes."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if processes == 1:
        return [FleetPart(rank=0, processes=1, indices=range(devices))]
    # process 0: leader + f0 of the devices; the others (1 - f0) / (processes - 1) each; equal when
    # LEADER_LOAD + f0 = (1 - f0) / (processes - 1)
    first = max(0.0, (1.0 - (processes - 1) * LEADER_LOAD) / processes)
    shares = [first] + [(1.0 - first) / (processes - 1)] * (processes - 1)
    bounds = [0]
    acc = 0.0
    for share in shares:
        acc += share
        bounds.append(min(devices, round(devices * acc)))
    bounds[-1] = devices
    return [FleetPart(rank=r, processes=processes, indices=range(bounds[r], bounds[r + 1])) for r in range(processes)]


__all__ = ["LEADER_LOAD", "FleetPart", "available_cores", "split"]
