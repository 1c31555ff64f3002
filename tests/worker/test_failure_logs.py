"""The log lines a failed update's report carries (`agent.worker.failure_logs`, the offer runner's
`excerpt`): the agent's own lines since the update began and the journal of its units, the
device's own secrets (its broker password file) and secrets by shape taken out, the whole within
its bounds; a report that is not a failure carries none."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from agent.actors import ActorSystem
from agent.core.clock import VirtualClock
from agent.core.config import AgentConfig, load_config
from agent.core.errors import ConfigError
from agent.service.logs import RecentLog
from agent.worker import failure_logs
from agent.worker.failure_logs import EXCERPT_BYTES_MAX, FailureLogs, secret_literals
from rollout_engine.device import Facts, OfferRunner, Reporter, Resume
from rollout_engine.keys import SigningKey
from rollout_engine.messages import EXCERPT_LINE_MAX, EXCERPT_LINES_MAX, RolloutReport

PLANTED = "PLANTED-broker-pass-7731"


@pytest.fixture
def recent() -> Iterator[RecentLog]:
    ring = RecentLog()
    root = logging.getLogger()
    level = root.level
    root.addHandler(ring)
    root.setLevel(logging.INFO)
    try:
        yield ring
    finally:
        root.removeHandler(ring)
        root.setLevel(level)


def device_config(tmp_path: Path) -> AgentConfig:
    secret = tmp_path / "mqtt.pass"
    secret.write_text(PLANTED + "\n")
    path = tmp_path / "worker.toml"
    path.write_text(f'[agent]\nrole = "worker"\ndevice_id = "pi-1"\ndata_dir = "{tmp_path}"\n'
                    f'[mqtt]\nurl = "mqtt://127.0.0.1:1"\nusername = "pi-1"\npassword_file = "{secret}"\n')
    return load_config(path)


async def test_an_excerpt_is_the_agents_lines_since_the_update_began_without_its_secrets(
        tmp_path: Path, recent: RecentLog) -> None:
    logs = FailureLogs(device_config(tmp_path))
    log = logging.getLogger("agent.worker.config_targets")
    log.info("config app 1.2.0: applying")
    log.error("config app 1.2.0: health command exited 1: connecting with %s; password=hunter2", PLANTED)
    lines = await logs.excerpt(("no-such-unit-of-this-test.service", "bad/unit name"), 0)
    text = "\n".join(lines)
    assert "health command exited 1: connecting with [redacted]; password=[redacted]" in text, text
    assert "applying" in text and PLANTED not in text and "hunter2" not in text
    assert lines[0].startswith("-- journal: no-such-unit-of-this-test.service") or lines[0] == "-- edge-agent --"
    assert logs.redact(f"exited 1: {PLANTED}") == "exited 1: [redacted]"


async def test_an_excerpt_keeps_the_newest_lines_within_its_bounds(tmp_path: Path, recent: RecentLog) -> None:
    logs = FailureLogs(device_config(tmp_path), journal=False)
    log = logging.getLogger("agent.worker.apps")
    for n in range(1000):
        log.warning("line %d %s", n, "x" * 500)
    lines = await logs.excerpt((), 0)
    assert len(lines) <= EXCERPT_LINES_MAX and all(len(line) <= EXCERPT_LINE_MAX for line in lines)
    assert sum(len(line.encode()) + 1 for line in lines) <= EXCERPT_BYTES_MAX
    assert "line 999 " in lines[-1] and lines[0] == "-- edge-agent --"  # the newest, up to the failure


class Offer(msgspec.Struct, frozen=True):
    rollout_id: str
    version: str


class Failing:
    """A module whose apply fails, saying a secret in its detail."""

    offer_type = Offer

    def facts(self, offer: Offer) -> Facts:
        return Facts(offer.rollout_id, offer.version, (), b"", units=("edge-app-web.service",))

    def check(self, offer: Offer) -> str:
        return offer.version

    async def apply(self, offer: Offer, checked: str, report: Reporter) -> None:
        await report(offer.rollout_id, checked, "installing", "installing", "")
        await report(offer.rollout_id, checked, "rolled_back", "health", f"unhealthy: token={PLANTED}")

    async def resume(self, report: Reporter) -> None:
        return None


class Asked:
    def __init__(self) -> None:
        self.units: list[tuple[str, ...]] = []

    async def explain(self, detail: str, units: tuple[str, ...], since_ms: int) -> tuple[str, tuple[str, ...]]:
        self.units.append(units)
        return detail.replace(PLANTED, "[redacted]"), ("-- edge-agent --", "web: healthcheck failed")


async def test_a_failure_report_carries_the_excerpt_of_its_offers_units_and_a_redacted_detail(
        tmp_path: Path) -> None:
    clock = VirtualClock()
    sent: list[RolloutReport] = []
    asked = Asked()

    async def send(report: RolloutReport) -> None:
        sent.append(report)

    runner = OfferRunner(Failing(), device_id="pi-1", key=SigningKey.generate().public, clock=clock,
                         state_dir=tmp_path, send=send, excerpt=asked)
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(runner, name="offers")
        ref.tell(Resume())
        ref.tell(Offer("r1", "2.0.0"))
        await clock.advance(1)
    assert [(r.state, r.excerpt) for r in sent] == [
        ("installing", ()), ("rolled_back", ("-- edge-agent --", "web: healthcheck failed"))]
    assert asked.units == [("edge-app-web.service",)]
    assert PLANTED not in sent[1].detail and sent[1].detail == "unhealthy: token=[redacted]"


def test_a_targets_units_are_unit_names(tmp_path: Path) -> None:
    path = tmp_path / "worker.toml"
    path.write_text(f'[agent]\nrole = "worker"\ndevice_id = "pi-1"\ndata_dir = "{tmp_path}"\n'
                    f'[config_targets.app]\ndirectory = "{tmp_path}"\nunits = ["app.service", "../etc/x y"]\n')
    with pytest.raises(ConfigError, match=r"config_targets.*units"):
        load_config(path)


async def test_a_failures_detail_and_its_excerpt_read_the_devices_secrets_once(
        tmp_path: Path, recent: RecentLog, monkeypatch: pytest.MonkeyPatch) -> None:
    logs = FailureLogs(device_config(tmp_path), journal=False)
    reads: list[int] = []

    def counted(config: AgentConfig) -> list[str]:
        reads.append(1)
        return secret_literals(config)

    monkeypatch.setattr(failure_logs, "secret_literals", counted)
    logging.getLogger("agent.worker.apps").error("web 2.0.0 failed: token %s", PLANTED)
    detail, lines = await logs.explain(f"exited 1: {PLANTED}", (), 0)
    assert detail == "exited 1: [redacted]" and PLANTED not in "\n".join(lines) and "[redacted]" in lines[-1]
    assert len(reads) == 1
