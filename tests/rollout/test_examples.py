"""The shipped examples: the rollout spec under configs/rollouts/ loads, plans and rolls out on a
simulated fleet; every agent config under configs/ passes `edge-agent config check`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.cli import main as cli
from agent.core.config import AgentConfig, load_config
from agent.core.errors import ConfigError, RolloutError
from firmware_rollout.plan import wave_sizes
from firmware_rollout.scenario import make_artifact, wave_rollout_scenario
from firmware_rollout.spec import RolloutSpec, load_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SPEC = CONFIGS / "rollouts" / "rollout.toml"
AGENT_CONFIGS = sorted(CONFIGS.glob("*.toml"))


def test_the_example_spec_loads_with_every_section_set() -> None:
    spec = load_spec(SPEC)
    assert isinstance(spec, RolloutSpec)
    assert spec.waves.canary > 0 and spec.waves.percents is not None
    assert spec.targets.select == "versions" and spec.targets.versions
    gates = spec.gates
    assert 0 < gates.success_threshold_pct <= 100 and gates.soak_s > 0
    assert gates.failure_threshold_pct < 100 and gates.min_finished > 1
    assert spec.device.timeout_s > 0 and spec.device.retries >= 1
    assert spec.download.servers * spec.download.mailbox_capacity <= 8  # a small download bound
    # relative artifact paths are resolved against the spec's directory
    assert Path(spec.rollout.artifact) == SPEC.parent / "camera-1.1.0.eafw"
    assert Path(spec.rollout.rollback_artifact).parent == SPEC.parent


def test_the_example_spec_plans_a_fleet_and_refuses_one_too_small() -> None:
    spec = load_spec(SPEC)
    sizes = wave_sizes(spec.waves, 300)
    assert len(sizes) == 1 + len(spec.waves.percents or [])
    assert sizes[0] == spec.waves.canary and sum(sizes) == 300 and min(sizes) > 0
    with pytest.raises(RolloutError, match="canary"):
        wave_sizes(spec.waves, 3)


def test_rollout_specs_are_kept_out_of_the_agent_config_directory() -> None:
    # tests/core/test_config.py loads every configs/*.toml as an agent config
    for path in AGENT_CONFIGS:
        assert isinstance(load_config(path), AgentConfig)
    for path in sorted((CONFIGS / "rollouts").glob("*.toml")):
        with pytest.raises(ConfigError):
            load_config(path)


@pytest.mark.parametrize("path", AGENT_CONFIGS, ids=lambda p: p.name)
def test_config_check_passes_on_every_agent_config(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: ok (")


def test_the_firmware_worker_example_turns_updates_on() -> None:
    config = load_config(CONFIGS / "worker-firmware.toml")
    assert config.agent.role == "worker"
    assert config.firmware.public_key and config.firmware.health_command
    assert config.agent.firmware_version == load_spec(SPEC).targets.versions[0]


def spec_beside_artifacts(work: Path) -> Path:
    """The example spec copied next to a signed camera-1.1.0 artifact and its public key."""
    artifact, _ = make_artifact(work, version="1.1.0", chunk_size=4096, size=6 * 4096)
    shutil.move(artifact, work / "camera-1.1.0.eafw")
    shutil.copy(work / "keys" / "public.pem", work / "public.pem")
    spec = work / "rollout.toml"
    shutil.copy(SPEC, spec)
    return spec


@pytest.mark.slow
async def test_the_example_spec_rolls_out_on_a_simulated_fleet(tmp_path: Path) -> None:
    spec = spec_beside_artifacts(tmp_path / "user")
    report = await wave_rollout_scenario(devices=60, seed=3, work_dir=tmp_path / "sim", spec_path=spec)
    assert report["rollout"]["state"] == "succeeded", report["rollout"]["detail"]
    assert [w["size"] for w in report["rollout"]["waves"]] == [5, 6, 16, 33]
    assert report["fleet"]["versions"] == {"1.1.0": 60}
    downloads = report["downloads"]
    assert downloads["max_concurrent"] <= downloads["bound"]


@pytest.mark.slow
async def test_the_example_spec_aborts_when_a_tenth_of_the_fleet_fails(tmp_path: Path) -> None:
    spec = spec_beside_artifacts(tmp_path / "user")
    report = await wave_rollout_scenario(devices=60, seed=3, fail_rate=0.1, work_dir=tmp_path / "sim",
                                         spec_path=spec)
    rollout = report["rollout"]
    assert rollout["state"] == "aborted", rollout["detail"]
    assert rollout["devices_offered_after_abort"] == 0
    assert rollout["counts"].get("canceled", 0) > 0  # the rest of the fleet was never offered the image
