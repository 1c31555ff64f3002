"""A configuration rolled out in waves, end to end: a leader and three workers as `edge-agent run`
processes over a real mosquitto, each worker declaring `[config_targets.app]` and reaching the
broker through its own TCP link. A release that stays healthy commits on every device through
three waves; a release whose `apply_command` cuts the device's link (as a broken network
configuration would) reverts by itself on the canary within confirm_s, the link comes back with
the old content, and the rollout aborts, the other devices never offered it. The devices'
documents are compared byte for byte; the applications go on reading their configuration and
sending messages through the local API throughout, and every message reaches the leader once."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mosquitto import Mosquitto
from test_rollout_mqtt import agent_config, registered, stop

from agent.client import Client
from rollout_engine.keys import generate_keypair

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
    procs: list[subprocess.Popen[bytes]] = []
    cuts = {name: tmp_path / name / "link-cut" for name in DEVICES}
    for name in DEVICES:
        etc = tmp_path / name / "etc" / "app"
        etc.mkdir(parents=True)
        (etc / "app.toml").write_text("mode = 'factory'\n")
        port_file = tmp_path / f"{name}.link-port"
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).with_name("cuttable_link.py")),
                                       str(port_file), str(mosquitto.port), str(cuts[name])]))
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert time.monotonic() < deadline, "the link never listened"
            time.sleep(0.05)
        # the application's network settings: "network = 'off'" in the document cuts the link
        doc, cut = etc / "app.toml", cuts[name]
        apply = f"if grep -q \"^network = .off\" {doc}; then touch {cut}; else rm -f {cut}; fi"
        configs.append(agent_config(tmp_path, name, "worker", f"mqtt://127.0.0.1:{port_file.read_text()}", key + (
            f'[config_targets.app]\ndirectory = "{etc}"\nconfirm_s = 15\n'
            f'apply_command = ["sh", "-c", {json.dumps(apply)}]\n'
            f'health_command = ["grep", "-q", "mode = .good", "{etc / "app.toml"}"]\n'),
            tags=("site-b",) if name != "pi-0" else ()))
    logs = [c.with_suffix(".log").open("wb") for c in configs]
    procs += [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(c)], stdout=log,
                               stderr=subprocess.STDOUT, env=env) for c, log in zip(configs, logs, strict=True)]
    sent: list[str] = []

    def applications() -> None:
        """Each device's application reads its configuration and sends a message."""
        for name in DEVICES:
            with Client(tmp_path / name / "api.sock", timeout_s=60) as app:
                assert app.config("app")["target"] == "app"
                sent.append(app.send("events", {"device": name, "n": len(sent)}))
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

    def roll(rid: str, artifact: Path, waves: str, gates: str = "") -> dict[str, Any]:
        spec = tmp_path / f"{rid}.toml"
        spec.write_text(f'[rollout]\nname = "app config"\nkind = "config"\nartifact = "{artifact}"\n'
                        f'[waves]\n{waves}\n[device]\ntimeout_s = 60\n' + (f"[gates]\n{gates}\n" if gates else ""))
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
            applications()
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

    def config_cli(*argv: str) -> str:
        done = subprocess.run([*cli, "config", *argv], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def documents() -> list[bytes]:
        return [(tmp_path / name / "etc" / "app" / "app.toml").read_bytes() for name in DEVICES]

    try:
        deadline = time.monotonic() + 60
        while registered(db) < len(DEVICES):
            assert time.monotonic() < deadline, "the workers never registered with the leader"
            time.sleep(0.3)
        # the leader's layers: the site-b group's port, and pi-2's own
        config_cli("layer", "set", "app", "app.toml", "port=3", "--tag", "site-b", "--db", str(db))
        config_cli("layer", "set", "app", "app.toml", "port=4", "--device", "pi-2", "--db", str(db))
        good = release("1.1.0", "mode = 'good'\nport = 2\n")
        # each wave passes once its devices' own heartbeats say they hold it, not only their reports
        data = roll("cfg-1", good, "canary = 1\ncounts = [1, 1]", "min_compliance_pct = 100.0\ncompliance_wait_s = 60")
        assert data["state"] == "succeeded" and data["counts"] == {"succeeded": 3}, data
        assert [w["succeeded"] for w in data["waves"]] == [1, 1, 1]
        held = [b"mode = 'good'\nport = 2\n", b'mode = "good"\nport = 3\n', b'mode = "good"\nport = 4\n']
        assert documents() == held  # the release's bytes where no layer applies, else rendered

        for name in DEVICES:  # each device's next full heartbeat says what its target holds
            wait_status(name, "app: holds 1.1.0; in sync")
        preview = config_cli("diff", "--device", "pi-2", "--db", str(db), "--key", str(keys.public))
        assert "holds 1.1.0, layers" in preview and ": in sync" in preview, preview
        assert "+port = 4" in preview and "port  from device pi-2" in preview, preview
        bad = release("1.2.0", "mode = 'good'\nport = 2\nnetwork = 'off'\n")
        data = roll("cfg-2", bad, "canary = 1\ncounts = [2]")
        assert data["state"] == "aborted", data
        assert data["from_versions"] == {"1.1.0": 3}  # from what the targets held, as the heartbeats said
        canary = [d for d in data["device_list"] if d["wave"] == 0]
        assert len(canary) == 1 and canary[0]["state"] == "rolled_back", data["device_list"]
        assert "not confirmed within 15 s: the broker connection is down" in canary[0]["detail"], canary
        assert {d["state"] for d in data["device_list"] if d["wave"] == 1} <= {"queued", "canceled"}
        assert documents() == held  # the canary is back on 1.1.0, byte for byte
        assert not any(cut.exists() for cut in cuts.values())  # the old content's apply restored the link

        wait_status(canary[0]["device"], "app: holds 1.1.0; in sync (its last attempt was rolled back)")
        # a layer value set since a device's apply: the leader has more for it
        other = next(d for d in DEVICES if d != canary[0]["device"])
        config_cli("layer", "set", "app", "app.toml", "port=5", "--device", other, "--expires", "1h", "--db", str(db))
        wait_status(other, "app: holds 1.1.0; pending")
        assert "PENDING" in config_cli("diff", "--device", other, "--db", str(db), "--key", str(keys.public))
        # a local edit on a device: drift, in its status and the fleet's
        (tmp_path / "pi-0" / "etc" / "app" / "app.toml").write_text("mode = 'good'\nport = 99\n")
        wait_status("pi-0", "DRIFTED: app.toml changed on the device")
        fleet = subprocess.run([*cli, "status", "--db", str(db)], capture_output=True, text=True, env=env,
                               timeout=60).stdout
        assert "1 drifted" in fleet, fleet
        applications()
        deadline = time.monotonic() + 120  # the canary's messages of the cut come from its outbox
        while True:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
                stored = dict(conn.execute("SELECT msg_id, count(*) FROM app_messages GROUP BY msg_id").fetchall())
            if len(stored) >= len(sent) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert sorted(stored) == sorted(sent) and set(stored.values()) == {1}  # each once, none lost
    finally:
        stop(procs)
        for log in logs:
            log.close()
