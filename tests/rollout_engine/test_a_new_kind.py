"""A new rollout kind takes one module, one line of the leader's table and one worker part
(`file_kind.py`: a kind that writes a file on each device), and the engine runs it as it runs
firmware and configuration: the real orchestrator of a real leader rolls it out in waves to real
workers over mosquitto; a wave whose devices fail aborts the rollout before its next wave is
offered; an operator's cancel reaches the devices waiting for their maintenance window, under the
kind's own cancel name, and each reports `canceled`. A report under the name agents not updated
yet send it by (`firmware.report`) is still taken."""

from __future__ import annotations

import datetime
import json
import random
import sys
from pathlib import Path

import pytest
from file_kind import FILE, SUFFIX, FileKind, FilePart
from mosquitto import Mosquitto

from agent.app import make_transport
from agent.core.clock import SystemClock
from agent.core.codec import encode
from agent.leader.agent import LeaderAgent
from agent.leader.env import GatewayEnv
from agent.leader.rollout import RolloutService, rollout_part
from agent.leader.rollout_kinds import ROLLOUT_KINDS, KindEntry
from agent.outbox.types import OutboxMessage
from agent.worker.actors import LEADER
from agent.worker.agent import WorkerAgent
from firmware_rollout.messages import KIND_UPDATE_REPORT
from rollout_engine.keys import SigningKey
from rollout_engine.messages import RolloutReport
from rollout_engine.spec import StartControl, spec_from_dict
from rollout_engine.store import TERMINAL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e.agent_support import config, until, worker

pytestmark = [pytest.mark.mqtt, pytest.mark.timeout(300)]
KEY = SigningKey.generate().public  # the fleet's key the devices pin (this kind signs nothing)
NAMES = tuple(f"w{i}" for i in range(6))
BROKEN = ("w4", "w5")  # their files/ is a file: a write there fails


def release(tmp: Path, version: str, content: str) -> Path:
    path = tmp / f"motd-{version}{SUFFIX}"
    path.write_text(json.dumps({"name": "motd", "version": version, "content": content}))
    return path


def written(tmp: Path, name: str) -> str | None:
    path = tmp / name / "files" / "motd"
    return path.read_text() if path.is_file() else None


