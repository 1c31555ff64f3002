"""`edge-agent simulate --rollout SPEC.toml --public-key PATH`: the key the simulated devices pin.
A missing or malformed key is one line naming the option and the path (exit 2, no traceback)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.cli import main as cli_main
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.keys import generate_keypair

SPEC = """\
[rollout]
name = "lab"
artifact = "{artifact}"

[waves]
canary = 1
percents = [50.0, 50.0]

[gates]
success_threshold_pct = 90.0
soak_s = 60
"""


@pytest.fixture
def spec(tmp_path: Path) -> tuple[Path, Path]:
    """A spec whose artifact has no public.pem beside it, and the key that signed it."""
    artifact, public = make_artifact(tmp_path / "build")
    shipped = tmp_path / "fw" / artifact.name
    shipped.parent.mkdir()
    shutil.copy(artifact, shipped)
    path = tmp_path / "rollout.toml"
    path.write_text(SPEC.format(artifact=shipped))
    return path, public


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def test_help_documents_public_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["simulate", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--public-key PATH with --rollout: the fleet's public key the devices pin" in text
    assert "(default: public.pem beside the artifact)" in text


def test_a_missing_key_names_the_option_and_the_path(spec: tuple[Path, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = spec
    missing = tmp_path / "nowhere" / "public.pem"
    assert cli_main(["simulate", "--rollout", str(path), "--public-key", str(missing), "--devices", "4"]) == 2
    assert one_error_line(capsys) == f"edge-agent simulate: --public-key: {missing}: no such file"


def test_no_key_beside_the_artifact_points_to_the_option(spec: tuple[Path, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = spec
    assert cli_main(["simulate", "--rollout", str(path), "--devices", "4"]) == 2
    line = one_error_line(capsys)
    assert line == ("edge-agent simulate: --public-key: not given, and there is no public.pem beside the artifact"
                    f" ({tmp_path / 'fw' / 'public.pem'}): give the fleet's public key with --public-key PATH")


def test_a_directory_is_not_a_key(spec: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    path, public = spec
    keys = public.parent
    assert cli_main(["simulate", "--rollout", str(path), "--public-key", str(keys), "--devices", "4"]) == 2
    assert one_error_line(capsys) == (f"edge-agent simulate: --public-key: {keys}: a directory, not a key file"
                                      f" (e.g. {keys / 'public.pem'})")


def test_a_missing_artifact_is_named_before_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rollout.toml"
    path.write_text(SPEC.format(artifact=tmp_path / "missing.eafw"))
    assert cli_main(["simulate", "--rollout", str(path), "--devices", "4"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"edge-agent simulate: --rollout: {path}: artifact {tmp_path / 'missing.eafw'}: ")


@pytest.mark.parametrize("content", [b"not a key\n", b""])
def test_a_malformed_key_names_the_option_and_the_path(spec: tuple[Path, Path], tmp_path: Path, content: bytes,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = spec
    bad = tmp_path / "bad.pem"
    bad.write_bytes(content)
    assert cli_main(["simulate", "--rollout", str(path), "--public-key", str(bad), "--devices", "4"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"edge-agent simulate: --public-key: {bad}: not a PEM public key")


def test_a_private_key_is_refused(spec: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    path, public = spec
    private = public.parent / "private.pem"
    assert cli_main(["simulate", "--rollout", str(path), "--public-key", str(private), "--devices", "4"]) == 2
    assert one_error_line(capsys).startswith(f"edge-agent simulate: --public-key: {private}: ")


def test_public_key_needs_rollout(spec: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, public = spec
    assert cli_main(["simulate", "--scenario", "wave-rollout", "--public-key", str(public)]) == 2
    assert one_error_line(capsys).startswith("edge-agent simulate: --public-key: applies with --rollout SPEC.toml")


def test_the_given_key_is_pinned(spec: tuple[Path, Path], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    path, public = spec
    report = tmp_path / "r.json"
    assert cli_main(["simulate", "--rollout", str(path), "--public-key", str(public), "--devices", "6",
                     "--quiet", "--report", str(report)]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    assert "succeeded after" in out.out and "  wave 1 (canary): 1 device, passed: succeeded 1" in out.out


def test_a_key_that_did_not_sign_the_artifact_is_a_warning(spec: tuple[Path, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = spec
    other = generate_keypair(tmp_path / "other")
    code = cli_main(["simulate", "--rollout", str(path), "--public-key", str(other.public), "--devices", "6",
                     "--quiet"])
    out = capsys.readouterr()
    assert out.err.startswith("warning: ") and str(other.public) in out.err
    assert "the leader, which checks it against the same key, will refuse to start the rollout" in out.err
    # and it does: the leader checks what it rolls out before any device is offered it
    assert "refused: bad signature" in out.err and code == 2
