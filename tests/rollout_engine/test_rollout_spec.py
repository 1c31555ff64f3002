"""Rollout spec validation (errors name file and key) and the deterministic wave plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.core.errors import ConfigError, RolloutError
from rollout_engine.plan import DeviceInfo, plan_waves, select_targets, wave_sizes
from rollout_engine.spec import (
    Ramp,
    WavesSection,
    load_spec,
    spec_from_dict,
)

GOOD = """
[rollout]
name = "cam 1.2.0"
artifact = "fw.eafw"
seed = 4

[targets]
select = "tags"
tags = ["cam"]
include_new = true

[waves]
canary = 2
percents = [20, 30, 50]

[gates]
success_threshold_pct = 95
soak_s = 120
manual_approval = true
failure_threshold_pct = 10
min_finished = 5
failure_action = "pause"

[device]
timeout_s = 86400
retries = 2
retry_backoff_s = 30
maintenance_windows = ["22:00-04:00"]

[download]
servers = 3
mailbox_capacity = 2
chunk_size = 4096
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def test_a_full_spec_loads_with_the_artifact_resolved(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.rollout.artifact == str((tmp_path / "fw.eafw").resolve())
    assert spec.targets.tags == ["cam"] and spec.targets.include_new
    assert spec.waves.percents == [20, 30, 50]
    assert spec.gates.failure_action == "pause" and spec.gates.manual_approval
    assert spec.device.maintenance_windows == ["22:00-04:00"]
    assert spec.download.servers == 3


@pytest.mark.parametrize(
    ("change", "key", "reason"),
    [
        (('percents = [20, 30, 50]', 'percents = [20, 30]'), "waves.percents", "add up to 100"),
        (('percents = [20, 30, 50]', 'percents = [20, 80]\ncounts = [3]'), "waves", "exactly one"),
        (('percents = [20, 30, 50]', ''), "waves", "exactly one"),
        (('failure_action = "pause"', 'failure_action = "explode"'), "gates.failure_action", "explode"),
        (('["22:00-04:00"]', '["25:00-04:00"]'), "device.maintenance_windows.0", "HH:MM-HH:MM"),
        (('tags = ["cam"]', 'tags = []'), "targets.tags", "at least one tag"),
        (('servers = 3', 'servers = 0'), "download.servers", ">= 1"),
        (('seed = 4', 'seed = 4\ncolour = "red"'), "rollout.colour", "unknown key"),
        (('name = "cam 1.2.0"\n', ''), "rollout.name", "required key is missing"),
        (('chunk_size = 4096', 'chunk_size = 10'), "download.chunk_size", "256"),
        (('chunk_size = 4096', 'mirrors = ["ftp://cdn/fw"]'), "download.mirrors.0", "http://"),
        (('select = "tags"\n', ''), "targets.tags", 'select = "tags"'),
    ],
)
def test_mistakes_name_the_file_and_the_key(tmp_path: Path, change: tuple[str, str], key: str, reason: str) -> None:
    old, new = change
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert err.value.key == key
    assert reason in err.value.reason
    assert str(path) in str(err.value)


def test_not_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_spec(write(tmp_path, "[rollout\n"))
    with pytest.raises(ConfigError, match="file not found"):
        load_spec(tmp_path / "nope.toml")


def waves(**kw: object) -> WavesSection:
    return WavesSection(**kw)  # type: ignore[arg-type]


def test_wave_sizes() -> None:
    assert wave_sizes(waves(canary=2, counts=[3, 5]), 20) == [2, 3, 5, 10]  # the rest forms a last wave
    assert wave_sizes(waves(counts=[10, 10]), 12) == [10, 2]
    assert wave_sizes(waves(canary=1, percents=[50, 50]), 11) == [1, 5, 5]
    assert wave_sizes(waves(percents=[10, 30, 60]), 200) == [20, 60, 120]
    assert wave_sizes(waves(ramp=Ramp(base=2, factor=3.0)), 30) == [2, 6, 18, 4]
    with pytest.raises(RolloutError, match="no device"):
        wave_sizes(waves(percents=[1, 99]), 20)  # 1% of 20 rounds to 0
    with pytest.raises(RolloutError, match="canary"):
        wave_sizes(waves(canary=5, counts=[1]), 5)
    with pytest.raises(RolloutError, match="no device matches"):
        wave_sizes(waves(counts=[1]), 0)


def spec(tmp_path: Path, **sections: dict[str, object]) -> object:
    data: dict[str, object] = {"rollout": {"name": "t", "artifact": str(tmp_path / "a"), "seed": 7},
                               "waves": {"canary": 2, "percents": [40, 60]}}
    data.update(sections)
    return spec_from_dict(data)


def test_the_plan_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    s = spec(tmp_path)
    ids = [f"d{i}" for i in range(50)]
    first = plan_waves(s, ids)  # type: ignore[arg-type]
    assert first == plan_waves(s, list(reversed(ids)))  # type: ignore[arg-type]
    assert [len(w) for w in first] == [2, 19, 29]
    assert sorted(sum(first, [])) == sorted(ids)
    assert first != plan_waves(s, ids, seed=8)  # type: ignore[arg-type]


def test_target_selectors(tmp_path: Path) -> None:
    devices = [DeviceInfo("a", "1.0.0", ("cam",)), DeviceInfo("b", "1.0.0", ("gw",)),
               DeviceInfo("c", "0.9.0", ("cam",)), DeviceInfo("d", "1.1.0", ("cam",))]
    everyone = spec(tmp_path)
    assert select_targets(everyone, devices, target_version="1.1.0") == ["a", "b", "c"]  # type: ignore[arg-type]
    cams = spec(tmp_path, targets={"select": "tags", "tags": ["cam"]})
    assert select_targets(cams, devices, target_version="1.1.0") == ["a", "c"]  # type: ignore[arg-type]
    old = spec(tmp_path, targets={"select": "versions", "versions": ["0.9.0"]})
    assert select_targets(old, devices, target_version="1.1.0") == ["c"]  # type: ignore[arg-type]


def test_targets_match_what_devices_report_of_themselves(tmp_path: Path) -> None:
    pi4 = (("arch", "aarch64"), ("board", "Raspberry Pi 4 Model B Rev 1.4"))
    devices = [DeviceInfo("a", "1.0.0", (), facts=pi4), DeviceInfo("b", "1.0.0", (), facts=(("arch", "x86_64"),)),
               DeviceInfo("c", "1.0.0", ("cam",), facts=pi4), DeviceInfo("d", "1.0.0", ())]
    boards = spec(tmp_path, targets={"match": {"arch": "aarch64", "board": "Raspberry Pi 4*"}})
    assert select_targets(boards, devices, target_version=None) == ["a", "c"]  # type: ignore[arg-type]
    cams = spec(tmp_path, targets={"select": "tags", "tags": ["cam"], "match": {"arch": "aarch64"}})
    assert select_targets(cams, devices, target_version=None) == ["c"]  # type: ignore[arg-type]
    from rollout_engine.plan import exclusion

    assert exclusion(boards, devices[1], target_version=None) == "its arch is 'x86_64', not 'aarch64'"
    assert exclusion(boards, devices[3], target_version=None) == "no arch reported"
    with pytest.raises(ConfigError, match="targets.match"):
        spec(tmp_path, targets={"match": {"Arch!": "x"}})
