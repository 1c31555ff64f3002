"""A release of a device's whole state, end to end: a leader and two workers as `edge-agent run`
processes over a real mosquitto, each worker with `[firmware]` (its slots in its state directory;
a reboot restarts the agent in place) and `[config_targets.app]` with a health command. Release
R2 (firmware 1.1.0, config app 1.1.0) converges on both: the firmware boots on trial in a new
process, the configuration is applied, confirmed and held on that boot, then the firmware is
committed and the configuration after it. Release R3 (firmware 1.2.0, config app 1.2.0 whose
document fails the target's health command) returns the canary whole to R2: the configuration
reverted byte for byte, the firmware's trial boot not committed (it runs 1.1.0 again), the
leader's record naming the part that failed; the rollout aborts and the other device is never
offered it. `status` and the console say which release each device runs, and what of it a device
changed."""

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

from config_rollout.release import build_release
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.keys import generate_keypair, load_signing_key
from tests.console.test_console_http import BEARER, request, serving

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ("pi-0", "pi-1")
pytestmark = [pytest.mark.mqtt, pytest.mark.slow, pytest.mark.timeout(600)]


def _release(folder: Path, keys: Path, *, version: str, firmware: str, document: str) -> Path:
    """A release folder: the firmware, the config release, release.toml, and the document
    `edge-agent release build` makes of them."""
    folder.mkdir(parents=True)
    fw, _ = make_artifact(keys.parent.parent, version=firmware, size=12 * 4096, chunk_size=4096, seed=len(version))
    fw.replace(folder / fw.name)
    (folder / "src").mkdir()
    (folder / "src" / "app.toml").write_text(document)
    config = folder / f"app-{version}.eacfg"
    config.write_bytes(build_release("app", version, [folder / "src" / "app.toml"], load_signing_key(keys),
                                     created_ms=0))
    (folder / "release.toml").write_text(f'name = "gateway"\nversion = "{version}"\nfirmware = "{fw.name}"\n'
                                         f'config = ["{config.name}"]\n')
    done = subprocess.run([sys.executable, "-m", "agent.cli", "release", "build", str(folder / "release.toml"),
                           "--key", str(keys)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert f"release gateway {version}: firmware {firmware}, config app {version}" in done.stdout
    return folder / f"gateway-{version}.earel"


def test_a_release_converges_whole_and_a_bad_one_returns_every_part(tmp_path: Path, mosquitto: Mosquitto) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    keys = generate_keypair(tmp_path / "fw" / "keys")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    key = f'[firmware]\npublic_key = "{keys.public}"\n'
    configs = [agent_config(tmp_path, "gw", "leader", url, key)]
    for name in DEVICES:
        etc = tmp_path / name / "etc" / "app"
        etc.mkdir(parents=True)
        (etc / "app.toml").write_text("mode = 'factory'\n")
        configs.append(agent_config(tmp_path, name, "worker", url, key + (
            'health_timeout_s = 120.0\n'
            f'[config_targets.app]\ndirectory = "{etc}"\nconfirm_s = 20\nsettle_s = 1\n'
            f'health_command = ["grep", "-q", "mode = .good", "{etc / "app.toml"}"]\n')))
    logs = [c.with_suffix(".log").open("wb") for c in configs]
    procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(c)], stdout=log,
                              stderr=subprocess.STDOUT, env=env) for c, log in zip(configs, logs, strict=True)]
    db = tmp_path / "gw" / "leader.db"
    cli = [sys.executable, "-m", "agent.cli"]

    def start(rid: str, document: Path, *dry_run: str) -> subprocess.CompletedProcess[str]:
        spec = tmp_path / f"{rid}.toml"
        spec.write_text(f'[rollout]\nname = "gateway"\nkind = "release"\nartifact = "{document}"\n'
                        '[waves]\ncanary = 1\npercents = [100.0]\n[device]\ntimeout_s = 240\n'
                        '[gates]\nfailure_threshold_pct = 10.0\nfailure_action = "abort"\n')
        return subprocess.run([*cli, "rollout", "start", str(spec), "--db", str(db), "--id", rid, *dry_run],
                              capture_output=True, text=True, env=env, timeout=60)

    def roll(rid: str, document: Path) -> dict[str, Any]:
        started = start(rid, document)
        assert started.returncode == 0, started.stdout + started.stderr
        deadline = time.monotonic() + 400
        while True:
            out = subprocess.run([*cli, "rollout", "status", rid, "--db", str(db), "--json", "--devices"],
                                 capture_output=True, text=True, env=env, timeout=60)
            data: dict[str, Any] = json.loads(out.stdout)
            if data["state"] not in ("running", "scheduled") or time.monotonic() > deadline:
                return data
            time.sleep(0.5)

    def running(name: str) -> str:
        """The firmware a device's heartbeat says it runs, as the leader's registry has it."""
        out = subprocess.run([*cli, "status", "--device", name, "--db", str(db), "--json"], capture_output=True,
                             text=True, env=env, timeout=60)
        return str(json.loads(out.stdout)["device"]["firmware_version"])

    try:
        deadline = time.monotonic() + 60
        while registered(db) < len(DEVICES):
            assert time.monotonic() < deadline, "the workers never registered"
            time.sleep(0.2)
        r2 = _release(tmp_path / "r2", keys.private, version="1.1.0", firmware="1.1.0", document="mode = 'good'\n")
        data = roll("r2", r2)
        assert data["state"] == "succeeded", data
        rows = data["device_list"]
        assert all(d["state"] == "succeeded" and "converged" in d["detail"] for d in rows), rows
        for name in DEVICES:
            assert (tmp_path / name / "etc" / "app" / "app.toml").read_text() == "mode = 'good'\n"
            journal = json.loads((tmp_path / name / "config" / "app" / "journal.json").read_text())
            assert (journal["state"], journal["version"], journal.get("held")) == ("committed", "1.1.0", False)
        deadline = time.monotonic() + 60
        while {running(n) for n in DEVICES} != {"1.1.0"}:
            assert time.monotonic() < deadline, [running(n) for n in DEVICES]
            time.sleep(0.5)

        r3 = _release(tmp_path / "r3", keys.private, version="1.2.0", firmware="1.2.0", document="mode = 'bad'\n")
        plan = start("r3", r3, "--dry-run")  # each device's change, part by part; nothing starts
        assert plan.returncode == 0, plan.stderr
        for name in DEVICES:
            assert f"  {name}  firmware 1.1.0 → 1.2.0, config:app 1.1.0 → 1.2.0\n" in plan.stdout, plan.stdout
        data = roll("r3", r3)
        assert data["state"] == "aborted", data
        by_state = {d["state"]: d for d in data["device_list"]}
        canary = by_state["rolled_back"]
        assert canary["from_version"] == "firmware 1.1.0, config:app 1.1.0", canary  # what it ran of the parts
        assert "config:app failed" in canary["detail"] and "taken back whole" in canary["detail"], canary
        assert set(by_state) == {"rolled_back", "canceled"}  # the other device was never offered it
        for name in DEVICES:  # every part on R2: the document byte for byte, the firmware 1.1.0
            assert (tmp_path / name / "etc" / "app" / "app.toml").read_text() == "mode = 'good'\n"
            journal = json.loads((tmp_path / name / "config" / "app" / "journal.json").read_text())
            assert (journal["version"], journal.get("held", False)) == ("1.1.0", False), journal
        deadline = time.monotonic() + 60
        while {running(n) for n in DEVICES} != {"1.1.0"}:
            assert time.monotonic() < deadline, [running(n) for n in DEVICES]
            time.sleep(0.5)
        # the leader says which release each device runs, and what drifted from it
        status = subprocess.run([*cli, "status", "--db", str(db)], capture_output=True, text=True, env=env,
                                timeout=60).stdout
        assert "release gateway 1.1.0 (rollout r2): 2 of the 2 devices it converged on run it whole" in status, status
        (tmp_path / "pi-1" / "etc" / "app" / "app.toml").write_text("mode = 'good'\nedited = true\n")
        said = ""
        deadline = time.monotonic() + 120
        while "DRIFTED" not in said:
            assert time.monotonic() < deadline, said
            time.sleep(0.5)
            said = subprocess.run([*cli, "status", "--device", "pi-1", "--db", str(db)], capture_output=True,
                                  text=True, env=env, timeout=60).stdout
        assert "release: gateway 1.1.0 (rollout r2): DRIFTED: config:app 1.1.0: app.toml changed on the device" in said
        status = subprocess.run([*cli, "status", "--db", str(db)], capture_output=True, text=True, env=env,
                                timeout=60).stdout
        assert "1 of the 2 devices it converged on run it whole; 1 drifted: pi-1 (config:app 1.1.0" in status, status
        with serving(db) as console:  # and the console
            _, _, fleet = request(console, "GET", "/", headers=BEARER)
            table = fleet.split('<table id="fleet-releases" data-live>')[1].split("</table>")[0]
            assert "<td>gateway 1.1.0</td>" in table and "<td>2</td><td class=\"online\">1</td>" in table, table
            assert "pi-1</a>: config:app 1.1.0: app.toml changed on the device" in table, table
            _, _, device = request(console, "GET", "/devices/pi-0", headers=BEARER)
            assert 'class="online">gateway 1.1.0 (rollout' in device and "runs every part of it" in device
        assert all(p.poll() is None for p in procs)  # nothing crashed on the way
    finally:
        stop(procs)
        for log in logs:
            log.close()
