"""Device applications through the local API, end to end: `edge-agent run` processes (a leader and
a worker) over a real mosquitto, the application on the worker's Unix socket; outages, SIGKILLs,
restarts; the northbound sink against a second mosquitto standing for the cloud."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from e2e.agent_support import REPO, db_query, kill, spawn_agent
from mosquitto import Mosquitto, free_port
from promparse import parse

from agent.client import AgentUnavailable, Client

pytestmark = [pytest.mark.mqtt, pytest.mark.slow, pytest.mark.timeout(300)]

CLASSES = {"telemetry": {"mode": "append"}, "events": {"mode": "append"}, "state": {"mode": "overwrite"}}


def wait_for(predicate: Callable[[], Any], what: str, limit_s: float = 120.0) -> Any:
    """Poll an event of another process (not a timing assumption: the limit only ends a hang)."""
    deadline = time.monotonic() + limit_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {limit_s}s")
        time.sleep(0.05)


def api_status(sock: Path) -> dict[str, Any] | None:
    try:
        with Client(sock, timeout_s=10) as client:
            return client.status()
    except AgentUnavailable:
        return None


def metrics(port: int) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return parse(response.read().decode())


def series(families: dict[str, dict[str, Any]], name: str, **labels: str) -> float:
    for found, value in families.get(name, {}).get("samples", []):
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0


def stored_ids(leader_db: Path) -> dict[str, int]:
    return {r[0]: r[1] for r in db_query(leader_db, "SELECT msg_id, count(*) FROM app_messages GROUP BY msg_id")}


class Agents:
    """A leader and a worker as `edge-agent run` processes, restartable."""

    def __init__(self, tmp: Path, url: str, *, worker_sections: dict[str, Any] | None = None,
                 leader_sections: dict[str, Any] | None = None) -> None:
        self.tmp = tmp
        self.url = url
        self.leader_port = free_port()
        self.worker_port = free_port()
        # (the data dir in the config too: `edge-agent send --config` finds the socket from it)
        self._worker_sections = {"classes": CLASSES, "metrics": {"listen": f"127.0.0.1:{self.worker_port}"},
                                 "agent": {"data_dir": str(tmp / "pi-1")}, **(worker_sections or {})}
        self._leader_sections = {"metrics": {"listen": f"127.0.0.1:{self.leader_port}"}, **(leader_sections or {})}
        self.leader: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        self.socket = tmp / "pi-1" / "api.sock"
        self.leader_db = tmp / "gw" / "leader.db"

    def start_leader(self) -> None:
        self.leader = spawn_agent(self.tmp, "leader", "gw", self.url, **self._leader_sections)
        wait_for(lambda: self._healthy(self.leader_port), "leader /metrics")

    def start_worker(self) -> None:
        self.worker = spawn_agent(self.tmp, "worker", "pi-1", self.url, **self._worker_sections)
        wait_for(lambda: api_status(self.socket), "the worker's local API")

    def worker_config(self) -> Path:
        return self.tmp / "pi-1.toml"

    @staticmethod
    def _healthy(port: int) -> bool:
        try:
            metrics(port)
            return True
        except OSError:
            return False

    def stop(self) -> None:
        for proc in (self.worker, self.leader):
            if proc is not None:
                kill(proc, signal.SIGTERM)

    def logs(self) -> str:
        return "\n".join((self.tmp / f"{n}.log").read_text(errors="replace")[-3000:] for n in ("gw", "pi-1")
                         if (self.tmp / f"{n}.log").exists())


def send_all(sock: Path, cls: str, tag: str, n: int, acked: list[str]) -> None:
    with Client(sock, timeout_s=60) as client:
        for i in range(n):
            acked.append(client.send(cls, {"tag": tag, "i": i}))


def test_every_acknowledged_message_reaches_the_leader_once_across_outage_kill_and_restart(tmp_path: Path) -> None:
    with Mosquitto(tmp_path / "broker") as broker:
        agents = Agents(tmp_path, broker.url)
        try:
            agents.start_leader()
            agents.start_worker()
            acked: list[str] = []
            send_all(agents.socket, "telemetry", "online", 10, acked)
            broker.stop()  # the broker goes away: the application goes on writing
            wait_for(lambda: (api_status(agents.socket) or {}).get("connected") is False, "worker offline")
            send_all(agents.socket, "telemetry", "outage", 10, acked)
            # the 10 of the outage, and any of the first 10 whose direct send found the leader slow
            held = (api_status(agents.socket) or {})["classes"]["telemetry"]["pending"]
            assert 10 <= held <= 20
            assert agents.worker is not None
            kill(agents.worker)  # SIGKILL with them in the outbox
            agents.start_worker()
            send_all(agents.socket, "telemetry", "after-kill", 10, acked)
            broker.start()
            assert agents.leader is not None
            kill(agents.leader, signal.SIGTERM)  # and the leader restarts while the outbox drains
            agents.start_leader()
            send_all(agents.socket, "telemetry", "after-leader-restart", 10, acked)
            wait_for(lambda: len(stored_ids(agents.leader_db)) >= len(acked), "every message stored")
            wait_for(lambda: (api_status(agents.socket) or {}).get("classes", {}).get("telemetry", {})
                     .get("pending") == 0, "the outbox drained")
            stored = stored_ids(agents.leader_db)
            assert sorted(stored) == sorted(acked), agents.logs()  # each acknowledged one, nothing else
            assert set(stored.values()) == {1}  # exactly once
            # the worker's figures since its restart obey the law, class by class
            fams = metrics(agents.worker_port)
            c = {name: series(fams, f"ea_messages_{name}_total", **{"class": "telemetry"}) for name in (
                "accepted", "direct", "stored", "delivered", "delivered_from_outbox", "enqueued", "dead_lettered",
                "expired", "dropped", "overwritten", "replayed")}
            pending = series(fams, "ea_messages_pending", **{"class": "telemetry"})
            at_start = series(fams, "ea_messages_pending_at_start", **{"class": "telemetry"})
            assert c["accepted"] == 20 == c["direct"] + c["stored"]
            assert c["enqueued"] == (c["delivered_from_outbox"] + c["dead_lettered"] + c["expired"] + c["dropped"]
                                     + c["overwritten"] + pending - at_start - c["replayed"])
            assert at_start == held and pending == 0  # those written before the SIGKILL were held, then sent
            assert c["delivered"] == c["direct"] + c["delivered_from_outbox"] == 20 + held
        finally:
            agents.stop()


def test_a_retry_after_the_worker_died_before_its_answer_is_stored_once(tmp_path: Path) -> None:
    """The worker is SIGKILLed once the leader has committed the message, before the application
    read an answer; the application sends it again, under its name, to the restarted worker."""
    with Mosquitto(tmp_path / "broker") as broker:
        # the retry must go straight to the leader: on a loaded machine a just-restarted worker's
        # first direct try may take longer than the default 5 s before it falls back to the outbox
        agents = Agents(tmp_path, broker.url, worker_sections={"local_api": {"direct_timeout_s": 60.0}})
        try:
            agents.start_leader()
            agents.start_worker()
            body = json.dumps({"class": "events", "payload": {"order": 4711}, "app_id": "order-4711"}).encode()
            app = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            app.connect(str(agents.socket))
            app.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            wait_for(lambda: stored_ids(agents.leader_db), "the leader committed the message")
            assert agents.worker is not None
            kill(agents.worker)  # the answer, if it was on its way, dies with the worker
            app.close()
            agents.start_worker()
            # connected, so the retry goes straight to the leader (offline it would wait in the
            # outbox, and the leader would drop the copy on delivery)
            wait_for(lambda: (api_status(agents.socket) or {}).get("connected"), "the worker connected again")
            with Client(agents.socket, timeout_s=60) as client:
                receipt = client.submit("events", {"order": 4711}, app_id="order-4711")
            assert (receipt.path, receipt.duplicate) == ("direct", True), agents.logs()
            assert stored_ids(agents.leader_db) == {receipt.id: 1}  # one row, the first copy's id
        finally:
            agents.stop()


def test_send_from_a_shell_and_the_counters_of_both_ends_agree(tmp_path: Path) -> None:
    with Mosquitto(tmp_path / "broker") as broker:
        agents = Agents(tmp_path, broker.url)
        try:
            agents.start_leader()
            agents.start_worker()
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            cli = [sys.executable, "-m", "agent.cli"]
            before = metrics(agents.worker_port)
            done = subprocess.run([*cli, "send", "telemetry", "--config", str(agents.worker_config()),
                                   "--json", '{"t": 21.5}'], capture_output=True, text=True, env=env, timeout=60)
            assert done.returncode == 0, done.stderr
            msg_id = done.stdout.strip()
            shown = subprocess.run([*cli, "messages", "--db", str(agents.leader_db), "--device", "pi-1", "--json"],
                                   capture_output=True, text=True, env=env, timeout=60)
            assert shown.returncode == 0, shown.stderr
            rows = [json.loads(line) for line in shown.stdout.splitlines()]
            assert [(r["msg_id"], r["class"], r["payload"]) for r in rows] == [(msg_id, "telemetry", {"t": 21.5})]
            after = metrics(agents.worker_port)
            for name in ("accepted", "delivered"):
                assert series(after, f"ea_messages_{name}_total", **{"class": "telemetry"}) == series(
                    before, f"ea_messages_{name}_total", **{"class": "telemetry"}) + 1
            # refusals: the exit status says which kind
            wrong = subprocess.run([*cli, "send", "nope", "--config", str(agents.worker_config()), "--json", "1"],
                                   capture_output=True, text=True, env=env, timeout=60)
            assert wrong.returncode == 2 and "no class 'nope'" in wrong.stderr
            gone = subprocess.run([*cli, "send", "telemetry", "--socket", str(tmp_path / "none.sock"), "--json", "1"],
                                  capture_output=True, text=True, env=env, timeout=60)
            assert gone.returncode == 4 and "no agent answers" in gone.stderr
            # an outage, then both ends add up: what the device accepted, the leader applied once
            acked: list[str] = []
            broker.stop()
            wait_for(lambda: (api_status(agents.socket) or {}).get("connected") is False, "worker offline")
            send_all(agents.socket, "events", "outage", 15, acked)
            with Client(agents.socket) as client:  # an overwrite class: only the newest of a key travels
                for door in ("open", "closed", "open"):
                    client.send("state", door, key="door")
            broker.start()
            wait_for(lambda: all(v.get("pending") == 0 for v in (api_status(agents.socket) or {"classes": {
                "x": {}}})["classes"].values()), "the outbox drained")
            device, gateway = metrics(agents.worker_port), metrics(agents.leader_port)
            for cls in CLASSES:
                n = {name: series(device, f"ea_messages_{name}_total", **{"class": cls})
                     for name in ("accepted", "delivered", "overwritten", "dropped", "expired", "dead_lettered")}
                applied = series(gateway, "ea_leader_messages_applied_total", **{"class": cls})
                # every accepted message was delivered or superseded, and what was delivered applied once
                assert n["accepted"] == n["delivered"] + n["overwritten"] + n["dropped"] + n["expired"] + n[
                    "dead_lettered"], (cls, n)
                assert n["delivered"] == applied, (cls, n, applied)
            assert series(device, "ea_messages_overwritten_total", **{"class": "state"}) >= 1
            assert series(device, "ea_messages_accepted_total", **{"class": "events"}) == 15
            assert series(gateway, "ea_leader_messages_rejected_total", **{"class": "events"}) == 0
        finally:
            agents.stop()


def test_a_file_source_neither_repeats_nor_skips_a_line_across_a_sigkill(tmp_path: Path) -> None:
    log = tmp_path / "app.jsonl"
    log.write_text("")

    def append(start: int, n: int) -> None:
        with open(log, "a") as f:
            for i in range(start, start + n):
                f.write(json.dumps({"line": i}) + "\n")

    def lines_stored() -> list[int]:
        rows = db_query(tmp_path / "gw" / "leader.db", "SELECT payload FROM app_messages WHERE class = 'events'")
        return sorted(json.loads(r[0])["line"] for r in rows)

    with Mosquitto(tmp_path / "broker") as broker:
        agents = Agents(tmp_path, broker.url, worker_sections={
            "sources": {"file": {"app": {"path": str(log), "class": "events", "poll_s": 0.05}}}})
        try:
            agents.start_leader()
            agents.start_worker()
            append(0, 200)
            wait_for(lambda: len(lines_stored()) >= 50, "the first lines stored")
            assert agents.worker is not None
            kill(agents.worker)  # SIGKILL while it reads the rest
            append(200, 100)
            agents.start_worker()
            append(300, 100)
            wait_for(lambda: len(lines_stored()) >= 400, "every line stored", limit_s=180)
            assert lines_stored() == list(range(400)), agents.logs()
        finally:
            agents.stop()


class CloudApp:
    """A consumer on the cloud broker with a persistent session: what the broker queued while it
    was away arrives when it connects again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.got: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self.client: mqtt.Client | None = None

    def _on_message(self, _client: object, _userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.got.append({"topic": message.topic, **json.loads(message.payload)})

    def connect(self, *, subscribe: bool) -> None:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self._connected.clear()
        # a new client each time (the session is the broker's, by client id)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="cloud-app", protocol=mqtt.MQTTv5)
        self.client.on_message = self._on_message
        self.client.on_connect = lambda *_: self._connected.set()
        self.client.connect("127.0.0.1", self.port, clean_start=False, properties=props)
        self.client.loop_start()
        assert self._connected.wait(30)
        if subscribe:
            _, mid = self.client.subscribe("cloud/#", qos=1)
            assert mid is not None

    def disconnect(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()

    def ids(self) -> set[str]:
        with self._lock:
            return {m["id"] for m in self.got}


def test_the_northbound_sink_keeps_everything_while_the_cloud_is_away(tmp_path: Path) -> None:
    with Mosquitto(tmp_path / "broker") as broker, \
            Mosquitto(tmp_path / "cloud", persistence=True) as cloud:
        agents = Agents(tmp_path, broker.url, leader_sections={
            "northbound": {"url": cloud.url, "topic": "cloud/{fleet}/{device}/{class}"}})
        app = CloudApp(cloud.port)
        try:
            app.connect(subscribe=True)
            agents.start_leader()
            agents.start_worker()
            acked: list[str] = []
            send_all(agents.socket, "telemetry", "cloud-up", 10, acked)
            wait_for(lambda: app.ids() >= set(acked), "forwarded while the cloud is there")
            app.disconnect()
            cloud.stop()  # the gateway is cut off from the cloud (its session and queue are saved)
            wait_for(lambda: series(metrics(agents.leader_port), "ea_northbound_connected") == 0, "cut off")
            send_all(agents.socket, "telemetry", "cloud-away", 20, acked)
            # the devices were answered: stored (a message the direct path missed comes by the outbox)
            wait_for(lambda: len(stored_ids(agents.leader_db)) == 30, "stored by the gateway")
            assert series(metrics(agents.leader_port), "ea_northbound_pending") == 20  # and kept for the cloud
            cloud.start()
            wait_for(lambda: series(metrics(agents.leader_port), "ea_northbound_pending") == 0, "queue drained")
            app.connect(subscribe=False)
            wait_for(lambda: app.ids() >= set(acked), "every message reached the cloud")
            assert app.ids() == set(acked)
            topics = {m["topic"] for m in app.got}
            assert topics == {"cloud/t/pi-1/telemetry"}
            assert {m["payload"]["tag"] for m in app.got} == {"cloud-up", "cloud-away"}
            gateway = metrics(agents.leader_port)
            assert series(gateway, "ea_leader_messages_forwarded_total", **{"class": "telemetry"}) == 30
        finally:
            with_errors = agents.logs()
            agents.stop()
            app.disconnect()
        assert "Traceback" not in with_errors, with_errors
