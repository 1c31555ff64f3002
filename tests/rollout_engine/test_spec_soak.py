"""A soak shorter than the devices' heartbeat interval is a warning (one line naming the spec
file and the key), never an error: the spec still loads and runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_engine.spec import load_spec, soak_warning

SPEC = """\
[rollout]
name = "lab"
artifact = "fw.eafw"

[waves]
canary = 1
percents = [100.0]

[gates]
soak_s = {soak}
"""


def spec_file(tmp_path: Path, soak: float) -> Path:
    path = tmp_path / "rollout.toml"
    path.write_text(SPEC.format(soak=soak))
    return path


def test_a_soak_shorter_than_the_heartbeat_is_named_with_its_file_and_key(tmp_path: Path) -> None:
    path = spec_file(tmp_path, 20)
    warning = soak_warning(load_spec(path), heartbeat_s=30.0, source=str(path))
    assert warning == (f"{path}: gates.soak_s = 20 is shorter than the devices' heartbeat interval (30 s):"
                       " the soak can end before a device's next heartbeat, and the device then counts as"
                       " failed; make soak_s at least 30")
    assert "\n" not in warning


@pytest.mark.parametrize("soak", [0, 30, 900])
def test_no_soak_or_one_covering_a_heartbeat_is_fine(tmp_path: Path, soak: float) -> None:
    path = spec_file(tmp_path, soak)
    assert soak_warning(load_spec(path), heartbeat_s=30.0, source=str(path)) is None


def test_the_devices_are_named_as_given(tmp_path: Path) -> None:
    path = spec_file(tmp_path, 1.5)
    warning = soak_warning(load_spec(path), heartbeat_s=5.0, source="r.toml", devices="simulated devices")
    assert warning is not None
    assert warning.startswith("r.toml: gates.soak_s = 1.5 is shorter than the simulated devices' heartbeat"
                              " interval (5 s)")
