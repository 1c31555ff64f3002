"""The simulator against a real mosquitto (`--broker`): a few dozen devices on the wall clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.sim import SimOptions, Simulation

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]


async def test_a_few_dozen_devices_over_a_real_broker(tmp_path: Path, mosquitto) -> None:
    opts = SimOptions(devices=24, duration_s=6.0, seed=4, heartbeat_s=1.0, leader_interval_s=1.0,
                      telemetry_s=2.0, jobs=12, job_work_s=0.1, broker_url=mosquitto.url, progress=False,
                      drain_s=30.0)
    report = await Simulation(opts, workdir=tmp_path).run()
    assert report["scenario"]["transport"] == "mqtt" and report["scenario"]["clock"] == "realtime"
    assert report["lost"] == 0 and report["conservation_ok"] is True
    assert report["drained"] is True
    assert report["leader"]["devices_known"] == 24
    assert report["at_end"]["online"] == 24
    assert report["heartbeats"]["applied_by_leader"] > 0
    assert report["telemetry"]["applied_by_leader"] == report["telemetry"]["generated"] > 0
    assert report["jobs"]["confirmed"] == 12


async def test_a_wave_rollout_over_a_real_broker(tmp_path: Path, mosquitto) -> None:
    """The rollout scenario on the wall clock through mosquitto: real workers with the updater,
    offers, chunk requests and reports over MQTT."""
    from agent.sim.rollout import rollout_options, run_rollout

    opts = rollout_options(devices=4, seed=1, heartbeat_s=2.0, leader_interval_s=1.0, broker_url=mosquitto.url,
                           progress=False, drain_s=30.0)
    report = await run_rollout(opts, workdir=tmp_path, series_every_s=None,
                               spec_overrides={"waves": {"canary": 1, "percents": [100.0]},
                                               "gates": {"soak_s": 5.0, "min_finished": 1}})
    rollout = report["rollout"]
    assert rollout["state"] == "succeeded", rollout["detail"]
    assert report["outcomes"] == {"succeeded": 4}
    assert report["fleet"]["versions"] == {"1.1.0": 4}
    assert report["downloads"]["served"] > 0
    assert report["lost"] == 0 and report["conservation_ok"] is True


def test_two_shards_of_one_fleet_against_one_mosquitto(tmp_path: Path, mosquitto) -> None:
    """`--shard 1/2` runs the leader and part of the devices, `--shard 2/2` the rest: two processes
    (two machines, for a fleet too large for one) against one broker and one leader."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    common = ["--broker", mosquitto.url, "--devices", "16", "--duration", "8s", "--heartbeat", "1s",
              "--leader-interval", "1s", "--telemetry", "2s", "--jobs", "8", "--seed", "3", "--quiet"]
    runs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "simulate", *common, "--shard", f"{k}/2",
                              "--report", str(tmp_path / f"shard{k}.json"), "--data-dir", str(tmp_path / f"d{k}")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for k in (1, 2)]
    outputs = [run.communicate(timeout=170) for run in runs]
    for run, (out, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, out + err
    leader_shard = json.loads((tmp_path / "shard1.json").read_text())
    other = json.loads((tmp_path / "shard2.json").read_text())
    assert leader_shard["scenario"]["shard"] == "1/2" and other["scenario"]["shard"] == "2/2"
    here = [leader_shard["at_end"]["devices"], other["scenario"]["devices_here"]]
    assert sum(here) == 16 and all(n > 0 for n in here)
    assert leader_shard["leader"]["devices_known"] == 16  # one leader for both shards' devices
    assert leader_shard["lost"] == 0 and leader_shard["conservation_ok"] is True
    assert leader_shard["telemetry"]["applied_by_leader"] == leader_shard["telemetry"]["generated"] > 0
    assert leader_shard["jobs"]["confirmed"] == 8
    # the other shard's telemetry, every record acknowledged by the leader in shard 1
    tel = other["telemetry"]
    assert other["lost"] == 0 and tel["generated"] > 0 and tel["pending"] == 0
    assert tel["direct"] + tel["delivered_from_outbox"] == tel["generated"]
    assert "shard 2/2" in outputs[1][0]
