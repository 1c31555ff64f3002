"""A worker's front door, built from its config: the local API and the built-in sources.

Two features of the worker's parts (`agent.app`), each off unless its config asks for it; the
intake they feed (`WorkerAgent.messages`) is there either way.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agent.core.config import local_api_socket
from agent.telemetry import SystemSampler
from agent.worker.agent import WORKER_DB, WorkerAgent
from agent.worker.env import DeviceEnv
from agent.worker.local_api import ConfigReader, LocalApi
from agent.worker.sources import CommandSource, FileSource, Source, SourceOffsets, Sources, SystemSource


async def local_api_part(agent: WorkerAgent, env: DeviceEnv) -> LocalApi | None:
    """The local API the config asks for (not started), or None when `[local_api] enabled = false`."""
    config = agent.config
    api = config.local_api
    if not api.enabled:
        return None
    sockets = env.api_sockets
    reviews = None
    if config.config_targets:
        from agent.worker.config_targets import config_reviews

        reviews = config_reviews(agent)
    # the socket where systemd's RUNTIME_DIRECTORY says; DATA_DIR/api.sock, where a client reading the
    # same config outside the unit looks, links to it
    pointer = local_api_socket(config, data_dir=agent.data_dir, env={}) if not api.socket else None
    return LocalApi(agent.messages, agent.message_status, clock=agent.clock, pointer=pointer,
                    socket_path=local_api_socket(config, data_dir=agent.data_dir) if sockets else None,
                    group=api.group, listen=api.listen if sockets else "", max_body_bytes=api.max_body_bytes,
                    max_batch=api.max_batch, max_connections=api.max_connections, configs=config_reader(agent),
                    reviews=reviews)


def config_reader(agent: WorkerAgent) -> ConfigReader | None:
    """What `GET /v1/config/NAME` reads: the applied release of each `[config_targets.NAME]`
    (None, and the library not loaded, when the config declares none)."""
    targets = agent.config.config_targets
    if not targets:
        return None
    from config_rollout.device.apply import ConfigApplier

    async def read(name: str) -> dict[str, Any] | None:
        target = targets.get(name)
        if target is None:
            return None
        return await asyncio.to_thread(ConfigApplier(name, target, agent.data_dir).view)

    return read


async def sources_part(agent: WorkerAgent, env: DeviceEnv) -> Sources | None:
    """The configured sources (not started), or None when none is configured."""
    s = agent.config.sources
    if s.system is None and not s.command and not s.file:
        return None
    base = agent.data_dir
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


__all__ = ["config_reader", "local_api_part", "sources_part"]
