"""The built-in target `agent`: a release of the worker's own settings. Only the settings a
release may change are taken, each checked as the config file's own; it takes effect at the
agent's next start, which the apply asks for, and is confirmed there or reverted (and the agent
asked to start once more); an apply cut short is undone before a start loads it."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from agent.core.config import AgentConfig, convert, with_remote_settings
from agent.core.errors import ConfigError
from config_rollout.device.agent_settings import AGENT_TARGET, agent_target, load_agent_settings, settings_check
from config_rollout.device.apply import ConfigApplier
from config_rollout.release import build_release, parse_release
from rollout_engine.keys import SigningKey

KEY = SigningKey.generate()
GOOD = b'[heartbeat]\ninterval_s = 7.0\n[agent]\nlog_level = "DEBUG"\n[classes.telemetry]\nttl_s = 3600\n'


def worker(tmp: Path) -> AgentConfig:
    return convert({"agent": {"device_id": "pi-1", "data_dir": str(tmp)}, "firmware": {"public_key": "k.pem"},
                    "sources": {"system": {"interval_s": 60}}}, AgentConfig, source="test")


def release(tmp: Path, version: str, text: bytes) -> bytes:
    src = tmp / f"src-{version}"
    src.mkdir()
    (src / "agent.toml").write_bytes(text)
    return build_release("agent", version, [src / "agent.toml"], KEY, created_ms=1)


def test_only_the_settings_a_release_may_change_are_taken() -> None:
    config = worker(Path("/tmp"))
    changed = with_remote_settings(config, GOOD + b"[sources.system]\ninterval_s = 5\n", "agent.toml")
    assert (changed.heartbeat.interval_s, changed.agent.log_level, changed.classes["telemetry"].ttl_s,
            changed.sources.system.interval_s if changed.sources.system else None) == (7.0, "DEBUG", 3600.0, 5.0)
    assert changed.agent.device_id == "pi-1" and changed.classes["events"] == config.classes["events"]
    for text, said in ((b'[mqtt]\nurl = "mqtt://evil:1883"\n', "agent.toml: mqtt: not a setting a release may"),
                       (b'[agent]\ndevice_id = "x"\n', "agent.toml: agent.device_id: not a setting a release may"),
                       (b"[heartbeat]\ninterval_s = -1\n", "heartbeat"),
                       (b"[classes.nope]\nttl_s = 1\n", "classes.nope: no such class"),
                       (b'[sources]\ncommand = {x = {command = ["sh"]}}\n', "sources: not a setting"),
                       (b"[classes.telemetry]\nmax_payload_bytes = 1000\nmax_bytes = 10\n",
                        "max_payload_bytes: must not exceed max_bytes"),
                       (b"not toml [", "not valid TOML")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            with_remote_settings(config, text, "agent.toml")
    assert settings_check(config)({"agent.toml": b'[mqtt]\nurl = "x"\n'}).startswith("agent.toml: mqtt")


async def test_it_takes_effect_at_the_next_start_and_is_confirmed_there(tmp_path: Path) -> None:
    config = worker(tmp_path)
    starts: list[str] = []
    target = msgspec.structs.replace(agent_target(tmp_path), settle_s=0.0)

    async def fine() -> str:
        return ""

    applier = ConfigApplier(AGENT_TARGET, target, tmp_path, restarts=lambda: starts.append("start"),
                            check=settings_check(config), confirm=fine)
    result = await applier.apply(parse_release(release(tmp_path, "1.0.0", GOOD), KEY.public),
                                 context={"rollout_id": "own-1", "version": "1.0.0"})
    assert (result.state, starts) == ("restarting", ["start"])
    assert (await load_agent_settings(config, tmp_path)).heartbeat.interval_s == 7.0  # the start runs it
    after = ConfigApplier(AGENT_TARGET, target, tmp_path, restarts=lambda: starts.append("start"), confirm=fine)
    resumed = await after.resume()
    assert resumed is not None and resumed.state == "committed" and after.status().version == "1.0.0"
    assert after.take_unreported() == ({"rollout_id": "own-1", "version": "1.0.0"}, resumed)
    assert after.take_unreported() is None and starts == ["start"]


async def test_not_confirmed_in_the_new_start_it_reverts_and_starts_once_more(tmp_path: Path) -> None:
    config = worker(tmp_path)
    starts: list[str] = []
    target = msgspec.structs.replace(agent_target(tmp_path), confirm_s=1.0, settle_s=0.0)

    async def cut_off() -> str:
        return "the broker connection is down"

    first = ConfigApplier(AGENT_TARGET, target, tmp_path, restarts=lambda: starts.append("start"))
    assert (await first.apply(parse_release(release(tmp_path, "1.0.0", GOOD), KEY.public))).state == "restarting"
    second = ConfigApplier(AGENT_TARGET, target, tmp_path, restarts=lambda: starts.append("start"), confirm=cut_off)
    resumed = await second.resume()
    assert resumed is not None and resumed.state == "rolled_back" and "the broker connection is down" in resumed.detail
    assert starts == ["start", "start"]  # once to apply it, once more for the old settings
    assert not (Path(target.directory) / "agent.toml").exists()  # nothing was there before: nothing is
    assert (await load_agent_settings(config, tmp_path)).heartbeat.interval_s == config.heartbeat.interval_s


async def test_an_apply_cut_short_is_undone_before_a_start_loads_it(tmp_path: Path) -> None:
    config = worker(tmp_path)
    target = agent_target(tmp_path)
    applier = ConfigApplier(AGENT_TARGET, target, tmp_path, restarts=lambda: None)
    assert (await applier.apply(parse_release(release(tmp_path, "1.0.0", GOOD), KEY.public))).state == "restarting"
    applier._record(restarting=False)  # the start under way was SIGKILLed while it confirmed
    loaded = await load_agent_settings(config, tmp_path)
    assert loaded.heartbeat.interval_s == config.heartbeat.interval_s and applier.status().state == "rolled_back"
    assert not (Path(target.directory) / "agent.toml").exists()
