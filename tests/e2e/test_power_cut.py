"""Acknowledged means durable, through a power cut: `edge-agent run` with the shipped configs,
its data directory on a loop-mounted ext4 image, applications sending through the local API
as fast as they are answered; the agent is SIGKILLed and the image copied at that moment
(tests/disks.py). Every message answered 202 before the cut must be in the copy: on the
device (its outbox, offline) and on the gateway (leader.db, for the direct path's 202)."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disks import LoopDisk
from e2e.agent_support import FLEET, db_query, kill, run_agent, shipped_config, spawn_agent
from e2e.test_local_api_mqtt import api_status, wait_for
from mosquitto import Mosquitto, free_port

from agent.client import AgentUnavailable, Client, LocalApiError, Receipt
from agent.core.clock import SystemClock
from agent.outbox.store import OutboxStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APPS = 4  # application threads, each with its own connection


class Applications:
    """`APPS` threads sending numbered messages until stopped; `acked`: every receipt, in the
    order the answers came."""

    def __init__(self, sock: Path) -> None:
        self.acked: list[Receipt] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(sock, n), daemon=True) for n in range(APPS)]

    def __enter__(self) -> Applications:
        for t in self._threads:
            t.start()
        return self

    def _run(self, sock: Path, n: int) -> None:
        with Client(sock, timeout_s=60) as client:
            i = 0
            while not self._stop.is_set():
                try:
                    receipt = client.submit("telemetry", {"app": n, "i": i, "pad": "x" * 200})
                except (AgentUnavailable, LocalApiError):
                    return  # the agent is gone: what it acknowledged is counted
                with self._lock:
                    self.acked.append(receipt)
                i += 1

    def count(self, path: str | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.acked if path is None or r.path == path)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def ids_in(db: Path, sql: str) -> set[str]:
    conn = sqlite3.connect(db)  # a copy: SQLite may replay its WAL as at the next boot
    try:
        return {str(r[0]) for r in conn.execute(sql)}
    finally:
        conn.close()


def test_no_message_the_device_acknowledged_is_lost_to_a_power_cut(tmp_path: Path) -> None:
    with LoopDisk(tmp_path / "sd") as disk:
        sock = tmp_path / "api.sock"
        conf = shipped_config(tmp_path / "worker.toml", "worker.toml",
                              agent={"device_id": "pi-1", "data_dir": str(disk.root / "edge-agent")},
                              mqtt={"url": f"mqtt://127.0.0.1:{free_port()}"},  # no broker: all in the outbox
                              local_api={"socket": str(sock)})
        proc = run_agent(conf, tmp_path / "worker.log")
        try:
            wait_for(lambda: api_status(sock), "the worker's local API")
            with Applications(sock) as apps:
                wait_for(lambda: apps.count() >= 400, "400 acknowledged messages")
                kill(proc)
                copy = disk.cut()
        finally:
            kill(proc)
        root = disk.mount_copy(copy)
        held = ids_in(root / "edge-agent" / "outbox.db", "SELECT msg_id FROM outbox")
        missing = [r.id for r in apps.acked if r.id not in held]
        assert not missing, f"{len(missing)} of {len(apps.acked)} acknowledged messages lost in the cut"
        # and the agent, started on what the cut left, finds nothing lost (its mark agrees)
        restarted = asyncio.run(_reopen(root / "edge-agent" / "outbox.db"))
        assert restarted == (None, None)


async def _reopen(db: Path) -> tuple[str | None, str | None]:
    store = await OutboxStore.open(db, clock=SystemClock())
    await store.close()
    return store.recovered_from, store.lost_from


def test_no_message_the_leader_acknowledged_is_lost_to_a_power_cut(tmp_path: Path) -> None:
    with Mosquitto(tmp_path / "broker") as broker, LoopDisk(tmp_path / "ssd") as disk:
        conf = shipped_config(tmp_path / "leader.toml", "leader.toml",
                              agent={"device_id": "gw", "fleet": FLEET, "data_dir": str(disk.root / "edge-agent")},
                              mqtt={"url": broker.url}, metrics={"listen": ""},
                              artifacts={"listen": f"127.0.0.1:{free_port()}"})
        leader = run_agent(conf, tmp_path / "leader.log")
        worker = spawn_agent(tmp_path, "worker", "pi-1", broker.url, classes={"telemetry": {"mode": "append"}},
                             agent={"data_dir": str(tmp_path / "pi-1")})
        sock = tmp_path / "pi-1" / "api.sock"
        try:
            # the leader takes the worker's messages (it applied a heartbeat): the first ones go direct
            wait_for(lambda: db_query(disk.root / "edge-agent" / "leader.db",
                                      "SELECT 1 FROM devices WHERE device_id = 'pi-1'"), "the leader hears the worker")
            wait_for(lambda: (api_status(sock) or {}).get("connected"), "the worker connected")
            with Applications(sock) as apps:
                # the 202s of the direct path rest on leader.db alone
                wait_for(lambda: apps.count("direct") >= 300, "300 messages acknowledged by the leader")
                kill(leader)
                copy = disk.cut()
        finally:
            kill(leader)
            kill(worker, signal.SIGTERM)
        root = disk.mount_copy(copy)
        held = ids_in(root / "edge-agent" / "leader.db", "SELECT msg_id FROM app_messages")
        direct = [r.id for r in apps.acked if r.path == "direct"]
        missing = [i for i in direct if i not in held]
        assert not missing, f"{len(missing)} of {len(direct)} messages the leader acknowledged lost in the cut"
