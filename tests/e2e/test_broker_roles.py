"""`edge-agent broker` on a real mosquitto with its dynamic-security plugin: only leaders may
join the fleet's shared subscription, a device writes only its own topics under its own client
id, a command run again changes nothing, and two real leaders on one shared subscription take a
real worker's heartbeats through it."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest

from tests.e2e.agent_support import FLEET, REPO, db_query, kill, spawn_agent, wait_for
from tests.mosquitto import Mosquitto

PLUGIN = next(iter(glob.glob("/usr/lib/*/mosquitto_dynamic_security.so")), "")
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not PLUGIN or not Path("/usr/bin/mosquitto_ctrl").exists(),
                                 reason="needs Debian's mosquitto with its dynamic-security plugin")]


class DynsecBroker(Mosquitto):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.dynsec = workdir / "dynamic-security.json"
        subprocess.run(["mosquitto_ctrl", "dynsec", "init", str(self.dynsec), "admin", "admin-pw"], check=True,
                       capture_output=True)

    def config_text(self) -> str:
        """The shipped configs/mosquitto/leaders.conf with the test's port, files and no TLS."""
        text = (REPO / "configs" / "mosquitto" / "leaders.conf").read_text()
        for shipped, ours in (("/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so", PLUGIN),
                              ("/var/lib/mosquitto/dynamic-security.json", str(self.dynsec)),
                              ("listener 8883", f"listener {self.port} 127.0.0.1"),
                              ("persistence true", "persistence false"), ("log_dest syslog", "log_dest stderr")):
            assert shipped in text, shipped
            text = text.replace(shipped, ours)
        text = "\n".join(line for line in text.splitlines()
                         if not line.startswith(("cafile", "certfile", "keyfile", "tls_version")))
        return text + "\n" + ("user root\n" if os.geteuid() == 0 else "")


def secret(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", "broker", *args], capture_output=True, text=True,
                          cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)


def client(port: int, user: str, password: str, client_id: str) -> Any:
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    c.username_pw_set(user, password)
    c.suback: list[int] = []  # type: ignore[attr-defined]
    c.puback: list[int] = []  # type: ignore[attr-defined]
    c.got: list[str] = []  # type: ignore[attr-defined]
    c.on_subscribe = lambda _c, _u, _m, codes, _p: c.suback.extend(int(x.value) for x in codes)  # type: ignore
    c.on_publish = lambda _c, _u, _m, code, _p: c.puback.append(int(code.value))  # type: ignore
    c.on_message = lambda _c, _u, m: c.got.append(m.topic)  # type: ignore
    c.connect("127.0.0.1", port)
    c.loop_start()
    deadline = time.monotonic() + 5
    while not c.is_connected() and time.monotonic() < deadline:
        time.sleep(0.02)
    return c


def test_only_leaders_join_the_shared_subscription_and_a_device_writes_only_its_own(tmp_path: Path) -> None:
    broker = DynsecBroker(tmp_path / "broker").start()
    admin = ["--url", broker.url, "--admin-password-file", str(secret(tmp_path, "admin-pw", "admin-pw")),
             "--fleet", FLEET]
    leaders: list[subprocess.Popen[bytes]] = []
    opened: list[Any] = []
    try:
        made = cli("fleet", *admin)
        assert made.returncode == 0 and "nothing allowed by default" in made.stdout, made.stderr
        for name in ("gw-1", "gw-2"):
            password = secret(tmp_path, f"{name}.password", f"{name}-pw")
            assert cli("leader", name, "--password-file", str(password), *admin).returncode == 0
        for device in ("dev-1", "dev-2"):
            password = secret(tmp_path, f"{device}.password", f"{device}-pw")
            done = cli("device", device, "--password-file", str(password), "--leader", "gw-1", "--leader", "gw-2",
                       *admin)
            assert done.returncode == 0, done.stderr
        again = cli("fleet", *admin)
        assert again.returncode == 0 and "10 already there" in again.stdout  # again: only the default access is set
        bad = cli("device", "dev-3", "--password-file", str(tmp_path / "none"), "--leader", "gw-1", *admin)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--password-file" in bad.stderr

        gw = client(broker.port, "gw-1", "gw-1-pw", f"ea-{FLEET}-leader-gw-1")
        dev = client(broker.port, "dev-1", "dev-1-pw", f"ea-{FLEET}-worker-dev-1")
        thief = client(broker.port, "dev-1", "dev-1-pw", f"ea-{FLEET}-worker-dev-2")  # another device's session
        opened += [gw, dev, thief]
        assert gw.is_connected() and dev.is_connected() and not thief.is_connected()
        shared = f"$share/leaders/ea/v1/{FLEET}/+/up"
        gw.subscribe(shared, qos=1)
        dev.subscribe(shared, qos=1)
        wait_for(lambda: gw.suback and dev.suback, "the SUBACKs")
        assert gw.suback == [1] and dev.suback[0] >= 0x80  # a device cannot join the leaders' group
        dev.publish(f"ea/v1/{FLEET}/dev-2/up", b"forged", qos=1)
        dev.publish(f"ea/v1/{FLEET}/dev-1/up", b"own", qos=1)
        wait_for(lambda: len(dev.puback) == 2, "the PUBACKs")
        assert dev.puback[0] >= 0x80 and dev.puback[1] < 0x80
        wait_for(lambda: gw.got, "the device's own message through the shared subscription")
        assert gw.got == [f"ea/v1/{FLEET}/dev-1/up"]
        for c in opened:
            c.disconnect()
            c.loop_stop()
        opened.clear()

        # two real leaders on the shared subscription, a real worker: its heartbeats reach one of them
        for name in ("gw-1", "gw-2"):
            leaders.append(spawn_agent(tmp_path, "leader", name, broker.url,
                                       mqtt={"username": name, "password_file": str(tmp_path / f"{name}.password")},
                                       leader={"shared_group": "leaders"}))
        worker = spawn_agent(tmp_path, "worker", "dev-1", broker.url,
                             mqtt={"username": "dev-1", "password_file": str(tmp_path / "dev-1.password")})
        leaders.append(worker)

        def seen_by() -> list[str]:
            return [name for name in ("gw-1", "gw-2") if db_query(
                tmp_path / name / "leader.db", "SELECT 1 FROM devices WHERE device_id = 'dev-1' AND hb_seq >= 0")]

        assert wait_for(seen_by, "dev-1's heartbeat at a leader", limit_s=90)
        assert "not authorised" not in (tmp_path / "dev-1.log").read_text()
    finally:
        for c in opened:
            c.loop_stop()
        for proc in leaders:
            kill(proc, signal.SIGTERM)
        broker.stop()
