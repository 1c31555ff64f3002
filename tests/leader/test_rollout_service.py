"""The rollout between the real agents: LeaderAgent + rollout service, WorkerAgents + UpdaterActor,
on the in-memory broker and a virtual clock. Offline devices stay queued; a report made while
offline waits in the worker's outbox and arrives after reconnection."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.app import make_transport
from agent.core.clock import Clock, VirtualClock
from agent.core.config import (
    AgentConfig,
    AgentSection,
    ArtifactsSection,
    FirmwareSection,
    HeartbeatSection,
    RelaySection,
)
from agent.leader.agent import LeaderAgent
from agent.leader.env import GatewayEnv
from agent.leader.rollout import RolloutService, rollout_part
from agent.transport.memory import MemoryBroker
from agent.worker.agent import WorkerAgent
from agent.worker.hardware import InProcessRebooter, UpdaterHardware
from agent.worker.updater_actor import UpdaterActor, UpdaterPart
from firmware_rollout.artifact.fixture import make_artifact
from firmware_rollout.device.health import HealthResult
from firmware_rollout.device.updater import ReportSink, Updater, UpdaterSettings
from rollout_engine.keys import load_verify_key
from rollout_engine.spec import spec_from_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e.agent_support import until


class GatedHealth:
    """Passes once the test lets it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()

    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        await self.release.wait()
        return HealthResult(True, "healthy")


def config(device: str, role: str, base: Path, *, public_key: str = "") -> AgentConfig:
    return AgentConfig(agent=AgentSection(device_id=device, role=role, fleet="t", data_dir=str(base / device)),  # type: ignore[arg-type]
                       heartbeat=HeartbeatSection(interval_s=5.0), relay=RelaySection(reconnect_jitter_s=0.0),
                       firmware=FirmwareSection(public_key=public_key), artifacts=ArtifactsSection(listen=""))


@dataclass
class Fleet:
    """A leader with the rollout service and workers with real updaters, on the in-memory broker."""

    clock: VirtualClock
    broker: MemoryBroker
    leader: LeaderAgent
    service: RolloutService
    workers: dict[str, WorkerAgent]
    actors: dict[str, UpdaterActor]
    health: dict[str, GatedHealth]

    async def stop(self) -> None:
        for worker in self.workers.values():
            await worker.stop()
        await self.service.stop()
        await self.leader.stop()


async def fleet(tmp_path: Path, public: Path, names: tuple[str, ...], *, released: bool = True,
                settings: UpdaterSettings | None = None) -> Fleet:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    key = load_verify_key(public)
    leader_cfg = config("gw", "leader", tmp_path, public_key=str(public))  # it checks what it rolls out
    leader = await LeaderAgent.open(leader_cfg, transport=make_transport(leader_cfg, clock=clock, memory_broker=broker),
                                    clock=clock)
    service = await rollout_part(leader, GatewayEnv(rollout_poll_s=1.0))
    await leader.start()
    await service.start()
    workers: dict[str, WorkerAgent] = {}
    actors: dict[str, UpdaterActor] = {}
    health = {name: GatedHealth() for name in names}
    for name in names:
        if released:
            health[name].release.set()
        cfg = config(name, "worker", tmp_path)
        worker = await WorkerAgent.open(cfg, transport=make_transport(cfg, clock=clock, memory_broker=broker),
                                        clock=clock, sampler=None)
        rebooter = InProcessRebooter()

        def opener(name: str = name, rebooter: InProcessRebooter = rebooter):
            async def open_updater(sink: ReportSink) -> Updater:
                return await Updater.open(tmp_path / name / "firmware", device_id=name, verify_key=key, clock=clock,
                                          health=health[name], rebooter=rebooter, initial_version="1.0.0",
                                          settings=settings, on_report=sink)
            return open_updater

        part = UpdaterPart(worker, UpdaterHardware(open_updater=opener(), rebooter=rebooter))
        await worker.start()
        await part.start()
        assert part.actor is not None
        actors[name] = part.actor
        workers[name] = worker
    await clock.advance(12)
    return Fleet(clock, broker, leader, service, workers, actors, health)


