"""What a worker takes from where it runs: a real device's defaults, or the simulator's stand-ins.

`agent.app.assemble` hands it to the worker and to every feature factory of the worker's parts
(`agent.service.parts.Feature`); a field left at its default is what `edge-agent run` uses on a
device. The simulator swaps the hardware (installer, health check, reboot: `updater_hardware`),
shares outbox files between devices (`stores`) and runs its own jobs.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.core.config import AgentConfig
from agent.outbox.store import OutboxStore
from agent.transport.base import Transport
from agent.worker.actors import JobHandler
from agent.worker.jobs import JobLedger

if TYPE_CHECKING:  # the updater's types load only with the updater
    from agent.worker.agent import WorkerAgent
    from agent.worker.hardware import UpdaterHardware
    from app_rollout.device.module import AppHelperPort, Fetch


@dataclass(frozen=True, kw_only=True)
class SharedStores:
    """Stores opened by someone else and shared with other devices (the simulator's files): the
    worker owns none of them, runs no relay of its own and does not keep them pruned."""

    outbox: OutboxStore
    ledger: JobLedger
    incarnation: int


#: Told each step of a configuration target's apply: (the worker, the target, the step).
ConfigSteps = Callable[["WorkerAgent", str, str], None]


@dataclass(frozen=True, kw_only=True)
class DeviceEnv:
    rng: random.Random | None = None  # the worker's ids, boot id and jitter (the simulator's is seeded)
    sample_system: bool = True  # psutil's reading of this host on heartbeats and the system source
    job_handler: JobHandler | None = None  # default: `default_job_handler`
    stores: SharedStores | None = None  # default: the worker opens its own under the data dir
    # False: the local API listens on no socket; its applications call it in this process
    # (`LocalApi.serve`: the simulator's, 10,000 devices need no 10,000 sockets)
    api_sockets: bool = True
    # the installer, health check and reboot of this device (default: what `[firmware]` names)
    updater_hardware: Callable[[WorkerAgent], UpdaterHardware] | None = None
    # told each step of a config apply (worker, target, step): the simulator's network faults
    config_steps: ConfigSteps | None = None
    # asks the service to start the agent again on its settings (`edge-agent run`'s in-process
    # restart): the built-in config target `agent` is offered only with it
    restart: Callable[[], None] | None = None
    # the application helper of this device and how it fetches a bundle (default: the root helper
    # at `[apps] helper_socket`, the mirrors over HTTP); the simulator's run in its process
    apps_hardware: Callable[[WorkerAgent], tuple[AppHelperPort, Fetch]] | None = None
    # what the device says it is in its heartbeats (default: `agent.worker.facts.device_facts`)
    facts: Callable[[], dict[str, str]] | None = None
    # the connection an enrolment asks on, given the config and its client id (default: the
    # broker's enrolment listener, `[identity] claim_url`; the simulator's: its in-memory broker)
    claim_transport: Callable[[AgentConfig, str], Transport] | None = None
    # a failed update's report carries the lines of this process's log and of the journal that
    # explain it (the simulator's devices share one process and no journal: none)
    failure_logs: bool = True


__all__ = ["ConfigSteps", "DeviceEnv", "SharedStores"]
