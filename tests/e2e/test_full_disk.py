"""A full disk degrades the worker instead of stopping it: `edge-agent run` with the shipped
worker config, its data on a small tmpfs; the disk is filled and the worker SIGKILLed and
started again. It starts, serves its local API, answers 503 with Retry-After for what it cannot
store, says "disk full" on /healthz and in `doctor`, takes messages again once there is room,
makes its reserve anew, and delivers every message it acknowledged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disks import Tmpfs
from e2e.agent_support import FLEET, REPO, healthz, kill, run_agent, shipped_config, spawn_agent
from e2e.test_local_api_mqtt import api_status, stored_ids, wait_for
from mosquitto import Mosquitto, free_port

from agent.client import Client, LocalApiError

pytestmark = [pytest.mark.mqtt, pytest.mark.slow, pytest.mark.timeout(300)]


def disk_check(port: int) -> dict[str, Any]:
    return dict(healthz(port).get("checks", {}).get("disk", {}))


def test_a_worker_restarted_on_a_full_disk_answers_503_and_recovers(tmp_path: Path) -> None:
    broker_port, metrics_port = free_port(), free_port()
    sock = tmp_path / "api.sock"
    with Tmpfs(tmp_path / "sd", 80) as disk:  # room for the healthy minimum (64 MiB) once freed
        sd = disk.at
        conf = shipped_config(tmp_path / "worker.toml", "worker.toml",
                              agent={"device_id": "pi-1", "fleet": FLEET, "data_dir": str(sd / "edge-agent")},
                              mqtt={"url": f"mqtt://127.0.0.1:{broker_port}"},  # the broker comes at the end
                              local_api={"socket": str(sock)}, metrics={"listen": f"127.0.0.1:{metrics_port}"})
        acked: list[str] = []
        proc = run_agent(conf, tmp_path / "worker.log")
        try:
            wait_for(lambda: api_status(sock), "the worker's local API")
            with Client(sock) as client:
                acked += [client.send("events", {"before": i}) for i in range(50)]
            filler = disk.fill()
            kill(proc)
            proc = run_agent(conf, tmp_path / "worker.log")
            # it starts on the full disk (no crash loop) and serves
            wait_for(lambda: api_status(sock), "the local API of the worker restarted on a full disk")
            assert proc.poll() is None
            check = wait_for(lambda: disk_check(metrics_port), "the restarted worker's /healthz")
            assert check.get("ok") is False and str(check.get("detail", "")).startswith("disk full"), check
            doctor = subprocess.run([sys.executable, "-m", "agent.cli", "doctor", "--config", str(conf), "--skip",
                                     "clock", "--skip", "leader", "--json"], capture_output=True, text=True,
                                    timeout=120, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
            said = {c["check"]: c for c in json.loads(doctor.stdout)}
            assert doctor.returncode == 1 and str(said["disk"]["text"]).endswith(check["detail"]), doctor.stdout
            assert str(said["data dir"]["text"]).startswith("disk full"), doctor.stdout
            # what it cannot store is answered 503 with Retry-After; what it took is kept
            refused: LocalApiError | None = None
            with Client(sock) as client:
                for i in range(20_000):
                    try:
                        acked.append(client.send("events", {"full": i, "pad": "x" * 1000}))
                    except LocalApiError as exc:
                        refused = exc
                        break
            assert refused is not None and refused.status == 503 and refused.retry_after_s, refused
            # room again: it takes messages at once, and its reserve comes back by itself
            filler.unlink()
            with Client(sock) as client:
                acked += [client.send("events", {"after": i}) for i in range(50)]
            wait_for(lambda: disk_check(metrics_port).get("ok") is True, "the disk check healthy again")
            assert (sd / "edge-agent" / "disk-reserve").stat().st_size == 2 * 1024 * 1024
            # and every message it acknowledged reaches the leader
            with Mosquitto(tmp_path / "broker", port=broker_port) as broker:
                leader = spawn_agent(tmp_path, "leader", "gw", broker.url)
                try:
                    wait_for(lambda: len(stored_ids(tmp_path / "gw" / "leader.db")) >= len(acked),
                             "every acknowledged message stored by the leader")
                    assert set(stored_ids(tmp_path / "gw" / "leader.db")) == set(acked)
                finally:
                    kill(leader)
            assert "Traceback" not in (tmp_path / "worker.log").read_text()
        finally:
            kill(proc)


def test_a_leader_restarted_on_a_full_disk_leads_and_recovers(tmp_path: Path) -> None:
    metrics_port = free_port()
    with Mosquitto(tmp_path / "broker") as broker, Tmpfs(tmp_path / "ssd", 80) as disk:
        conf = shipped_config(tmp_path / "leader.toml", "leader.toml",
                              agent={"device_id": "gw", "fleet": FLEET, "data_dir": str(disk.at / "edge-agent")},
                              mqtt={"url": broker.url}, metrics={"listen": f"127.0.0.1:{metrics_port}"},
                              artifacts={"listen": f"127.0.0.1:{free_port()}"})
        leader = run_agent(conf, tmp_path / "leader.log")
        worker = None
        try:
            wait_for(lambda: disk_check(metrics_port), "the leader's /healthz")
            filler = disk.fill()
            kill(leader)
            leader = run_agent(conf, tmp_path / "leader.log")
            wait_for(lambda: str(disk_check(metrics_port).get("detail", "")).startswith("disk full"),
                     "the restarted leader saying 'disk full' on /healthz")
            worker = spawn_agent(tmp_path, "worker", "pi-1", broker.url, classes={"telemetry": {"mode": "append"}},
                                 agent={"data_dir": str(tmp_path / "pi-1")})
            sock = tmp_path / "pi-1" / "api.sock"
            wait_for(lambda: (api_status(sock) or {}).get("connected"), "the worker connected")
            with Client(sock) as client:
                acked = [client.send("telemetry", {"i": i, "pad": "x" * 500}) for i in range(300)]
            assert leader.poll() is None  # it leads on the full disk
            filler.unlink()
            db = disk.at / "edge-agent" / "leader.db"
            wait_for(lambda: set(acked) <= set(stored_ids(db)), "every acknowledged message stored by the leader")
            wait_for(lambda: disk_check(metrics_port).get("ok") is True, "the disk check healthy again")
            assert "Traceback" not in (tmp_path / "leader.log").read_text()
        finally:
            kill(leader)
            if worker is not None:
                kill(worker)
