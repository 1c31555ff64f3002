"""Hostile local clients against real agent processes (`edge-agent run` on a real mosquitto): one
application floods a worker's local API, one address floods a leader's artifact server. Each
holds no more than its own share: another application (another uid) and another device (another
address) are answered on their first attempt while the flood is held, bad input is a 400 with
its reason, and the agent logs no traceback and stays healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import REPO, kill, spawn_agent
from mosquitto import free_port
from otheruser import NOBODY, unix_status, unix_status_as

from agent.core.errors import StoreError
from agent.leader.readonly import open_leader_db
from firmware_rollout.artifact.files import read_signed_manifest
from firmware_rollout.artifact.fixture import make_artifact

pytestmark = [pytest.mark.mqtt, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the other application runs as another user")]

FLOOD = 300


def status_of(sock: socket.socket, request: bytes) -> int:
    sock.sendall(request)
    line = sock.makefile("rb").readline()
    return int(line.split(b" ", 2)[1]) if line.startswith(b"HTTP/1.1 ") else 0


def tcp_status(port: int, request: bytes, *, source: str = "127.0.0.1") -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as sock:
        return status_of(sock, request)


def until(what: str, predicate: object, proc: subprocess.Popen[bytes], log: Path, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():  # type: ignore[operator]
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{what} not reached within {limit_s}s"
        time.sleep(0.1)


def get(path: str, *, keep: bool = False, extra: str = "") -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}" + ("" if keep else "Connection: close\r\n")
            + "\r\n").encode()


def post_json(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def slow_heads(connect: object, n: int) -> list[socket.socket]:
    """`n` connections that each start a request head and stall: none may be closed to make room."""
    held = []
    for _ in range(n):
        try:
            sock = connect()  # type: ignore[operator]
        except OSError:
            continue
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        held.append(sock)
    return held


def test_one_application_flooding_the_local_api_starves_no_other(mosquitto, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                   open_dir: Path) -> None:
    """M3, L1, L2 on a worker process: 300 stalled requests and 40 kept-alive connections of one
    uid; another application's request is answered at once; deep nesting, a lone surrogate and
    NaN are 400 with the reason; /healthz stays 200 and the log has no traceback."""
    api = open_dir / "api.sock"
    port = free_port()
    proc = spawn_agent(tmp_path, "worker", "pi-1", mosquitto.url, local_api={"socket": str(api), "group": "nogroup"},
                       metrics={"listen": f"127.0.0.1:{port}"})
    log = tmp_path / "pi-1.log"
    held: list[socket.socket] = []
    try:
        until("the local API answering", lambda: api.exists() and unix_status(api, get("/v1/status")) == 200, proc, log)
        for body, reason in ((b"[" * 30_000 + b"]" * 30_000, b"nested too deeply"),
                             (b'{"class": "events", "payload": {"x": "\\ud800"}}', b"lone surrogate"),
                             (b'{"class": "events", "payload": {"x": NaN}}', b"nan"),
                             (b'{"class": "events", "payload": {"x": 1e999}}', b"not a json number")):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(30)
                sock.connect(str(api))
                sock.sendall(post_json("/v1/messages", body))
                answer = sock.makefile("rb").read()
            assert answer.startswith(b"HTTP/1.1 400 ") and reason in answer.lower(), answer[:300]

        def unix() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(api))
            return sock

        held = slow_heads(unix, FLOOD)
        for _ in range(40):  # kept alive after one request: not closed for a newcomer either
            try:
                sock = unix()
            except OSError:
                continue
            held.append(sock)
            sock.settimeout(30)
            sock.sendall(get("/v1/status", keep=True))
        assert unix_status_as(NOBODY, api, get("/v1/status")) == 200  # the other application, first attempt
        assert tcp_status(port, get("/healthz")) == 200
    finally:
        for sock in held:
            sock.close()
        kill(proc)
    assert "Traceback" not in log.read_text()


def test_one_address_flooding_the_artifact_server_starves_no_other_device(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """M1, M2 on a leader process serving a rollout's artifact: 32 downloads from one address that
    never read, and 300 stalled requests; that address holds its share of the download slots (the
    rest are 503 with Retry-After), and a device at another address gets its range at once."""
    artifact, public = make_artifact(tmp_path, chunk_size=1024 * 1024, size=24 * 1024 * 1024)
    image = read_signed_manifest(artifact).manifest.sha256.hex()
    http = free_port()
    firmware = {"public_key": str(public)}
    leader = spawn_agent(tmp_path, "leader", "gw", mosquitto.url, firmware=firmware,
                         artifacts={"listen": f"127.0.0.1:{http}"})
    device = spawn_agent(tmp_path, "worker", "pi-1", mosquitto.url, firmware=firmware)
    db = tmp_path / "gw" / "leader.db"
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[rollout]\nname = "lab"\nartifact = "{artifact}"\n[waves]\ncanary = 0\ncounts = [1]\n'
                    '[device]\ntimeout_s = 600\n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = tmp_path / "gw.log"
    held: list[socket.socket] = []
    try:
        def registered() -> bool:
            if not db.exists():
                return False
            try:
                with open_leader_db(db) as reader:
                    return reader.registry.online_count()[1] >= 1
            except StoreError:  # not a leader database yet: the leader is creating it
                return False

        until("the device registered", registered, leader, log)
        started = subprocess.run([sys.executable, "-m", "agent.cli", "rollout", "start", str(spec), "--db", str(db),
                                  "--id", "lab-1", "--no-wait"], capture_output=True, text=True, env=env, timeout=60,
                                 check=False)
        assert started.returncode == 0, started.stderr
        url = f"/artifacts/{image}.eafw"
        until("the artifact served", lambda: tcp_status(http, get(url, extra="Range: bytes=0-9\r\n")) == 206,
              leader, log)
        statuses = []
        for _ in range(32):
            sock = socket.create_connection(("127.0.0.1", http), timeout=30)
            held.append(sock)
            sock.sendall(get(url, keep=True))
            line = sock.makefile("rb").readline()
            statuses.append(int(line.split(b" ", 2)[1]) if line.startswith(b"HTTP/1.1 ") else 0)
        assert 1 <= statuses.count(200) <= 8 and statuses.count(503) == 32 - statuses.count(200), statuses
        held += slow_heads(lambda: socket.create_connection(("127.0.0.1", http), timeout=30), FLOOD)
        assert tcp_status(http, get(url, extra="Range: bytes=0-99\r\n"), source="127.0.0.2") == 206
    finally:
        for sock in held:
            sock.close()
        kill(device)
        kill(leader)
    assert "Traceback" not in log.read_text()
