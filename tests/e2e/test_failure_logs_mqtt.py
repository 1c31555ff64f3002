"""A failed update explains itself, end to end: a leader and a worker as `edge-agent run`
processes over a real mosquitto. A configuration release whose health check fails reverts on the
device, and its report carries the lines of the device's log that say why. `rollout status
--device` and the console's device page show them, and neither shows the secrets planted in the
health check's output: a password by shape, and the device's own broker password by value."""

from __future__ import annotations

import html
import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mosquitto import Mosquitto
from test_rollout_mqtt import agent_config, registered, stop

from rollout_engine.keys import generate_keypair

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.mqtt, pytest.mark.slow, pytest.mark.timeout(300)]
PLANTED_SHAPE = "hunter2-by-shape"
PLANTED_VALUE = "Broker-Pass-4417-by-value"
TOKEN = "0123456789abcdef0123456789abcdef"


def console_page(db: Path, path: str) -> str:
    """The console's page at `path`, over HTTP, as an operator with the token reads it."""
    from agent.console.server import Console, ConsoleConfig, ConsoleServer

    console = ConsoleServer(("127.0.0.1", 0), Console(ConsoleConfig(db=db, token=TOKEN,
                                                                    outbox=db.with_name("outbox.db"))))
    console.serve_in_thread()
    try:
        conn = http.client.HTTPConnection(*console.server_address[:2], timeout=30)
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
            response = conn.getresponse()
            assert response.status == 200, response.status
            return response.read().decode()
        finally:
            conn.close()
    finally:
        console.shutdown()
        console.server_close()


def test_a_reverted_config_shows_the_lines_that_explain_it_and_no_secret(tmp_path: Path,
                                                                        mosquitto: Mosquitto) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    keys = generate_keypair(tmp_path / "keys")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    key = f'[firmware]\npublic_key = "{keys.public}"\n'
    etc = tmp_path / "pi-1" / "etc" / "app"
    etc.mkdir(parents=True)
    (etc / "app.toml").write_text("mode = 'factory'\n")
    password = tmp_path / "pi-1.pass"
    password.write_text(PLANTED_VALUE + "\n")
    password.chmod(0o600)
    check = (f"echo 'db connect to db1 failed: password={PLANTED_SHAPE}'; echo 'dialled with {PLANTED_VALUE}';"
             f" grep -q 'mode = .good' {etc / 'app.toml'} || {{ echo 'mode is not good' >&2; exit 3; }}")
    configs = [agent_config(tmp_path, "gw", "leader", url, key),
               agent_config(tmp_path, "pi-1", "worker", url, key + (
                   f'[config_targets.app]\ndirectory = "{etc}"\nconfirm_s = 5\nsettle_s = 0\n'
                   f'units = ["edge-app-demo.service"]\nhealth_command = ["sh", "-c", {json.dumps(check)}]\n'))]
    text = configs[1].read_text().replace(f'url = "{url}"\n', f'url = "{url}"\nusername = "pi-1"\n'
                                          f'password_file = "{password}"\n')
    configs[1].write_text(text)
    logs = [c.with_suffix(".log").open("wb") for c in configs]
    procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(c)], stdout=log,
                              stderr=subprocess.STDOUT, env=env) for c, log in zip(configs, logs, strict=True)]
    db = tmp_path / "gw" / "leader.db"
    cli = [sys.executable, "-m", "agent.cli"]

    def run(*argv: str) -> str:
        done = subprocess.run([*cli, *argv], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    try:
        deadline = time.monotonic() + 60
        while registered(db) < 1:
            assert time.monotonic() < deadline, "the worker never registered with the leader"
            time.sleep(0.3)
        src = tmp_path / "src"
        src.mkdir()
        (src / "app.toml").write_text("mode = 'bad'\n")
        release = tmp_path / "app-1.1.0.eacfg"
        run("config", "release", "build", "app", str(src / "app.toml"), "--version", "1.1.0", "--key",
            str(keys.private), "--out", str(release))
        spec = tmp_path / "cfg.toml"
        spec.write_text(f'[rollout]\nname = "app config"\nkind = "config"\nartifact = "{release}"\n'
                        '[waves]\ncounts = [1]\n[device]\ntimeout_s = 60\n')
        run("rollout", "start", str(spec), "--db", str(db), "--id", "cfg-bad")
        deadline = time.monotonic() + 120
        while True:
            data: dict[str, Any] = json.loads(run("rollout", "status", "cfg-bad", "--db", str(db), "--json",
                                                  "--device", "pi-1"))
            if data["state"] not in ("running", "scheduled"):
                break
            assert time.monotonic() < deadline, data
            time.sleep(0.3)
        device = data["device"]
        assert device["state"] == "rolled_back" and device["log_state"] == "rolled_back", device
        shown = "\n".join(device["log"])
        assert "-- edge-agent --" in shown, shown
        assert "health command exited 3" in shown and "mode is not good" in shown, shown
        assert "password=[redacted]" in shown and "with [redacted]" in shown, shown
        assert "[redacted]" in device["detail"], device
        printed = run("rollout", "status", "cfg-bad", "--db", str(db), "--device", "pi-1")
        assert "its log when it reported rolled_back" in printed and "mode is not good" in printed, printed

        page = console_page(db, "/devices/pi-1")
        assert "What the device logged when it reported rolled_back in cfg-bad" in page
        assert "mode is not good" in html.unescape(page)
        everything = shown + device["detail"] + printed + page
        assert PLANTED_SHAPE not in everything and PLANTED_VALUE not in everything
    finally:
        stop(procs)
        for log in logs:
            log.close()
