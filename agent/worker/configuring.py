"""The worker's configuration targets feature (its factory) and the stage that lays the settings in
force over the config file's, light to import. The feature and the configuration library load
only when the config declares `[config_targets]` (or offers the built-in target `agent`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from agent.worker.agent import WorkerAgent
from agent.worker.env import DeviceEnv

if TYPE_CHECKING:
    from pathlib import Path

    from agent.core.clock import Clock
    from agent.core.config import AgentConfig
    from agent.service.parts import Starting
    from agent.worker.config_targets import ConfigTargetsPart


async def settings_stage(config: AgentConfig, base: Path, clock: Clock, env: DeviceEnv,
                         starting: Starting) -> AgentConfig:
    """The stage before the worker's assembly: the settings in force (the last release of the
    built-in config target `agent`) laid over the config file's."""
    from config_rollout.device.agent_settings import load_agent_settings

    return await load_agent_settings(config, base)


async def config_targets_part(worker: WorkerAgent, env: DeviceEnv) -> ConfigTargetsPart | None:
    """Config offers applied to `[config_targets]` and to the built-in target `agent` (with
    `[firmware] public_key` to check each release); None when there is no target."""
    config = worker.config
    own_settings = config.agent.remote_settings and env.restart is not None  # the built-in target `agent`
    if not (config.config_targets or own_settings) or not config.firmware.keyed:
        return None
    from agent.worker.config_targets import ConfigTargetsPart
    from agent.worker.fleet_keys import fleet_keys

    part = ConfigTargetsPart(worker, await asyncio.to_thread(fleet_keys, worker), env.config_steps, env.restart)
    worker.kind_parts["config"] = part
    return part


__all__ = ["config_targets_part"]
