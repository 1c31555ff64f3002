import subprocess
import sys
from pathlib import Path

import pytest

from agent import __version__
from agent.cli import COMMANDS, main

ROOT = Path(__file__).parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_help_lists_every_product_command() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for name in ("run", "simulate", "rollout", "outbox", "dlq", "status", "firmware", "config", "version"):
        assert f"    {name}" in result.stdout
    assert set(COMMANDS) >= {"run", "simulate", "rollout", "outbox", "dlq", "status", "firmware", "config", "version"}


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"edge-agent {__version__}"


def test_config_check_accepts_examples() -> None:
    """The shipped configs but the firmware ones, whose fleet key lives on the device
    (tests/sim/test_examples.py checks worker-firmware.toml with a key in place)."""
    paths = [p for p in sorted((ROOT / "configs").glob("*.toml"))
             if p.name not in ("worker-firmware.toml", "installer.toml")]
    result = run_cli("config", "check", *[str(p) for p in paths])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": ok") == len(paths) >= 2


@pytest.mark.parametrize(
    ("text", "key"),
    [('[agent]\ndevice_id = "d"\nunknown_key = 1\n', "agent.unknown_key"),
     ('[agent]\ndevice_id = "d"\n[mailbox]\ncapacity = "x"\n', "mailbox.capacity")],
)
def test_config_check_bad_file_is_one_line_exit_2(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = run_cli("config", "check", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert key in lines[0] and str(path) in lines[0]
    assert "Traceback" not in result.stderr


def test_bad_arguments_give_usage_not_traceback() -> None:
    for args in (("no-such-command",), ("dlq", "list"), ("config",)):
        result = run_cli(*args)
        assert result.returncode == 2
        assert "usage:" in result.stderr
        assert "Traceback" not in result.stderr