async def test_offline_devices_are_updated_when_they_return_and_offline_reports_arrive_later(tmp_path: Path) -> None:
    artifact, public = make_artifact(tmp_path, chunk_size=1024, size=5000)
    f = await fleet(tmp_path, public, ("w1", "w2"), settings=UpdaterSettings(health_timeout_s=600.0))
    clock, broker, leader, service, workers, actors, health = (f.clock, f.broker, f.leader, f.service, f.workers,
                                                               f.actors, f.health)
    try:
        assert leader.registry.counts() == (2, 0)
        broker.partition(workers["w2"].transport.client_id)  # w2 loses its uplink before the rollout
        await clock.advance(1)
        assert leader.registry.counts() == (1, 1)

        health["w1"].release.clear()  # w1 will wait in its health check
        spec = spec_from_dict({"rollout": {"name": "agents", "artifact": str(artifact)},
                               "waves": {"counts": [2]}, "device": {"timeout_s": 3600.0}})
        rid = await service.orchestrator.start_rollout(spec, rollout_id="r")
        store = service.store

        def state(device: str) -> str:
            row = store.device(rid, device)
            assert row is not None
            return row.state

        for _ in range(600):
            await clock.advance(0.5)
            updater = actors["w1"].updater
            if updater is not None and updater.status().state == "verifying_health":
                break
        assert state("w2") == "queued"  # offline: not offered
        assert state("w1") == "verifying"

        broker.partition(workers["w1"].transport.client_id)  # offline while it commits
        health["w1"].release.set()
        await clock.advance(30)
        assert actors["w1"].updater is not None and actors["w1"].updater.status().state == "committed"
        assert (await workers["w1"].outbox.stats()).pending >= 1  # the report waits in the outbox
        assert state("w1") == "verifying"

        broker.heal(workers["w1"].transport.client_id)
        broker.heal(workers["w2"].transport.client_id)
        for _ in range(300):
            await clock.advance(1)
            if state("w1") == state("w2") == "succeeded":
                break
        assert state("w1") == state("w2") == "succeeded"
        r = store.get(rid)
        assert r is not None and r.state == "succeeded"
        assert sorted(d for d, _, _ in store.offers(rid)) == ["w1", "w2"]
        assert actors["w1"].updater.active_version == actors["w2"].updater.active_version == "1.1.0"  # type: ignore[union-attr]
        await clock.advance(2)  # the next serving tick stores what the ConfigServers served
        served = store.serving(rid)
        assert served["chunks"] >= 2 * 5 and served["bytes"] >= 2 * 5000  # five 1 KiB chunks, two devices
        assert served["max_concurrent"] >= 1
        from rollout_engine.status import describe

        assert describe(store, rid)["serving"] == served  # what `rollout status` and the console show
        await clock.advance(12)  # the next heartbeats report the version each device now runs
        for name in ("w1", "w2"):
            record = leader.registry.device(name)
            assert record is not None and record.firmware_version == "1.1.0"
    finally:
        await f.stop()


async def test_a_cancel_mid_download_reaches_the_devices_and_none_installs_afterwards(tmp_path: Path) -> None:
    artifact, public = make_artifact(tmp_path, chunk_size=1024, size=40 * 1024)  # 40 chunks
    names = ("w1", "w2", "w3")
    f = await fleet(tmp_path, public, names)
    clock, leader, service, actors = f.clock, f.leader, f.service, f.actors
    try:
        assert leader.registry.counts() == (3, 0)
        # 1 KiB/s per server: a 40 KiB image takes the devices a while
        spec = spec_from_dict({"rollout": {"name": "slow", "artifact": str(artifact)}, "waves": {"counts": [3]},
                               "device": {"timeout_s": 3600.0},
                               "download": {"servers": 1, "rate_bytes_per_s": 1024}})
        rid = await service.orchestrator.start_rollout(spec, rollout_id="slow")
        store = service.store

        def chunks_done() -> list[int]:
            return [a.updater.status().chunks_done if a.updater is not None else 0 for a in actors.values()]

        for _ in range(600):
            await clock.advance(0.5)
            if sum(chunks_done()) >= 3:
                break
        assert 0 < sum(chunks_done()) < 3 * 40  # mid-download
        assert "canceled slow" == await service.orchestrator.control(rid, "cancel")
        for _ in range(600):
            await clock.advance(0.5)
            if all(a.updater is not None and a.updater.status().state == "canceled" for a in actors.values()):
                break
        for name, actor in actors.items():
            assert actor.updater is not None
            status = actor.updater.status()
            assert status.state == "canceled", (name, status)
            assert actor.updater.active_version == "1.0.0"  # nothing installed
            assert not (tmp_path / name / "firmware" / "staging.img").exists()  # what was staged is gone
        for _ in range(60):
            await clock.advance(1)
            if all(store.device(rid, n).state == "canceled" for n in names):  # type: ignore[union-attr]
                break
        from rollout_engine.status import describe

        view = describe(store, rid)
        assert view["state"] == "canceled" and view["cancel_pending"] == 0
        assert view["counts"] == {"canceled": 3}
        await clock.advance(120)  # nothing starts again: no offer after the cancel, no install
        assert all(a.updater is not None and a.updater.active_version == "1.0.0" for a in actors.values())
        assert all(a.updater is not None and a.updater.status().state == "canceled" for a in actors.values())
    finally:
        await f.stop()


