"""The built-in configuration target `agent`: the worker's own settings, changed by a config release.

A release named `agent` holds one document, `agent.toml`, with the settings a release may change
(`agent.core.config.REMOTE_SETTINGS`: `[agent] log_level`, `[heartbeat]`, `[classes.NAME]` TTL and
caps, `[sources.system]`); nothing that names a place, a key, a command or the broker. It is
checked in process against the config it will join (`with_remote_settings`), swapped in under the
data directory, and takes effect when the agent starts again: the applier asks the service for
that start (an in-process restart: the parts stop as at a shutdown, so the outbox keeps every
message, and start again on the new settings), and the confirm (connected, the leader answering)
runs in the new start, within what is left of `confirm_s`. Not confirmed: the old settings go
back and the agent starts once more on them.

`load_agent_settings` lays the settings in force over the config file's at every start; before
that it undoes an apply a SIGKILL cut short, so a start never runs on a half-made change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from agent.core.config import AgentConfig, ConfigTargetSection, with_remote_settings
from agent.core.errors import ConfigError, EdgeAgentError

log = logging.getLogger(__name__)

AGENT_TARGET = "agent"
DOCUMENT = "agent.toml"
CONFIRM_S = 120.0  # from the swap: the restart and the first answer of the leader fit in it
SETTLE_S = 10.0


def agent_target(data_dir: Path) -> ConfigTargetSection:
    return ConfigTargetSection(directory=str(data_dir / "config" / AGENT_TARGET / "settings"), documents=(DOCUMENT,),
                               mode="0600", confirm_s=CONFIRM_S, settle_s=SETTLE_S, max_document_kib=16)


def offers_agent_target(config: AgentConfig) -> bool:
    """A worker that takes releases of its own settings: `[agent] remote_settings` and the fleet's
    key (pinned, or its trust root)."""
    return config.agent.role == "worker" and config.agent.remote_settings and config.firmware.keyed


def settings_check(config: AgentConfig) -> Callable[[dict[str, bytes]], str]:
    """The in-process validation of a staged `agent.toml`: "" when `config` takes it."""

    def check(documents: dict[str, bytes]) -> str:
        try:
            with_remote_settings(config, documents.get(DOCUMENT, b""), DOCUMENT)
        except ConfigError as exc:
            return str(exc)
        return ""

    return check


async def load_agent_settings(config: AgentConfig, data_dir: Path) -> AgentConfig:
    """`config` with the settings in force laid over it (at the agent's start). An apply cut
    short is undone first (before its swap, or while it was being confirmed); a settings file
    this agent no longer takes is logged and left out: the config file's settings run."""
    if not offers_agent_target(config):
        return config
    from config_rollout.device.apply import ConfigApplier  # releases' code: only a worker that takes them

    target = agent_target(data_dir)
    applier = ConfigApplier(AGENT_TARGET, target, data_dir)
    try:
        j = applier.journal()
        if j.get("state") in ("staged", "swapping") or (j.get("state") == "applied" and not j.get("restarting")):
            result = await applier.resume()  # (no restart: the start under way loads what it left)
            if result is not None:
                log.warning("the agent's own settings: %s (%s)", result.state, result.detail)
        path = Path(target.directory) / DOCUMENT
        if not path.is_file():
            return config
        return with_remote_settings(config, path.read_bytes(), str(path))
    except (EdgeAgentError, OSError) as exc:
        log.error("the agent's own settings are left out: %s", exc)
        return config


__all__ = ["AGENT_TARGET", "DOCUMENT", "agent_target", "load_agent_settings", "offers_agent_target",
           "settings_check"]
