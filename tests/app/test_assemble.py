"""`assemble`: one list of parts per role, started in order and stopped in reverse; a part that
fails to start stops the ones started; the config turns features on and off."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.app import App, AppEnv, assemble, make_transport
from agent.core.clock import VirtualClock
from agent.core.config import convert
from agent.core.errors import ConfigError
from agent.leader.env import GatewayEnv
from agent.service.parts import PartBase
from agent.transport.memory import MemoryBroker
from rollout_engine.keys import generate_keypair


class Recorded(PartBase):
    def __init__(self, name: str, log: list[str], *, fails: bool = False) -> None:
        self.name = name
        self._log = log
        self._fails = fails

    async def start(self) -> None:
        if self._fails:
            raise ConfigError("config", self.name, "cannot start")
        self._log.append(f"start {self.name}")

    async def stop(self) -> None:
        self._log.append(f"stop {self.name}")

    def databases(self) -> list[Path]:
        return []


async def test_parts_start_in_order_and_stop_in_reverse() -> None:
    log: list[str] = []
    a, b, c = (Recorded(n, log) for n in "abc")
    app = App(a, [a, b, c])
    await app.start()
    await app.stop()
    assert log == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]
    await app.stop()  # stopped parts are not stopped again
    assert len(log) == 6


async def test_a_part_that_fails_to_start_stops_the_started_ones_and_raises() -> None:
    log: list[str] = []
    a, b, c = Recorded("a", log), Recorded("b", log, fails=True), Recorded("c", log)
    app = App(a, [a, b, c])
    with pytest.raises(ConfigError, match="cannot start"):
        await app.start()
    assert log == ["start a", "stop a"]  # c never started, b did not start: neither is stopped
    assert [name for name, _ in app.stop_steps()] == ["stop c", "stop b", "stop a"]


async def test_the_config_turns_each_role_s_features_on_and_off(tmp_path: Path) -> None:
    from agent.core.config import AgentConfig

    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    keys = generate_keypair(tmp_path / "keys")

    def config(role: str, **sections: object) -> AgentConfig:
        return convert({"agent": {"device_id": f"{role}-1", "role": role, "fleet": "t", "data_dir": str(tmp_path)},
                        **sections}, AgentConfig, source="test")

    plain = config("worker", local_api={"enabled": False})
    app = await assemble(plain, transport=make_transport(plain, clock=clock, memory_broker=broker), clock=clock,
                         base=tmp_path / "plain")
    assert [p.name for p in app.parts] == ["worker"]
    await app.discard()

    full = config("worker", firmware={"public_key": str(keys.public)},
                  local_api={"socket": str(tmp_path / "api.sock")},
                  sources={"command": {"probe": {"command": ["true"]}}})
    app = await assemble(full, transport=make_transport(full, clock=clock, memory_broker=broker), clock=clock,
                         base=tmp_path / "full")
    assert [p.name for p in app.parts] == ["worker", "updater", "releases", "local API", "sources"]
    assert {name for name, _ in app.collectors()} >= {"relay", "mailbox", "outbox", "messages", "worker"}
    assert {name for name, _ in app.checks()} >= {"transport", "database", "disk", "relay"}
    assert [name for name, _, _ in app.liveness()] == ["actors"]
    assert [p.name for p in app.databases()] == ["outbox.db", "worker.db"]
    await app.discard()

    leader = config("leader", artifacts={"listen": ""})
    app = await assemble(leader, transport=make_transport(leader, clock=clock, memory_broker=broker), clock=clock,
                         base=tmp_path / "gw", env=AppEnv(gateway=GatewayEnv(rollout_poll_s=1.0)))
    assert [p.name for p in app.parts] == ["leader", "rollouts"]  # no [northbound] url: no forwarding
    await app.start()
    assert {name for name, _ in app.collectors()} >= {"rollouts", "jobs", "leader", "messages"}
    await app.stop()
