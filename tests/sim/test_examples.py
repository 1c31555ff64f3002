"""The shipped examples: the rollout spec under configs/rollouts/ loads, plans, goes through the
`edge-agent rollout` CLI and rolls out on a simulated fleet; every agent config under configs/
passes `edge-agent config check`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rollout_support import FakePort, engine_kinds

from agent.cli import main as cli
from agent.core.clock import VirtualClock
from agent.core.config import AgentConfig, load_config
from agent.core.errors import ConfigError, RolloutError
from agent.leader.registry import DeviceRegistry
from agent.protocol import Heartbeat
from agent.sim.rollout import wave_rollout_scenario
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.orchestrator import Orchestrator
from rollout_engine.plan import wave_sizes
from rollout_engine.spec import RolloutSpec, load_spec
from rollout_engine.store import RolloutStore

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
def test_config_check_passes_on_every_agent_config(path: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """With the files a device would have in place (config check looks at them as run does)."""
    from rollout_engine.keys import generate_keypair

    keys = generate_keypair(tmp_path / "keys")
    text = path.read_text().replace("/etc/edge-agent/fleet-public.pem", str(keys.public))
    text = text.replace("/usr/local/bin/camera-selftest", "/bin/true")
    # the install helper's user and socket group (install.sh makes them): ones this machine has
    text = text.replace('helper_user = "edge-agent"', 'helper_user = "daemon"')
    text = text.replace('helper_group = "edge-agent-installer"', 'helper_group = "daemon"')
    placed = tmp_path / path.name
    placed.write_text(text)
    assert cli(["config", "check", str(placed)]) == 0
    assert capsys.readouterr().out.startswith(f"{placed}: ok (")


def test_config_check_looks_at_the_files_a_config_names(capsys: pytest.CaptureFixture[str]) -> None:
    path = CONFIGS / "worker-firmware.toml"
    assert cli(["config", "check", str(path)]) == 2  # this machine has no fleet key in /etc/edge-agent
    assert "firmware.public_key: cannot read key file /etc/edge-agent/fleet-public.pem" in capsys.readouterr().err


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


def register(db: Path, versions: dict[str, str]) -> None:
    """Devices as the leader's registry has them after their heartbeats (the CLI plans against it)."""
    registry = DeviceRegistry.open(db, clock=VirtualClock())
    try:
        registry.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, firmware_version=v)
                                   for d, v in versions.items()])
    finally:
        registry.close()


async def test_the_example_spec_through_the_rollout_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = spec_beside_artifacts(tmp_path)
    db = tmp_path / "leader.db"
    RolloutStore.open(db, clock=VirtualClock()).close()
    register(db, {"cam-a": "1.0.0", "cam-b": "1.0.0", "cam-c": "1.1.0", "cam-d": ""})
    assert cli(["rollout", "start", str(spec), "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "canary wave (5) would take all 2 targeted devices" in err
    assert "[2 of the 4 devices the leader knows are targeted; versions: 1.0.0 x2, 1.1.0 x1, unknown x1]" in err

    # The fleet the leader knows: its registry and its port hold the same 40 devices (the command
    # plans the waves against the registry, the leader starts them as planned).
    fleet = {f"cam-{i:03d}": "1.0.0" for i in range(40)}
    db = tmp_path / "fleet" / "leader.db"
    db.parent.mkdir()
    RolloutStore.open(db, clock=VirtualClock()).close()
    register(db, fleet)
    rid = "camera-1.1.0-with-a-long-id"
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", rid, "--no-wait"]) == 0
    clock = VirtualClock()
    store = RolloutStore.open(db, clock=clock)
    try:
        await Orchestrator(store, clock=clock, port=FakePort(clock, sorted(fleet)), kinds=engine_kinds()).tick()
    finally:
        store.close()
    capsys.readouterr()
    assert cli(["rollout", "status", rid, "--devices", "--json", "--db", str(db)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [w["size"] for w in data["waves"]] == [5, 4, 10, 21]
    rows = data["device_list"]
    assert sorted(r["device"] for r in rows) == sorted(fleet)
    assert {r["state"] for r in rows if r["wave"] == 0} == {"notified"}
    assert {r["state"] for r in rows if r["wave"] > 0} == {"queued"}

    assert cli(["rollout", "status", rid, "--devices", "--db", str(db)]) == 0
    screen = capsys.readouterr().out
    assert "device" in screen and "cam-000" in screen and "notified" in screen
    assert cli(["rollout", "list", "--db", str(db)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split() == ["id", "name", "version", "state", "wave", "devices", "succeeded"]
    assert listed[1].split()[0] == rid  # never shortened, whatever the terminal's width
    assert cli(["rollout", "status", "nope", "--db", str(db)]) == 2
    assert "no rollout 'nope'" in capsys.readouterr().err


def test_control_help_says_what_each_control_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli(["rollout", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "next a rollout" not in text and "approve a rollout" not in text
    assert "end the current wave now and start the next one" in text