async def test_a_download_only_rollout_installs_on_approval(tmp_path: Path) -> None:
    artifact, public = make_artifact(tmp_path, chunk_size=1024, size=8 * 1024)
    f = await fleet(tmp_path, public, ("w1", "w2"))
    clock, service, actors = f.clock, f.service, f.actors
    try:
        spec = spec_from_dict({"rollout": {"name": "stage", "artifact": str(artifact), "download_only": True},
                               "waves": {"counts": [2]}, "device": {"timeout_s": 60.0}})
        rid = await service.orchestrator.start_rollout(spec, rollout_id="stage")
        store = service.store
        for _ in range(400):
            await clock.advance(0.5)
            if all(store.device(rid, n).state == "downloaded" for n in ("w1", "w2")):  # type: ignore[union-attr]
                break
        wave = store.wave(rid, 0)
        assert wave is not None and wave.state == "awaiting_approval" and "downloaded" in wave.detail
        for name, actor in actors.items():
            assert actor.updater is not None and actor.updater.status().state == "staged"
            assert actor.updater.active_version == "1.0.0"
            slots = tmp_path / name / "firmware" / "slots"  # in the inactive slot, not armed
            assert json.loads((slots / "bootenv.json").read_text()) == {"default": "a", "trial": None}
        await clock.advance(300)  # waiting for the operator is not a timeout
        assert all(store.device(rid, n).state == "downloaded" for n in ("w1", "w2"))  # type: ignore[union-attr]
        served = store.serving(rid)["chunks"]
        result = await service.orchestrator.control(rid, "approve")
        assert "installs what 2 devices downloaded" in result
        for _ in range(400):
            await clock.advance(0.5)
            r = store.get(rid)
            if r is not None and r.state == "succeeded":
                break
        assert r is not None and r.state == "succeeded", r
        assert all(a.updater is not None and a.updater.active_version == "1.1.0" for a in actors.values())
        await clock.advance(2)
        assert store.serving(rid)["chunks"] == served  # the install downloaded nothing again
    finally:
        await f.stop()


async def test_the_artifact_server_serves_what_a_rollout_admitted_and_a_taken_port_does_not_stop_the_leader(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A taken artifact port is one ERROR line and an unhealthy check, not a leader that refuses
    to start: the rollouts run (devices download over MQTT and their mirrors), and the server
    listens once the port is free."""
    import socket

    import httpx
    import msgspec

    from agent.core.config import ArtifactsSection
    from agent.leader.rollout import HTTP_RETRY_S
    from firmware_rollout.artifact.files import read_signed_manifest

    artifact, public = make_artifact(tmp_path, size=50_000, chunk_size=4096)
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    base = config("gw", "leader", tmp_path, public_key=str(public))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    busy_cfg = msgspec.structs.replace(base, artifacts=ArtifactsSection(listen=f"127.0.0.1:{port}"))
    leader = await LeaderAgent.open(busy_cfg, transport=make_transport(busy_cfg, clock=clock, memory_broker=broker),
                                    clock=clock)
    taking = await rollout_part(leader, GatewayEnv(rollout_poll_s=1.0))
    try:
        await taking.start()  # it leads all the same
        assert await taking.checks()["rollout orchestrator"]() == (True, "running")
        check = taking.checks()["artifact server"]
        ok, detail = await check()
        assert not ok and f"cannot listen on 127.0.0.1:{port}" in detail and "trying again" in detail
        assert taking.http is None and not taking.orchestrator.own_mirror  # offers name no leader mirror
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "artifacts.listen" in r.getMessage()]
        assert len(errors) == 1 and errors[0].exc_info is None
        await clock.advance(HTTP_RETRY_S)  # still taken: still unhealthy, nothing more logged
        assert not (await check())[0]
        taken.close()
        await until(clock, lambda: taking.http is not None, step_s=HTTP_RETRY_S, what="the artifact server listening")
        assert await check() == (True, "listening")
        assert taking.orchestrator.own_mirror == f"http://127.0.0.1:{port}/artifacts"
        assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
    finally:
        taken.close()
        await taking.stop()
        await leader.stop()

    cfg = msgspec.structs.replace(base, artifacts=ArtifactsSection(listen="127.0.0.1:0"))
    leader = await LeaderAgent.open(cfg, transport=make_transport(cfg, clock=clock, memory_broker=broker), clock=clock)
    service = await rollout_part(leader, GatewayEnv(rollout_poll_s=1.0))
    await service.start()
    try:
        assert service.http is not None
        assert service.orchestrator.own_mirror == f"http://127.0.0.1:{service.http.port}/artifacts"
        spec = spec_from_dict({"rollout": {"name": "r", "artifact": str(artifact)}, "waves": {"counts": [1]}})
        await service.orchestrator.start_rollout(spec, rollout_id="r1", devices=["pi-1"])
        sha = read_signed_manifest(artifact).manifest.sha256.hex()
        async with httpx.AsyncClient() as client:
            got = await client.get(f"{service.orchestrator.own_mirror}/{sha}.eafw")
            unknown = await client.get(f"{service.orchestrator.own_mirror}/{'0' * 64}.eafw")
        assert got.status_code == 200 and got.content == artifact.read_bytes()  # the store's copy, same bytes
        assert unknown.status_code == 404
    finally:
        await service.stop()
        await leader.stop()
