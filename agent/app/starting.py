"""What an agent starts on, each time `edge-agent run` (re)builds it: a worker's config with the
settings its own configuration releases set (`config_rollout.device.agent_settings`: an apply cut
short is undone first), then with its own certificate (`agent.worker.identity`: enrolling first,
until an operator approves it, when it has none)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from agent.core.clock import Clock
from agent.core.config import AgentConfig


async def starting_config(config: AgentConfig, base: Path, clock: Clock, *, stopping: asyncio.Event,
                          enrolling: Callable[[AgentConfig], None]) -> AgentConfig | None:
    """The config the role's agent is assembled on; None when `stopping` was set while the device
    waited for its certificate. `enrolling` is told first, with the config it enrols with (a
    device waiting for an operator's approval is up, not failing to start)."""
    if config.agent.role != "worker":
        return config
    from config_rollout.device.agent_settings import load_agent_settings

    running = await load_agent_settings(config, base)
    if running.identity is None:
        return running
    from agent.worker.identity import enrolled_config

    enrolling(running)
    return await enrolled_config(running, base, clock, stopping=stopping)


__all__ = ["starting_config"]