async def test_a_new_kind_rolls_out_in_waves_aborts_on_failures_and_is_canceled(tmp_path: Path,
                                                                                mosquitto: Mosquitto) -> None:
    clock = SystemClock()
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    kinds = {**ROLLOUT_KINDS, FILE.name: KindEntry(FILE, FileKind)}  # the one table line
    cfg = config("leader", "gw", artifacts={"listen": ""})
    leader = await LeaderAgent.open(cfg, transport=make_transport(cfg, clock=clock, broker_url=url,
                                                                  rng=random.Random(1)),
                                    clock=clock, data_dir=tmp_path / "gw", rng=random.Random(1))
    service: RolloutService = await rollout_part(leader, GatewayEnv(rollout_poll_s=0.2, rollout_kinds=kinds))
    await leader.start()
    await service.start()
    workers: list[WorkerAgent] = []
    parts: list[FilePart] = []
    orchestrator, store = service.orchestrator, service.store
    try:
        for name in NAMES:
            agent = await worker(clock, tmp_path, name, url=url, start=False)
            if name in BROKEN:
                (tmp_path / name).mkdir(parents=True, exist_ok=True)
                (tmp_path / name / "files").write_text("not a directory")
            part = FilePart(agent, KEY)  # the one part
            await agent.start()
            await part.start()
            workers.append(agent)
            parts.append(part)
        await until(clock, lambda: leader.registry.counts()[0] == len(NAMES), limit_s=60, what="all registered")

        def states(rid: str) -> dict[str, str]:
            return {d.device_id: d.state for d in store.devices(rid)}

        def finished(rid: str) -> bool:
            r = store.get(rid)
            return r is not None and not r.active and all(s in TERMINAL for s in states(rid).values())

        # waves: a canary, then 1, then 2 devices; every good device writes the file
        good = [n for n in NAMES if n not in BROKEN]
        spec = spec_from_dict({"rollout": {"name": "motd", "kind": "file",
                                           "artifact": str(release(tmp_path, "1.0.0", "hello\n"))},
                               "targets": {"select": "devices", "devices": good},
                               "waves": {"canary": 1, "counts": [1, 2]}, "device": {"timeout_s": 60.0}})
        await orchestrator.start_rollout(spec, rollout_id="motd-1")
        await until(clock, lambda: finished("motd-1"), limit_s=120, what="motd-1 finished")
        r = store.get("motd-1")
        assert r is not None and r.state == "succeeded", [(d.device_id, d.state, d.detail)
                                                          for d in store.devices("motd-1")]
        assert [(w.state, len(store.devices("motd-1", wave=w.idx))) for w in store.waves("motd-1")] == [
            ("passed", 1), ("passed", 1), ("passed", 2)]
        assert states("motd-1") == dict.fromkeys(good, "succeeded")
        assert [written(tmp_path, n) for n in good] == ["hello\n"] * 4

        # a failure threshold: the first wave's two devices fail, and the rollout aborts before
        # its second wave is offered
        spec = spec_from_dict({"rollout": {"name": "motd", "kind": "file",
                                           "artifact": str(release(tmp_path, "1.1.0", "bye\n"))},
                               "waves": {"counts": [2, 4]},
                               "device": {"timeout_s": 60.0, "retries": 0},
                               "gates": {"failure_threshold_pct": 50.0, "min_finished": 2}})
        start = StartControl(spec=spec, waves=[list(BROKEN), good]).to_json().decode()
        assert await orchestrator.control("motd-2", "start", start) == "started motd-2"
        await until(clock, lambda: finished("motd-2"), limit_s=120, what="motd-2 finished")
        r = store.get("motd-2")
        assert r is not None and r.state == "aborted", r
        devices = {d.device_id: d for d in store.devices("motd-2")}
        assert {n: (devices[n].state, devices[n].offers) for n in NAMES} == {
            **{n: ("failed", 1) for n in BROKEN}, **{n: ("canceled", 0) for n in good}}
        assert devices["w4"].detail == "cannot write motd: File exists", devices["w4"].detail
        assert [written(tmp_path, n) for n in good] == ["hello\n"] * 4  # never offered 1.1.0

        # a cancel: the devices wait for a window an hour away; the operator cancels, each
        # device drops the offer and says so
        opens = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        window = f"{opens:%H:%M}-{opens + datetime.timedelta(minutes=30):%H:%M}"
        spec = spec_from_dict({"rollout": {"name": "motd", "kind": "file",
                                           "artifact": str(release(tmp_path, "1.2.0", "later\n"))},
                               "targets": {"select": "devices", "devices": good},
                               "waves": {"counts": [4]},
                               "device": {"timeout_s": 60.0, "maintenance_windows": [window]}})
        await orchestrator.start_rollout(spec, rollout_id="motd-3")
        await until(clock, lambda: set(states("motd-3").values()) == {"waiting_window"}, limit_s=120,
                    what="every device waiting for its window")
        assert await orchestrator.control("motd-3", "cancel") == "canceled motd-3"
        await until(clock, lambda: finished("motd-3"), limit_s=120, what="motd-3 canceled on the devices")
        devices = {d.device_id: d for d in store.devices("motd-3")}
        assert {n: d.state for n, d in devices.items()} == dict.fromkeys(good, "canceled")
        assert all(d.detail == "canceled while waiting for its maintenance window: canceled by operator"
                   for d in devices.values()), [d.detail for d in devices.values()]
        assert [written(tmp_path, n) for n in good] == ["hello\n"] * 4

        # an agent not updated yet reports under the older name, "firmware.report": still taken
        w0 = workers[0]
        old = RolloutReport(device="w0", rollout_id="motd-3", version="1.2.0", state="canceled", phase="canceled",
                            detail="said by an agent not updated yet", ts_ms=clock.now_ms(),
                            seq=devices["w0"].report_seq + 1)
        await w0.outbox.enqueue(OutboxMessage(msg_id=w0.ids.next(), owner="w0", receiver=LEADER,
                                              kind=KIND_UPDATE_REPORT, payload=encode(old)))

        def heard() -> bool:
            row = store.device("motd-3", "w0")
            return row is not None and row.detail == "said by an agent not updated yet"

        await until(clock, heard, limit_s=60, what="the report under its older name applied")
    finally:
        for agent in workers:
            await agent.stop()
        await service.stop()
        await leader.stop()
