"""`edge-agent run` processes over a real mosquitto: a leader and two workers with `[firmware]`,
a rollout started with `edge-agent rollout start`; the workers download from the leader's
ConfigServers, exec into the new slot, pass the health check and commit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mosquitto import Mosquitto

from agent.core.errors import StoreError
from agent.leader.readonly import open_leader_db
from firmware_rollout.artifact.fixture import make_artifact

ROOT = Path(__file__).resolve().parents[2]


def agent_config(work: Path, name: str, role: str, url: str, extra: str = "",
                 artifacts_listen: str = "127.0.0.1:0", tags: tuple[str, ...] = ()) -> Path:
    """`artifacts_listen` empty: the leader serves no HTTP, devices download MQTT chunks."""
    path = work / f"{name}.toml"
    path.write_text(
        f'[agent]\nrole = "{role}"\ndevice_id = "{name}"\nfleet = "lab"\ndata_dir = "{work / name}"\n'
        f'firmware_version = "1.0.0"\nuse_uvloop = false\ntags = {json.dumps(list(tags))}\n'
        f'[mqtt]\nurl = "{url}"\n[heartbeat]\ninterval_s = 1.0\n'
        f'[artifacts]\nlisten = "{artifacts_listen}"\n' + extra)
    return path


def registered(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with open_leader_db(db) as leader:
            return leader.registry.online_count()[1]
    except StoreError:  # not a leader database yet: the leader is creating it
        return 0


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every agent, SIGKILL one that lingers."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.mark.mqtt
@pytest.mark.slow
def test_rollout_between_agent_processes_over_mosquitto(tmp_path: Path, mosquitto: Mosquitto) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    artifact, public = make_artifact(tmp_path, chunk_size=4096, size=20_000)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # the leader checks what it rolls out against the fleet's key, as the workers do
    configs = [agent_config(tmp_path, "gw", "leader", url, f'[firmware]\npublic_key = "{public}"\n')]
    configs += [agent_config(tmp_path, f"pi-{i}", "worker", url, f'[firmware]\npublic_key = "{public}"\n')
                for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(c)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for c in configs]
    db = tmp_path / "gw" / "leader.db"
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[rollout]\nname = "lab"\nartifact = "{artifact}"\n[waves]\ncanary = 1\ncounts = [1]\n'
                    '[device]\ntimeout_s = 60\n')
    cli = [sys.executable, "-m", "agent.cli", "rollout"]
    try:
        deadline = time.monotonic() + 30
        while registered(db) < 2:  # the leader is up and both workers have sent a heartbeat
            assert time.monotonic() < deadline, "the workers never registered with the leader"
            time.sleep(0.5)
        started = subprocess.run(cli + ["start", str(spec), "--db", str(db), "--id", "lab-1"],
                                 capture_output=True, text=True, env=env, timeout=60)
        assert started.returncode == 0 and "started lab-1" in started.stdout, started.stderr
        rid = "lab-1"
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(cli + ["status", rid, "--db", str(db), "--json"], capture_output=True, text=True,
                                 env=env, timeout=60)
            data = json.loads(out.stdout)
            if data["state"] != "running" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert data["state"] == "succeeded", data
        assert data["counts"] == {"succeeded": 2}
        # the devices fetched the image from the leader's artifact server, not as MQTT chunks
        assert data["serving"].get("chunks", 0) == 0, data["serving"]
        for i in range(2):
            env_file = tmp_path / f"pi-{i}" / "firmware" / "slots" / "bootenv.json"
            assert json.loads(env_file.read_text()) == {"default": "b", "trial": None}
    finally:
        stop(procs)


@pytest.mark.mqtt
@pytest.mark.slow
def test_a_cancel_mid_download_over_mosquitto_reaches_every_device(tmp_path: Path, mosquitto: Mosquitto) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    # 96 chunks of 4 KiB through one server at 16 KiB/s: the devices are mid-download for a while
    artifact, public = make_artifact(tmp_path, chunk_size=4096, size=96 * 4096)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    key = f'[firmware]\npublic_key = "{public}"\n'
    # no artifact server: the download goes through the rate-limited ConfigServer over MQTT
    configs = [agent_config(tmp_path, "gw", "leader", url, key, artifacts_listen="")]
    configs += [agent_config(tmp_path, f"pi-{i}", "worker", url, key) for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(c)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for c in configs]
    db = tmp_path / "gw" / "leader.db"
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[rollout]\nname = "slow"\nartifact = "{artifact}"\n[waves]\ncounts = [3]\n'
                    '[device]\ntimeout_s = 600\n[download]\nservers = 1\nrate_bytes_per_s = 16384\n')
    cli = [sys.executable, "-m", "agent.cli", "rollout"]

    def status() -> dict[str, Any]:
        out = subprocess.run(cli + ["status", "slow-1", "--db", str(db), "--json", "--devices"], capture_output=True,
                             text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    try:
        deadline = time.monotonic() + 30
        while registered(db) < 3:
            assert time.monotonic() < deadline, "the workers never registered with the leader"
            time.sleep(0.5)
        started = subprocess.run(cli + ["start", str(spec), "--db", str(db), "--id", "slow-1"],
                                 capture_output=True, text=True, env=env, timeout=60)
        assert started.returncode == 0, started.stderr
        deadline = time.monotonic() + 120
        while True:  # until every device reported some progress of its download
            data = status()
            if data["waves"][0]["download"]["progress_reports"] >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        downloading = data["waves"][0]["download"]
        assert 0 < downloading["bytes_done"] < downloading["bytes_total"], data  # mid-download
        canceled = subprocess.run(cli + ["cancel", "slow-1", "--db", str(db)], capture_output=True, text=True,
                                  env=env, timeout=60)
        assert canceled.returncode == 0 and "canceled slow-1" in canceled.stdout, canceled.stderr
        deadline = time.monotonic() + 120
        while True:  # every device confirms it stopped
            data = status()
            if data["cancel_pending"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert data["state"] == "canceled" and data["cancel_pending"] == 0, data
        assert data["counts"] == {"canceled": 3}, data
        assert {d["state"] for d in data["device_list"]} == {"canceled"}
        for i in range(3):  # nothing was installed or armed
            firmware = tmp_path / f"pi-{i}" / "firmware"
            assert not (firmware / "slots" / "b" / "version").exists()  # never checked whole
            assert not (firmware / "staging.img").exists()
            bootenv = firmware / "slots" / "bootenv.json"
            assert not bootenv.exists() or json.loads(bootenv.read_text()) == {"default": "a", "trial": None}
    finally:
        stop(procs)


@pytest.mark.mqtt
@pytest.mark.slow
def test_a_leader_down_during_a_trial_boot_does_not_revert_a_good_image(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """The leader goes down (SIGKILL: the broker publishes its retained will) while a device waits
    to reboot into the new image (an application holds the update lock). On the trial boot the
    broker answers and the leader does not, past `health_timeout_s`: the device keeps the
    trial because the leader announced itself offline, and commits when the leader is back."""
    import fcntl

    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    artifact, public = make_artifact(tmp_path, chunk_size=4096, size=20_000)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    lock = tmp_path / "update.lock"
    lock.touch()
    leader_config = agent_config(tmp_path, "gw", "leader", url, f'[firmware]\npublic_key = "{public}"\n')
    # the broker publishes the leader's will as soon as its connection ends
    leader_config.write_text(leader_config.read_text().replace(f'url = "{url}"\n',
                                                               f'url = "{url}"\nwill_delay_s = 0\n'))
    worker_config = agent_config(tmp_path, "pi-0", "worker", url,
                                 f'[firmware]\npublic_key = "{public}"\nhealth_timeout_s = 10.0\n'
                                 f'update_lock = "{lock}"\n')

    def run(config: Path, log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)

    db = tmp_path / "gw" / "leader.db"
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[rollout]\nname = "lab"\nartifact = "{artifact}"\n[waves]\ncounts = [1]\n'
                    '[device]\ntimeout_s = 600\n')
    cli = [sys.executable, "-m", "agent.cli", "rollout"]
    worker_log = tmp_path / "pi-0.log"
    held = os.open(lock, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # the application: not now
    procs = [run(leader_config, tmp_path / "gw.log"), run(worker_config, worker_log)]

    def until(what: str, predicate: Any, limit_s: float = 60) -> None:
        deadline = time.monotonic() + limit_s
        while not predicate():
            assert time.monotonic() < deadline, f"{what}: not within {limit_s}s\n{worker_log.read_text()[-3000:]}"
            time.sleep(0.1)

    try:
        until("the worker registered", lambda: registered(db) >= 1)
        started = subprocess.run(cli + ["start", str(spec), "--db", str(db), "--id", "lab-1"],
                                 capture_output=True, text=True, env=env, timeout=60)
        assert started.returncode == 0, started.stderr
        until("the device waiting for the update lock", lambda: "waiting for the update lock" in worker_log.read_text())
        procs[0].kill()  # the leader goes down hard; the broker publishes its will at once
        procs[0].wait(30)
        fcntl.flock(held, fcntl.LOCK_UN)  # the device reboots into the trial now
        until("the trial waiting for the leader", lambda: "instead of reverting" in worker_log.read_text())
        text = worker_log.read_text()
        assert "the leader announced itself offline: waiting for it" in text and "rolled_back" not in text
        procs[0] = run(leader_config, tmp_path / "gw.log")  # the leader is back
        bootenv = tmp_path / "pi-0" / "firmware" / "slots" / "bootenv.json"
        until("the trial committed", lambda: json.loads(bootenv.read_text()) == {"default": "b", "trial": None})
        assert "rolled_back" not in worker_log.read_text()
    finally:
        os.close(held)
        stop(procs)
