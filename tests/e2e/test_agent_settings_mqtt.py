"""The agent's own settings rolled out as a config release (the built-in target `agent`), end to
end: a leader and a worker as `edge-agent run` processes over a real mosquitto. The release
changes the worker's heartbeat interval and log level; the worker checks it, swaps it in, starts
its parts again in the same process on it, confirms it there (connected, the leader answering)
and commits; its heartbeats then announce the new interval. A release that touches a setting a
release may not change (the broker's address) is refused, the agent running on. An application
sends messages through the local API all along, retrying through the restart under the same
names: every message reaches the leader once."""

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

from agent.client import AgentUnavailable, Client, LocalApiError
from agent.leader.readonly import open_leader_db
from rollout_engine.keys import generate_keypair

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.mqtt, pytest.mark.slow, pytest.mark.timeout(300)]


def send_until_held(sock: Path, sent: list[str], name: str) -> None:
    """One message, sent again under its name until the agent holds it (it may be starting again)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with Client(sock, timeout_s=30) as app:
                sent.append(app.send("events", {"n": len(sent)}, app_id=name))
            return
        except (AgentUnavailable, LocalApiError) as exc:
            assert time.monotonic() < deadline, exc
            time.sleep(0.1)


def stored_once(db: Path, sent: list[str], limit_s: float) -> None:
    """Every message sent reaches the leader's store, each once, nothing else."""
    deadline = time.monotonic() + limit_s
    while True:
        with open_leader_db(db) as leader:
            stored = dict(leader.conn.execute("SELECT msg_id, count(*) FROM app_messages GROUP BY msg_id"))
        if len(stored) >= len(set(sent)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(stored) == sorted(set(sent)) and set(stored.values()) == {1}  # each once, none lost


def test_a_release_of_the_agents_own_settings_restarts_it_in_place_and_commits(tmp_path: Path,
                                                                              mosquitto: Mosquitto) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    keys = generate_keypair(tmp_path / "keys")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    key = f'[firmware]\npublic_key = "{keys.public}"\n'
    configs = [agent_config(tmp_path, "gw", "leader", url, key), agent_config(tmp_path, "pi-1", "worker", url, key)]
    logs = [c.with_suffix(".log").open("wb") for c in configs]
    procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(c)], stdout=log,
                              stderr=subprocess.STDOUT, env=env) for c, log in zip(configs, logs, strict=True)]
    db = tmp_path / "gw" / "leader.db"
    cli = [sys.executable, "-m", "agent.cli"]
    sock = tmp_path / "pi-1" / "api.sock"
    sent: list[str] = []

    def application() -> None:
        send_until_held(sock, sent, f"m-{len(sent)}")

    def release(version: str, text: str) -> Path:
        src = tmp_path / f"src-{version}"
        src.mkdir()
        (src / "agent.toml").write_text(text)
        out = tmp_path / f"agent-{version}.eacfg"
        done = subprocess.run([*cli, "config", "release", "build", "agent", str(src / "agent.toml"), "--version",
                               version, "--key", str(keys.private), "--out", str(out)], capture_output=True,
                              text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        return out

    def roll(rid: str, artifact: Path) -> dict[str, Any]:
        spec = tmp_path / f"{rid}.toml"
        spec.write_text(f'[rollout]\nname = "agent settings"\nkind = "config"\nartifact = "{artifact}"\n'
                        '[waves]\ncounts = [1]\n[device]\ntimeout_s = 120\n')
        started = subprocess.run([*cli, "rollout", "start", str(spec), "--db", str(db), "--id", rid],
                                 capture_output=True, text=True, env=env, timeout=60)
        assert started.returncode == 0, started.stdout + started.stderr
        deadline = time.monotonic() + 150
        while True:
            out = subprocess.run([*cli, "rollout", "status", rid, "--db", str(db), "--json", "--devices"],
                                 capture_output=True, text=True, env=env, timeout=60)
            data: dict[str, Any] = json.loads(out.stdout)
            if data["state"] not in ("running", "scheduled") or time.monotonic() > deadline:
                return data
            application()
            time.sleep(0.3)

    try:
        deadline = time.monotonic() + 60
        while registered(db) < 1:
            assert time.monotonic() < deadline, "the worker never registered with the leader"
            time.sleep(0.3)
        data = roll("own-1", release("1.0.0", '[heartbeat]\ninterval_s = 7.0\n[agent]\nlog_level = "DEBUG"\n'))
        assert data["state"] == "succeeded", data
        worker_log = (tmp_path / "pi-1.log").read_text()
        assert "agent started again" in worker_log and "config agent: committed at the start" in worker_log
        settings = tmp_path / "pi-1" / "config" / "agent" / "settings" / "agent.toml"
        assert settings.read_bytes() == b'[heartbeat]\ninterval_s = 7.0\n[agent]\nlog_level = "DEBUG"\n'
        deadline = time.monotonic() + 60
        while True:  # the worker's heartbeats announce the new interval, and the leader says what it holds
            status = subprocess.run([*cli, "status", "--device", "pi-1", "--db", str(db)], capture_output=True,
                                    text=True, env=env, timeout=60).stdout
            if "agent: holds 1.0.0; in sync" in status:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.3)
        assert "level=debug" in (tmp_path / "pi-1.log").read_text()  # the new log level runs

        data = roll("own-2", release("1.1.0", '[mqtt]\nurl = "mqtt://127.0.0.1:1"\n'))
        assert data["state"] == "aborted", data
        device = data["device_list"][0]
        assert device["state"] == "failed" and "not a setting a release may change" in device["detail"], device
        assert settings.read_bytes().startswith(b"[heartbeat]")  # what was in force stays

        application()
        stored_once(db, sent, 120)
        assert all(p.poll() is None for p in procs)  # the worker restarted in place: the same process
    finally:
        stop(procs)
        for log in logs:
            log.close()


