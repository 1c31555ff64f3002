"""The simulator against a real mosquitto (`--broker`): a few dozen devices on the wall clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.sim import SimOptions, Simulation

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]


async def test_a_few_dozen_devices_over_a_real_broker(tmp_path: Path, mosquitto) -> None:  # noqa: ANN001
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


async def test_a_wave_rollout_over_a_real_broker(tmp_path: Path, mosquitto) -> None:  # noqa: ANN001
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
