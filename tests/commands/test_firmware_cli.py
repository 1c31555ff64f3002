from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fwhelpers import make_image

from agent.cli import main

ROOT = Path(__file__).parents[2]


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_keygen_build_verify_then_one_changed_byte(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    image = make_image(tmp_path / "rootfs.img", 300_000)
    artifact = tmp_path / "rootfs.eafw"
    assert run_cli("firmware", "keygen", "--out", keys).returncode == 0
    assert (keys / "private.pem").stat().st_mode & 0o777 == 0o600
    assert (keys / "public.pem").is_file()
    built = run_cli("firmware", "build", image, "--version", "1.4.0", "--key", keys / "private.pem", "--out", artifact)
    assert built.returncode == 0, built.stderr
    ok = run_cli("firmware", "verify", artifact, "--pubkey", keys / "public.pem")
    assert ok.returncode == 0, ok.stderr
    assert "ok:" in ok.stdout and "1.4.0" in ok.stdout

    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 1
    artifact.write_bytes(bytes(data))
    bad = run_cli("firmware", "verify", artifact, "--pubkey", keys / "public.pem")
    assert "tampered chunk" in one_line_error(bad)


def test_cli_refusals_name_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys, other = tmp_path / "keys", tmp_path / "other"
    image = make_image(tmp_path / "img.bin", 5000)
    assert main(["firmware", "keygen", "--out", str(keys)]) == 0
    assert main(["firmware", "keygen", "--out", str(other)]) == 0
    old = tmp_path / "old.eafw"
    rb = tmp_path / "rb.eafw"
    args = [str(image), "--key", str(keys / "private.pem"), "--chunk-size", "1024", "--hardware", "rpi4", "cm4"]
    assert main(["firmware", "build", *args, "--version", "1.0.0", "--out", str(old)]) == 0
    assert main(["firmware", "build", *args, "--version", "1.0.0", "--rollback", "--out", str(rb)]) == 0
    capsys.readouterr()
    pub = ["--pubkey", str(keys / "public.pem")]
    fresh = tmp_path / "fresh.eafw"
    cases = [
        (["verify", str(old), "--pubkey", str(other / "public.pem")], "signed by key"),
        (["verify", str(old), *pub, "--installed-version", "1.2.0"], "downgrade refused"),
        (["verify", str(old), *pub, "--hardware", "rpi3"], "incompatible hardware"),
        (["verify", str(old), *pub, "--image", "router"], "incompatible image: this is a 'img' image"),
        (["verify", str(tmp_path / "missing.eafw"), *pub], "cannot read"),
        (["verify", str(image), *pub], "bad magic"),
        (["verify", str(old), "--pubkey", str(image)], "not a PEM public key"),
        (["verify", str(old), "--pubkey", str(tmp_path / "nokey.pem")], "cannot read key file"),
        (["build", *args, "--version", "1.1.0", "--out", str(old)], "exists already: give --force"),
        (
            ["build", str(image), "--version", "1.0", "--key", str(keys / "private.pem"), "--out", str(fresh)],
            "invalid version",
        ),
        (
            [
                "build",
                str(tmp_path / "none.img"),
                "--version",
                "1.0.0",
                "--key",
                str(keys / "private.pem"),
                "--out",
                str(fresh),
            ],
            "cannot read image",
        ),
        (
            ["build", str(image), "--version", "1.0.0", "--key", str(keys / "public.pem"), "--out", str(fresh)],
            "not a PEM private key",
        ),
        (["keygen", "--out", str(keys)], "already exists"),
    ]
    for argv, reason in cases:
        assert main(["firmware", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and reason in err[0], (argv, err)
    assert main(["firmware", "verify", str(rb), *pub, "--installed-version", "1.2.0", "--hardware", "cm4"]) == 0


def test_unsigned_build_sign_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys"
    image = make_image(tmp_path / "img.bin", 4000)
    artifact = tmp_path / "u.eafw"
    assert main(["firmware", "keygen", "--out", str(keys)]) == 0
    assert (
        main(
            [
                "firmware",
                "build",
                str(image),
                "--version",
                "2.0.0-rc.1",
                "--unsigned",
                "--out",
                str(artifact),
                "--name",
                "gateway",
                "--min-version",
                "1.0.0",
            ]
        )
        == 0
    )
    assert main(["firmware", "verify", str(artifact), "--pubkey", str(keys / "public.pem")]) == 2
    assert "unsigned" in capsys.readouterr().err
    assert main(["firmware", "sign", str(artifact), "--key", str(keys / "private.pem")]) == 0
    assert main(["firmware", "verify", str(artifact), "--pubkey", str(keys / "public.pem")]) == 0
    capsys.readouterr()
    assert main(["firmware", "inspect", str(artifact), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["manifest"]["name"] == "gateway" and info["manifest"]["version"] == "2.0.0-rc.1"
    assert info["manifest"]["min_version"] == "1.0.0" and info["signed"] is True
    assert main(["firmware", "inspect", str(artifact)]) == 0
    assert "2.0.0-rc.1" in capsys.readouterr().out


def test_usage_errors_have_no_traceback() -> None:
    for args in (("firmware",), ("firmware", "verify"), ("firmware", "build", "x", "--version", "1.0.0")):
        result = run_cli(*args)
        assert result.returncode == 2 and "usage:" in result.stderr and "Traceback" not in result.stderr