def test_sighup_starts_the_parts_again_on_the_config_file_read_anew(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """`systemctl reload` (SIGHUP) of a leader and a worker: each stops its parts as at a shutdown
    and starts them again in the same process on its config file read anew (a mistake in it is
    logged and the last config runs on); messages sent before and after all reach the leader."""
    import signal

    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    configs = [agent_config(tmp_path, "gw", "leader", url), agent_config(tmp_path, "pi-1", "worker", url)]
    logs = [c.with_suffix(".log").open("wb") for c in configs]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(c)], stdout=log,
                              stderr=subprocess.STDOUT, env=env) for c, log in zip(configs, logs, strict=True)]
    db = tmp_path / "gw" / "leader.db"
    sock = tmp_path / "pi-1" / "api.sock"
    sent: list[str] = []

    def send(n: int) -> None:
        send_until_held(sock, sent, f"h-{n}")

    def logged(name: str, text: str, times: int = 1) -> bool:
        return (tmp_path / f"{name}.log").read_text().count(text) >= times

    def wait(what: str, check: Any) -> None:
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    try:
        wait("registered", lambda: registered(db) >= 1)
        send(0)
        configs[1].write_text(configs[1].read_text().replace("interval_s = 1.0", "interval_s = 2.0"))
        for p in procs:
            p.send_signal(signal.SIGHUP)
        wait("both started again", lambda: all(logged(name, "agent started again") for name in ("gw", "pi-1")))
        send(1)
        configs[1].write_text(configs[1].read_text() + "[nonsense]\n")  # a mistake: logged, the last config runs
        procs[1].send_signal(signal.SIGHUP)
        wait("started again on the last config", lambda: logged("pi-1", "agent started again", 2))
        assert logged("pi-1", "nonsense") and logged("pi-1", "the config file's settings of the last start go on")
        send(2)
        stored_once(db, sent, 60)
        assert all(p.poll() is None for p in procs)
    finally:
        stop(procs)
        for log in logs:
            log.close()


def test_a_sigkill_while_the_new_settings_are_confirmed_brings_the_old_ones_back(tmp_path: Path,
                                                                                mosquitto: Mosquitto) -> None:
    """The worker is SIGKILLed in the start that confirms its new settings (after the in-process
    restart, before the commit): its next start undoes the apply before it loads anything, runs on
    the old settings, and reports `rolled_back` to the rollout."""
    import signal

    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    keys = generate_keypair(tmp_path / "keys")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    key = f'[firmware]\npublic_key = "{keys.public}"\n'
    configs = [agent_config(tmp_path, "gw", "leader", url, key), agent_config(tmp_path, "pi-1", "worker", url, key)]
    logs = [c.with_suffix(".log").open("ab") for c in configs]
    cli = [sys.executable, "-m", "agent.cli"]

    def spawn(n: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*cli, "run", "--config", str(configs[n])], stdout=logs[n],
                                stderr=subprocess.STDOUT, env=env)

    procs = [spawn(0), spawn(1)]
    db = tmp_path / "gw" / "leader.db"

    def wait(what: str, check: Any, limit_s: float = 90) -> None:
        deadline = time.monotonic() + limit_s
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    def worker_log() -> str:
        return (tmp_path / "pi-1.log").read_text()

    try:
        wait("registered", lambda: registered(db) >= 1)
        src = tmp_path / "agent.toml"
        src.write_text("[heartbeat]\ninterval_s = 9.0\n")
        release = tmp_path / "agent-2.0.0.eacfg"
        done = subprocess.run([*cli, "config", "release", "build", "agent", str(src), "--version", "2.0.0", "--key",
                               str(keys.private), "--out", str(release)], capture_output=True, text=True, env=env,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        spec = tmp_path / "own.toml"
        spec.write_text(f'[rollout]\nname = "agent settings"\nkind = "config"\nartifact = "{release}"\n'
                        "[waves]\ncounts = [1]\n[device]\ntimeout_s = 300\n")
        started = subprocess.run([*cli, "rollout", "start", str(spec), "--db", str(db), "--id", "own"],
                                 capture_output=True, text=True, env=env, timeout=60)
        assert started.returncode == 0, started.stderr
        journal = tmp_path / "pi-1" / "config" / "agent" / "journal.json"

        def confirming() -> bool:  # the new start runs the settings and confirms them (10 s settle first)
            try:
                j = json.loads(journal.read_text())
            except (OSError, ValueError):
                return False
            return j.get("state") == "applied" and j.get("restarting") is False

        # (the journal says `restarting` false once the new start has taken the settings; the
        # parts started on them a moment later)
        wait("the confirm in the new start", lambda: confirming() and "agent started again" in worker_log())
        assert "committed at the start" not in worker_log()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=30)
        procs[1] = spawn(1)
        wait("the outcome reported", lambda: "config agent: rolled_back at the start" in worker_log())
        settings = tmp_path / "pi-1" / "config" / "agent" / "settings" / "agent.toml"
        assert not settings.exists()  # nothing was in force before: nothing is
        deadline = time.monotonic() + 90
        while True:
            out = subprocess.run([*cli, "rollout", "status", "own", "--db", str(db), "--json", "--devices"],
                                 capture_output=True, text=True, env=env, timeout=60)
            data: dict[str, Any] = json.loads(out.stdout)
            if data["device_list"][0]["state"] == "rolled_back" or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert data["device_list"][0]["state"] == "rolled_back", data
        assert "interrupted before it was confirmed" in data["device_list"][0]["detail"]
    finally:
        stop(procs)
        for log in logs:
            log.close()
