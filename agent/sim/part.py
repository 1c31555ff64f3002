"""Which part of a simulated fleet one process runs.

A fleet spread over `processes` processes puts the leader in process 0, and gives every process
the same CPU to spend: the leader costs a share of what all the devices cost together
(`leader_load`), so process 0 runs fewer devices beside it, and none once that share reaches
what one process can carry. The share depends on what the devices send (`scripts/bench_sim.py`,
10,000 devices for an hour on 2 processes): at 5 s heartbeats and telemetry every 30 s the leader
cost 0.34 of the devices' CPU, at the shipped 300 s heartbeats with the same telemetry 0.71; so
a heartbeat costs the leader about 0.27 of what it costs its device (coalesced in its mailbox,
written in batches), a telemetry record about 0.75 (deduplicated and written one by one). The
devices go in blocks of consecutive numbers. The same options and process count always give
the same split.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

# The leader's CPU against the CPU of all the devices it serves (5 s heartbeats, 30 s telemetry).
LEADER_LOAD = 0.34
# ... per kind of message: what one costs the leader against what it costs its device
HEARTBEAT_LOAD = 0.27
TELEMETRY_LOAD = 0.75


def leader_load(heartbeat_s: float, telemetry_s: float) -> float:
    """The leader's share for devices that heartbeat every `heartbeat_s` and send telemetry every
    `telemetry_s` (0: none): the two loads weighted by how many of each message there are."""
    beats = 1.0 / heartbeat_s
    records = 1.0 / telemetry_s if telemetry_s > 0 else 0.0
    return (HEARTBEAT_LOAD * beats + TELEMETRY_LOAD * records) / (beats + records)


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


def split(devices: int, processes: int, *, load: float = LEADER_LOAD) -> list[FleetPart]:
    """The parts of a fleet of `devices` over `processes` processes, the leader costing `load`
    of what the devices cost (`leader_load`)."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if processes == 1:
        return [FleetPart(rank=0, processes=1, indices=range(devices))]
    # process 0: leader + f0 of the devices; the others (1 - f0) / (processes - 1) each; equal when
    # LEADER_LOAD + f0 = (1 - f0) / (processes - 1)
    first = max(0.0, (1.0 - (processes - 1) * load) / processes)
    shares = [first] + [(1.0 - first) / (processes - 1)] * (processes - 1)
    bounds = [0]
    acc = 0.0
    for share in shares:
        acc += share
        bounds.append(min(devices, round(devices * acc)))
    bounds[-1] = devices
    return [FleetPart(rank=r, processes=processes, indices=range(bounds[r], bounds[r + 1])) for r in range(processes)]


__all__ = ["HEARTBEAT_LOAD", "LEADER_LOAD", "TELEMETRY_LOAD", "FleetPart", "available_cores", "leader_load", "split"]
