"""The idle worker as it runs: `edge-agent run` with the shipped worker config beside a leader, on
a real mosquitto, until its first heartbeat is on the broker and the leader has applied one.
Python's own import log (`-X importtime`) of that process names every module it loaded, from the
command line's first import to its stop; none may be on the deny list. What only an offer, a
renewal, an enrolment, a remote session or a scrape needs loads when that comes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import db_query, kill, wait_for
from mosquitto import Mosquitto

pytestmark = [pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]

#: Packages an idle worker must not load, and why each is deferred.
DENIED = {
    "cryptography": "signatures and certificates: an offer, a renewal or an enrolment",
    "psutil": "the process metrics of a scrape, or a host without /proc",
    "uvloop": "a worker runs asyncio's own loop",
    "rollout_engine": "an offer's signature and version checks",
    "firmware_rollout": "a firmware offer",
    "app_rollout": "an application offer",
    "release_rollout": "a release offer",
    "config_rollout.device.apply": "a configuration offer",
    "config_rollout.release": "a configuration offer",
    "agent.remote": "a remote session, on a device whose [remote] turns one on",
    "agent.worker.remote": "a remote session",
    "agent.identity.authority": "the leader's fleet CA",
    "agent.identity.certificates": "an enrolment or a renewal",
    "agent.sim": "the simulator",
    "agent.transport.memory": "the simulator's in-memory broker",
    "rich": "the operator's CLI",
    "h11": "the local API's first connection",
    "httpx": "a firmware download from a mirror",
    "psycopg": "a leader on PostgreSQL",
}


def imported(stderr: str) -> set[str]:
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    return names


def test_an_idle_worker_process_loads_nothing_on_the_deny_list(tmp_path: Path, mosquitto: Mosquitto) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    leader_conf = tmp_path / "leader.toml"
    leader_conf.write_text((REPO / "configs" / "leader.toml").read_text().replace(
        'listen = "127.0.0.1:9100"', 'listen = ""'))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    heard = threading.Event()
    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watcher", protocol=mqtt.MQTTv5)
    watcher.on_message = lambda client, userdata, message: heard.set()
    watcher.on_connect = lambda client, userdata, flags, reason, props: client.subscribe("ea/v1/default/pi-0001/up")
    watcher.connect("127.0.0.1", mosquitto.port)
    watcher.loop_start()
    leader = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(leader_conf), "--broker", url,
                               "--data-dir", str(tmp_path / "leader")], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    worker_err = tmp_path / "worker.err"
    with open(worker_err, "wb") as err:
        worker = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "agent.cli", "run", "--config",
                                   str(REPO / "configs" / "worker.toml"), "--broker", url,
                                   "--data-dir", str(tmp_path / "worker")], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
    try:
        wait_for(heard.is_set, "the worker's first message on the broker")
        wait_for(lambda: (tmp_path / "leader" / "leader.db").exists() and db_query(
            tmp_path / "leader" / "leader.db", "SELECT 1 FROM devices WHERE device_id = 'pi-0001'"),
            "the leader's record of the worker's heartbeat")
        assert worker.poll() is None, worker_err.read_text()[-3000:]
    finally:
        watcher.loop_stop()
        code = kill(worker, signal.SIGTERM)
        kill(leader, signal.SIGTERM)
    text = worker_err.read_text()
    assert code == 0, text[-3000:]
    names = imported(text)
    assert "agent.worker.agent" in names and "agent.transport.mqtt" in names  # it did run
    loaded = {name: why for name, why in DENIED.items()
              if any(n == name or n.startswith(name + ".") for n in names)}
    assert not loaded, f"an idle worker loaded what it defers: {loaded}"
