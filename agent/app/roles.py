"""The roles, their stages and their parts. `prepare`: the config an agent is assembled on;
`assemble`: that config, a transport, a clock, a data directory and an environment -> an `App`.

    config = await prepare(config, clock=clock, base=base, starting=Starting(stopping=stop))
    app = await assemble(config, transport=transport, clock=clock, base=Path("/var/lib/edge-agent"))

Each role has its stages before the assembly (`agent.service.parts.Stage`), run in order, each
on the config the one before gave:

    worker:  the settings in force (a release of the built-in target `agent`), its enrolment
             (a device with `[identity]` and no usable certificate waits for one)
    leader:  none

Each role has one list of parts; its own agent stands in it where it starts (`AGENT`), every
other entry is a feature's factory (`agent.service.parts.Feature`), which returns None when the
config leaves the feature off:

    worker:  the worker, the certificate's renewal, the updater, the configuration targets, the
             applications, the releases (the three together), the local API, the sources
    leader:  northbound forwarding, the leader, device identities, rollouts

Parts start in list order and stop in reverse: the local API and the sources stop taking
messages before the worker stops; the leader stops before northbound forwarding, so what it
took is queued for the cloud first; rollouts stop before the leader. `edge-agent run` and the
simulator both prepare and assemble their agents here; the simulator's environment swaps the hardware
(`DeviceEnv`, `GatewayEnv`). Each role imports only its own modules: a worker never loads the
leader's, and the updater's factory loads the firmware library only when it is on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agent.app.app import AgentPart, App
from agent.core.clock import Clock
from agent.core.config import AgentConfig
from agent.service.parts import Feature, Part, Stage, Starting
from agent.transport.base import Transport

if TYPE_CHECKING:
    from agent.leader.agent import LeaderAgent
    from agent.leader.env import GatewayEnv
    from agent.worker.agent import WorkerAgent
    from agent.worker.env import DeviceEnv


@dataclass(frozen=True)
class AppEnv:
    """What the agent takes from where it runs, per role (None: a real device's or gateway's)."""

    device: DeviceEnv | None = None
    gateway: GatewayEnv | None = None


AGENT = "agent"  # where a role's own agent stands in its list of parts


async def prepare(config: AgentConfig, *, clock: Clock, base: Path, starting: Starting,
                  env: AppEnv | None = None) -> AgentConfig | None:
    """The config the role's agent is assembled on: its stages run in order; None when
    `starting.stopping` was set while one waited."""
    return await _ROLES[config.agent.role].prepare(config, base, clock, env or AppEnv(), starting)


async def assemble(config: AgentConfig, *, transport: Transport, clock: Clock, base: Path,
                   env: AppEnv | None = None) -> App[Any]:
    """Open the role's agent under `base` and build its parts, none started."""
    return await _ROLES[config.agent.role].build(config, transport, clock, base, env or AppEnv())


async def _worker_stages(config: AgentConfig, base: Path, clock: Clock, env: AppEnv,
                         starting: Starting) -> AgentConfig | None:
    from agent.worker.configuring import settings_stage
    from agent.worker.env import DeviceEnv
    from agent.worker.identity import enrolment_stage

    return await _staged(config, base, clock, env.device or DeviceEnv(), starting, (settings_stage, enrolment_stage))


async def _leader_stages(config: AgentConfig, base: Path, clock: Clock, env: AppEnv,
                         starting: Starting) -> AgentConfig | None:
    return config


async def _staged(config: AgentConfig, base: Path, clock: Clock, env: E, starting: Starting,
                  stages: Sequence[Stage[E]]) -> AgentConfig | None:
    for stage in stages:
        running = await stage(config, base, clock, env, starting)
        if running is None:
            return None
        config = running
    return config


async def _worker(config: AgentConfig, transport: Transport, clock: Clock, base: Path, env: AppEnv) -> App[Any]:
    from agent.worker.apps import apps_part
    from agent.worker.configuring import config_targets_part
    from agent.worker.env import DeviceEnv
    from agent.worker.releasing import release_part
    from agent.worker.remoting import remote_part
    from agent.worker.renewal import identity_part
    from agent.worker.serving import local_api_part, sources_part
    from agent.worker.updating import updater_part

    device = env.device or DeviceEnv()
    agent = await _open_worker(config, transport, clock, base, device)
    if device.facts is not None:
        agent.device_facts = device.facts
    if device.failure_logs:
        from agent.worker.failure_logs import FailureLogs

        agent.failure_logs = FailureLogs(config)
    return await _parts(agent, device, (AGENT, identity_part, updater_part, config_targets_part, apps_part,
                                        release_part, local_api_part, sources_part, remote_part))


async def _open_worker(config: AgentConfig, transport: Transport, clock: Clock, base: Path,
                       env: DeviceEnv) -> WorkerAgent:
    from agent.worker.agent import WorkerAgent, WorkerOptions

    shared = env.stores
    if shared is None:
        options: WorkerOptions = {"rng": env.rng, "job_handler": env.job_handler}
        if not env.sample_system:
            options["sampler"] = None
        return await WorkerAgent.open(config, transport=transport, clock=clock, data_dir=base, **options)
    agent = WorkerAgent(config, transport=transport, clock=clock, outbox=shared.outbox, ledger=shared.ledger,
                        incarnation=shared.incarnation, owns_stores=False, rng=env.rng, sampler=None,
                        job_handler=env.job_handler, relay=False)
    agent.data_dir = base
    return agent


async def _leader(config: AgentConfig, transport: Transport, clock: Clock, base: Path, env: AppEnv) -> App[Any]:
    from agent.leader.agent import LeaderAgent
    from agent.leader.enrolment import identity_part
    from agent.leader.env import GatewayEnv
    from agent.leader.northbound import northbound_part
    from agent.leader.remote import remote_part
    from agent.leader.rollout import rollout_part

    gateway = env.gateway or GatewayEnv()
    agent: LeaderAgent = await LeaderAgent.open(config, transport=transport, clock=clock, data_dir=base,
                                                recover=gateway.recover, rng=gateway.rng,
                                                intake_batch_max=gateway.intake_batch_max)
    return await _parts(agent, gateway, (northbound_part, AGENT, identity_part, rollout_part, remote_part))


H = TypeVar("H", bound=AgentPart)
E = TypeVar("E")


async def _parts(agent: H, env: E, plan: Sequence[str | Feature[H, E]]) -> App[H]:
    """Build each feature of `plan` in order (the agent is built already); when one fails, what
    the others opened is closed again."""
    parts: list[Part] = []
    try:
        for entry in plan:
            if isinstance(entry, str):
                parts.append(agent)
                continue
            part = await entry(agent, env)
            if part is not None:
                parts.append(part)
    except BaseException:
        await App(agent, parts if agent in parts else [agent, *parts]).discard()  # the agent's stores too
        raise
    return App(agent, parts)


@dataclass(frozen=True)
class _Role:
    prepare: Callable[[AgentConfig, Path, Clock, AppEnv, Starting], Awaitable[AgentConfig | None]]
    build: Callable[[AgentConfig, Transport, Clock, Path, AppEnv], Awaitable[App[Any]]]


_ROLES: dict[str, _Role] = {
    "worker": _Role(_worker_stages, _worker),
    "leader": _Role(_leader_stages, _leader),
}


__all__ = ["AGENT", "AppEnv", "Starting", "assemble", "prepare"]
