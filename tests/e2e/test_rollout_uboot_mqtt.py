"""A rollout that changes what a device boots, end to end: a leader and a worker as `edge-agent
run` processes over a real mosquitto, the worker's `[firmware] installer = "uboot"` on the bench
board (`scripts/bench_board.py`) with Debian's fw_setenv. Its reboot command SIGKILLs the agent
(the power goes as a reboot takes it); the test then power-cycles the board, where Debian's real
U-Boot in QEMU reads the environment our backend wrote and chooses the slot (an attempt is spent,
the command line says which), and starts the agent again, as systemd does after a reboot."""

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
from ubootboard import QemuBoard, UBootBench

from firmware_rollout.artifact.files import read_signed_manifest
from firmware_rollout.artifact.fixture import make_artifact

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.mqtt, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(bool(UBootBench.missing()), reason=f"needs {UBootBench.missing()}")]


class Fleet:
    def __init__(self, tmp: Path, url: str, health_command: list[str] | None = None) -> None:
        self.tmp = tmp
        self.env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.artifact, public = make_artifact(tmp, chunk_size=4096, size=40_000)
        self.board = QemuBoard(tmp / "board")
        health = f"health_command = {json.dumps(health_command)}\n" if health_command else ""
        self.leader_config = agent_config(tmp, "gw", "leader", url, f'[firmware]\npublic_key = "{public}"\n')
        self.worker_config = agent_config(
            tmp, "pi-1", "worker", url,
            f'[firmware]\npublic_key = "{public}"\ninstaller = "uboot"\nhealth_timeout_s = 60\n{health}'
            f'reboot_command = ["sh", "-c", "kill -KILL $PPID"]\n' + self.board.toml())
        self.leader = self._run(self.leader_config, "gw")
        self.worker = self._run(self.worker_config, "pi-1")
        self.db = tmp / "gw" / "leader.db"

    def _run(self, config: Path, name: str) -> subprocess.Popen[bytes]:
        with (self.tmp / f"{name}.log").open("ab") as log:
            return subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
                                    stdout=log, stderr=log, env=self.env)

    def rollout(self, rid: str) -> dict[str, Any]:
        """Start a rollout and drive the board through its reboots until it ends."""
        deadline = time.monotonic() + 60
        while registered(self.db) < 1:
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.2)
        spec = self.tmp / "spec.toml"
        spec.write_text(f'[rollout]\nname = "lab"\nartifact = "{self.artifact}"\n[waves]\ncounts = [1]\n'
                        '[device]\ntimeout_s = 120\n')
        cli = [sys.executable, "-m", "agent.cli", "rollout"]
        started = subprocess.run([*cli, "start", str(spec), "--db", str(self.db), "--id", rid], capture_output=True,
                                 text=True, env=self.env, timeout=60)
        assert started.returncode == 0, started.stderr
        deadline = time.monotonic() + 240
        while True:
            if self.worker.poll() is not None:  # the reboot command took the agent down: power on again
                self.board.boot()
                self.worker = self._run(self.worker_config, "pi-1")
            out = subprocess.run([*cli, "status", rid, "--db", str(self.db), "--json"], capture_output=True,
                                 text=True, env=self.env, timeout=60)
            data: dict[str, Any] = json.loads(out.stdout)
            if data["state"] not in ("running", "scheduled") or time.monotonic() > deadline:
                return data
            time.sleep(0.2)

    def image(self) -> bytes:
        signed = read_signed_manifest(self.artifact)
        return self.artifact.read_bytes()[signed.size:]

    def logs(self) -> str:
        return "\n".join((self.tmp / f"{n}.log").read_text(errors="replace")[-3000:] for n in ("gw", "pi-1"))

    def stop(self) -> None:
        stop([self.worker, self.leader])


def test_a_rollout_writes_the_inactive_slot_boots_it_and_commits_it_in_uboot(tmp_path: Path,
                                                                            mosquitto: Mosquitto) -> None:
    fleet = Fleet(tmp_path, f"mqtt://127.0.0.1:{mosquitto.port}")
    try:
        data = fleet.rollout("uboot-1")
        assert data["state"] == "succeeded", (data, fleet.logs())
        assert fleet.board.boots == ["B"]  # one reboot, into the new slot
        env = fleet.board.printenv()
        assert (env["BOOT_ORDER"], env["BOOT_B_LEFT"]) == ("B A", "3") and "EA_TRIAL" not in env
        image = fleet.image()
        assert fleet.board.slots["B"].read_bytes()[:len(image)] == image
        assert fleet.board.slots["A"].read_bytes() == bytes(len(fleet.board.slots["A"].read_bytes()))
    finally:
        fleet.stop()


def test_a_trial_boot_that_fails_its_health_check_goes_back_to_the_old_slot(tmp_path: Path,
                                                                            mosquitto: Mosquitto) -> None:
    fleet = Fleet(tmp_path, f"mqtt://127.0.0.1:{mosquitto.port}", health_command=["false"])
    try:
        data = fleet.rollout("uboot-2")
        assert (data["state"], data["counts"]) == ("aborted", {"rolled_back": 1}), (data, fleet.logs())
        assert fleet.board.boots == ["B", "A"]  # the trial, then back
        env = fleet.board.printenv()
        assert (env["BOOT_ORDER"], env["BOOT_A_LEFT"], env["BOOT_B_LEFT"]) == ("A B", "3", "0")
        assert "EA_TRIAL" not in env
    finally:
        fleet.stop()
