"""`edge-agent run` as systemd would run it: READY=1, /healthz and /metrics, SIGTERM -> exit 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mosquitto import Mosquitto, free_port
from promparse import parse
from svc_notify import NotifyListener

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_run_notifies_serves_health_and_metrics_and_stops_cleanly(
    tmp_path: Path, notify_socket: NotifyListener
) -> None:
    metrics_port = free_port()
    with Mosquitto(tmp_path / "broker") as broker:
        text = (REPO / "configs" / "worker.toml").read_text()
        text = text.replace('url = "mqtt://127.0.0.1:1883"', f'url = "{broker.url}"')
        text = text.replace('data_dir = "/var/lib/edge-agent"', f'data_dir = "{tmp_path / "data"}"')
        text = text.replace('listen = ""', f'listen = "127.0.0.1:{metrics_port}"')
        config = tmp_path / "agent.toml"
        config.write_text(text)
        env = {**os.environ, **notify_socket.env, "WATCHDOG_USEC": "2000000",
               "PYTHONPATH": str(REPO)}
        env.pop("WATCHDOG_PID", None)
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        try:
            notify_socket.wait_for("READY=1", timeout_s=60)
            base = f"http://127.0.0.1:{metrics_port}"
            deadline = time.monotonic() + 60  # the MQTT connection may follow READY=1
            status, body = fetch(base + "/healthz")
            while status != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
                status, body = fetch(base + "/healthz")
            assert status == 200, body
            assert b"actors" in body and b"all actors running" in body  # a stopped actor fails it
            status, body = fetch(base + "/metrics")
            assert status == 200
            families = parse(body.decode())
            assert "ea_outbox_pending" in families and "ea_outbox_enqueued_total" in families
            assert "ea_housekeeping_rounds_total" in families and "ea_housekeeping_errors_total" in families
            assert {labels["mailbox"] for labels, _ in families["ea_mailbox_depth"]["samples"]}
            assert families["process_resident_memory_bytes"]["samples"][0][1] > 0
            assert fetch(base + "/nothing")[0] == 404
            # WATCHDOG_USEC=2 s: the loop pings every second; wait for one before stopping.
            notify_socket.wait_for("WATCHDOG=1", timeout_s=10)
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, output
    rest = notify_socket.drain()
    assert any(m.startswith("STOPPING=1") for m in rest), rest
    assert 'msg="shutdown requested" by=SIGTERM' in output
    data = tmp_path / "data"
    databases = sorted(data.glob("*.db"))
    assert databases
    for db in databases:
        assert db.stat().st_mode & 0o077 == 0, db
        # SQLite removes the WAL when the last connection closes cleanly: the agent closed them
        assert not Path(f"{db}-wal").exists(), f"{db.name} was not closed"
    stats = asyncio.run(_outbox_stats(data / "outbox.db"))
    assert stats.conservation_ok
    assert stats.enqueued >= 1  # the first heartbeat went through the outbox


async def _outbox_stats(path: Path):
    from agent.core.clock import SystemClock
    from agent.outbox.store import OutboxStore

    store = await OutboxStore.open(path, clock=SystemClock())
    try:
        return await store.stats()
    finally:
        await store.close()
