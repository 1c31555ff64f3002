"""A configuration rolled out in waves, end to end: a leader and three workers as `edge-agent run`
processes over a real mosquitto, each worker declaring `[config_targets.app]`. A release that
stays healthy commits on every device through three waves; a release whose health check fails
reverts by itself on the canary within confirm_s and the rollout aborts, the other devices never
offered it; the devices' documents are compared byte for byte."""

from __future__ import annotations

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

from firmware_rollout.artifact.keys import generate_keypair

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ("pi-0", "pi-1", "pi-2")
pytestmark = [pytest.mark.mqtt, pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_config_rollout_commits_in_waves_and_a_bad_one_reverts_and_aborts(tmp_path: Path,
                                                                            mosquitto: Mosquitto) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    keys = generate_keypair(tmp_path / "keys")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    key = f'[firmware]\npublic_key = "{keys.public}"\n'
    configs = [agent_config(tmp_path, "gw", "leader", url, key)]
    for name in DEVICES:
        etc = tmp_path / name / "etc" / "app"
        etc.mkdir(parents=True)
        (etc / "app.toml").write_text("mode = 'factory'\n")
        configs.append(agent_config(tmp_path, name, "worker", url, key + (
            f'[config_targets.app]\ndirectory = "{etc}"\nconfirm_s = 15\n'
            f'health_command = ["grep", "-q", "mode = .good", "{etc / "app.toml"}"]\n')))
    procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(c)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
             for c in configs]
    db = tmp_path / "gw" / "leader.db"
    cli = [sys.executable, "-m", "agent.cli"]

    def release(version: str, text: str) -> Path:
        src = tmp_path / f"src-{version}"
        src.mkdir()
        (src / "app.toml").write_text(text)
        out = tmp_path / f"app-{version}.eacfg"
        done = subprocess.run([*cli, "config", "release", "build", "app", str(src / "app.toml"), "--version", version,
                               "--key", str(keys.private), "--out", str(out)], capture_output=True, text=True,
                              env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        return out

    def roll(rid: str, artifact: Path, waves: str) -> dict[str, Any]:
        spec = tmp_path / f"{rid}.toml"
        spec.write_text(f'[rollout]\nname = "app config"\nkind = "config"\nartifact = "{artifact}"\n'
                        f'[waves]\n{waves}\n[device]\ntimeout_s = 60\n')
        started = subprocess.run([*cli, "rollout", "start", str(spec), "--db", str(db), "--id", rid],
                                 capture_output=True, text=True, env=env, timeout=60)
        assert started.returncode == 0 and f"config release app {artifact.stem.split('-')[1]}" in started.stdout, (
            started.stdout + started.stderr)
        deadline = time.monotonic() + 120
        while True:
            out = subprocess.run([*cli, "rollout", "status", rid, "--db", str(db), "--json", "--devices"],
                                 capture_output=True, text=True, env=env, timeout=60)
            data: dict[str, Any] = json.loads(out.stdout)
            if data["state"] not in ("running", "scheduled") or time.monotonic() > deadline:
                return data
            time.sleep(0.3)

    def wait_status(device: str, said: str) -> None:
        deadline = time.monotonic() + 60
        while True:
            status = subprocess.run([*cli, "status", "--device", device, "--db", str(db)],
                                    capture_output=True, text=True, env=env, timeout=60)
            if said in status.stdout:
                return
            assert time.monotonic() < deadline, status.stdout
            time.sleep(0.3)

    def documents() -> list[bytes]:
        return [(tmp_path / name / "etc" / "app" / "app.toml").read_bytes() for name in DEVICES]

    try:
        deadline = time.monotonic() + 60
        while registered(db) < len(DEVICES):
            assert time.monotonic() < deadline, "the workers never registered with the leader"
            time.sleep(0.3)
        good = release("1.1.0", "mode = 'good'\nport = 2\n")
        data = roll("cfg-1", good, "canary = 1\ncounts = [1, 1]")
        assert data["state"] == "succeeded" and data["counts"] == {"succeeded": 3}, data
        assert [w["succeeded"] for w in data["waves"]] == [1, 1, 1]
        assert documents() == [b"mode = 'good'\nport = 2\n"] * 3

        for name in DEVICES:  # each device's next full heartbeat says what its target holds
            wait_status(name, "app: 1.1.0 (committed); in sync")
        bad = release("1.2.0", "mode = 'broken'\n")
        data = roll("cfg-2", bad, "canary = 1\ncounts = [2]")
        assert data["state"] == "aborted", data
        assert data["from_versions"] == {"1.1.0": 3}  # from what the targets held, as the heartbeats said
        canary = [d for d in data["device_list"] if d["wave"] == 0]
        assert len(canary) == 1 and canary[0]["state"] == "rolled_back", data["device_list"]
        assert "not confirmed within 15 s" in canary[0]["detail"]
        assert {d["state"] for d in data["device_list"] if d["wave"] == 1} <= {"queued", "canceled"}
        assert documents() == [b"mode = 'good'\nport = 2\n"] * 3  # the canary is back on 1.1.0, byte for byte

        wait_status(canary[0]["device"], "app: 1.1.0 (rolled_back); in sync")
    finally:
        stop(procs)
