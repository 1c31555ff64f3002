"""Which event loop `edge-agent run` picks: the config's choice, else by role."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.commands.run import wants_uvloop
from agent.core.config import AgentSection, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(("role", "setting", "expected"), [
    ("leader", None, True),
    ("worker", None, False),
    ("worker", True, True),
    ("leader", False, False),
])
def test_loop_by_role_unless_configured(role: str, setting: bool | None, expected: bool) -> None:
    assert wants_uvloop(AgentSection(device_id="d1", role=role, use_uvloop=setting)) is expected  # type: ignore[arg-type]


def test_shipped_configs_pick_uvloop_for_the_leader_only() -> None:
    assert wants_uvloop(load_config(CONFIGS / "leader.toml").agent) is True
    assert wants_uvloop(load_config(CONFIGS / "worker.toml").agent) is False


def test_a_data_dir_that_cannot_be_made_is_one_line_and_exit_2(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main as cli_main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = cli_main(["run", "--config", str(CONFIGS / "worker.toml"), "--data-dir", str(blocker / "state"),
                     "--broker", "mqtt://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "--data-dir: cannot create the data directory" in err
    assert "Traceback" not in err
