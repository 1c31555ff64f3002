"""An `App`: a role's agent and its features, as parts started in order and stopped in reverse.

    app = await assemble(config, transport=transport, clock=clock, base=data_dir)
    await app.start()      # every part in list order; a part that fails stops those started
    ...
    await app.stop()       # every started part in reverse order

`edge-agent run` hands each part's stop to the service's shutdown sequence instead
(`stop_steps`), so each is a step of its own with its own timeout, and registers what the
parts gather (`collectors`, `checks`, `liveness`) with `/metrics` and `/healthz`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from agent.service.checks import Check
from agent.service.parts import Part
from agent.service.prom import Collector


class AgentPart(Part, Protocol):
    """A role's own agent (`WorkerAgent`, `LeaderAgent`): the first of its parts to be built."""

    def databases(self) -> list[Path]: ...


A = TypeVar("A", bound=AgentPart)


class App(Generic[A]):
    def __init__(self, agent: A, parts: Sequence[Part]) -> None:
        self.agent = agent  # the role's own agent, one of the parts
        self.parts = list(parts)
        self._started: list[Part] = []

    def part(self, name: str) -> Part | None:
        """The part called `name`, if the config turned it on."""
        return next((p for p in self.parts if p.name == name), None)

    async def start(self) -> None:
        for part in self.parts:
            if part in self._started:
                continue
            try:
                await part.start()
            except BaseException:
                await self.stop()
                raise
            self._started.append(part)

    async def stop(self) -> None:
        for _, stop in self.stop_steps():
            await stop()

    async def discard(self) -> None:
        """Stop every part, started or not, last first: what the factories opened is closed
        again when the app cannot be built or started at all."""
        self._started = list(self.parts)
        await self.stop()

    def stop_steps(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """("stop NAME", stop) for every part, last part first; each stops its part only if it
        started (a part that never started has nothing to undo)."""
        return [(f"stop {part.name}", self._stopper(part)) for part in reversed(self.parts)]

    def _stopper(self, part: Part) -> Callable[[], Awaitable[None]]:
        async def stop() -> None:
            if part in self._started:
                self._started.remove(part)
                await part.stop()

        return stop

    def collectors(self) -> list[tuple[str, Collector]]:
        return [item for part in self.parts for item in part.collectors().items()]

    def checks(self) -> list[tuple[str, Check]]:
        return [item for part in self.parts for item in part.checks().items()]

    def liveness(self) -> list[tuple[str, Callable[[], str | None], str]]:
        return [(name, problem, up) for part in self.parts for name, (problem, up) in part.liveness().items()]

    def databases(self) -> list[Path]:
        """The SQLite files the role's agent owns (kept private to the service's user)."""
        return self.agent.databases()


__all__ = ["AgentPart", "App"]
