"""`edge-agent simulate --rollout SPEC.toml` warns, in one line naming the file and the key, about
a soak shorter than the simulated devices' heartbeat interval through a soak (their fast 5 s: a
device whose next beat comes after the soak ends counts as failed), and runs anyway; a soak
covering a heartbeat gets no warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli import main as cli_main
from agent.sim.rollout import HEARTBEAT_S
from firmware_rollout.artifact.fixture import make_artifact

SPEC = """\
[rollout]
name = "lab"
artifact = "{artifact}"

[waves]
canary = 1
percents = [100.0]

[gates]
success_threshold_pct = 100.0
soak_s = {soak}
"""


def run(tmp_path: Path, soak: float, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    artifact, public = make_artifact(tmp_path / "build")
    spec = tmp_path / f"soak-{soak:g}.toml"
    spec.write_text(SPEC.format(artifact=artifact, soak=soak))
    code = cli_main(["simulate", "--rollout", str(spec), "--public-key", str(public), "--devices", "4",
                     "--seed", "2", "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_soak_shorter_than_the_heartbeat_is_one_warning_line(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert HEARTBEAT_S == 30.0
    code, out, err = run(tmp_path, 2, capsys)
    spec = tmp_path / "soak-2.toml"
    assert err.splitlines() == [
        f"warning: {spec}: gates.soak_s = 2 is shorter than the simulated devices' heartbeat interval (5 s):"
        " the soak can end before a device's next heartbeat, and the device then counts as failed;"
        " make soak_s at least 5"
    ]
    # a warning, not a refusal: the run happens, and shows what the warning says
    assert code == 0
    assert "wave 1 (canary) failed its success gate: soak: 0 of 1 kept heartbeating" in out


def test_a_soak_covering_a_heartbeat_gets_no_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(tmp_path, 30, capsys)
    assert err == ""
    assert code == 0
    assert "succeeded after" in out
