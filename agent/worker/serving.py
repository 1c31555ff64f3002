"""A worker's front door, built from its config: the local API and the built-in sources.

`edge-agent run` attaches both after building the agent; the simulator and the tests that use
`WorkerAgent` alone attach neither (the intake, `WorkerAgent.messages`, is there either way).
"""

from __future__ import annotations

from pathlib import Path

from agent.core.config import AgentConfig, local_api_socket
from agent.telemetry import SystemSampler
from agent.worker.agent import WORKER_DB, WorkerAgent
from agent.worker.local_api import LocalApi
from agent.worker.sources import CommandSource, FileSource, Source, SourceOffsets, Sources, SystemSource


def attach_local_api(agent: WorkerAgent, config: AgentConfig, base: Path) -> LocalApi | None:
    """The local API the config asks for (not started), or None when `[local_api] enabled = false`."""
    api = config.local_api
    if not api.enabled:
        return None
    return LocalApi(agent.messages, agent.message_status, clock=agent.clock,
                    socket_path=local_api_socket(config, data_dir=base), group=api.group, listen=api.listen,
                    max_body_bytes=api.max_body_bytes, max_batch=api.max_batch, max_connections=api.max_connections)


def attach_sources(agent: WorkerAgent, config: AgentConfig, base: Path) -> Sources:
    """The configured sources (not started); none configured is an empty set."""
    s = config.sources
    found: list[Source] = []
    if s.system is not None:
        sample = agent.sampler if agent.sampler is not None else SystemSampler(base, clock=agent.clock).sample
        found.append(SystemSource(agent.messages, s.system, clock=agent.clock, sample=sample))
    for name, command in sorted(s.command.items()):
        found.append(CommandSource(name, agent.messages, command, clock=agent.clock))
    offsets = SourceOffsets.open(base / WORKER_DB) if s.file else None
    for name, tail in sorted(s.file.items()):
        assert offsets is not None
        found.append(FileSource(name, agent.messages, tail, clock=agent.clock, offsets=offsets,
                                device_id=agent.device_id))
    return Sources(found, offsets)


__all__ = ["attach_local_api", "attach_sources"]
