"""A part of a running agent: what `agent.app.assemble` builds, starts in order and stops in reverse.

    class Part(Protocol):
        name: str                              # "worker", "updater", "local API", ...
        async def start(self) -> None          # after every part before it started
        async def stop(self) -> None           # before every part before it stops
        def collectors(self) -> Collectors     # its /metrics families, by name
        def checks(self) -> Checks             # its /healthz checks, by name
        def liveness(self) -> Liveness         # what must restart the service when it names a problem

A feature is one factory beside its code, `async (agent, env) -> Part | None`: the role's agent
(already built, not started), and the role's environment (what the simulator swaps for hardware).
It returns None when the config leaves the feature off. What must be in place before messages
flow (routes, actors) the factory does; what runs (tasks, servers) `start` does.

A stage runs before the agent is built, `async (config, base, clock, env, starting) -> config |
None`: it gives the config the next stage and the assembly take (the settings in force laid over
the file's, the device's own certificate after its enrolment), or None when `starting.stopping`
was set while it waited.

`PartBase` gives the three read methods their empty defaults, so a part names only what it has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from agent.service.checks import Check
from agent.service.prom import Collector

if TYPE_CHECKING:
    from agent.core.clock import Clock
    from agent.core.config import AgentConfig

Collectors = Mapping[str, Collector]
Checks = Mapping[str, Check]
#: (problem, up): `problem()` is None while the part is alive (`/healthz` then says `up`); a text
#: names why the service must restart.
Liveness = Mapping[str, tuple[Callable[[], str | None], str]]


class Part(Protocol):
    @property
    def name(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def collectors(self) -> Collectors: ...

    def checks(self) -> Checks: ...

    def liveness(self) -> Liveness: ...


class PartBase:
    """Empty collectors, checks and liveness: a part overrides those it has."""

    def collectors(self) -> Collectors:
        return {}

    def checks(self) -> Checks:
        return {}

    def liveness(self) -> Liveness:
        return {}


H_contra = TypeVar("H_contra", contravariant=True)
E_contra = TypeVar("E_contra", contravariant=True)


class Feature(Protocol[H_contra, E_contra]):
    """The one signature of a feature's factory."""

    def __call__(self, agent: H_contra, env: E_contra, /) -> Awaitable[Part | None]: ...


def _nobody(config: AgentConfig) -> None:
    return None


@dataclass(frozen=True)
class Starting:
    """What the stages before an agent's assembly are told by whoever starts it."""

    stopping: asyncio.Event  # set: stop waiting (a device waiting for an operator's approval)
    # told first, with the config it enrols with, when a device must wait for its certificate (a
    # device waiting for an operator's approval is up, not failing to start)
    enrolling: Callable[[AgentConfig], None] = _nobody


class Stage(Protocol[E_contra]):
    """The one signature of a stage before the assembly."""

    def __call__(self, config: AgentConfig, base: Path, clock: Clock, env: E_contra, starting: Starting,
                 /) -> Awaitable[AgentConfig | None]: ...


__all__ = ["Checks", "Collectors", "Feature", "Liveness", "Part", "PartBase", "Stage", "Starting"]
