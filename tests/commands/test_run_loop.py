"""Which event loop `edge-agent run` picks: the config's choice, else by role."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.core.config import AgentSection, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(("role", "setting", "expected"), [
    ("leader", None, True),
    ("worker", None, False),
    ("worker", True, True),
    ("leader", False, False),
])
def test_loop_by_role_unless_configured(role: str, setting: bool | None, expected: bool) -> None:
    assert AgentSection(device_id="d1", role=role, use_uvloop=setting).wants_uvloop() is expected  # type: ignore[arg-type]


def test_shipped_configs_pick_uvloop_for_the_leader_only() -> None:
    assert load_config(CONFIGS / "leader.toml").agent.wants_uvloop() is True
    assert load_config(CONFIGS / "worker.toml").agent.wants_uvloop() is False


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


def test_a_config_data_dir_that_cannot_be_made_names_the_config_file(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main as cli_main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = tmp_path / "agent.toml"
    config.write_text(f'[agent]\nrole = "worker"\ndevice_id = "pi"\ndata_dir = "{blocker / "state"}"\n'
                      '[mqtt]\nurl = "mqtt://127.0.0.1:1"\n')
    assert cli_main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"edge-agent run: {config}: agent.data_dir: cannot create the data directory")


def test_a_second_agent_on_a_data_dir_is_refused_naming_the_config_file(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from agent.cli import main as cli_main
    from agent.service.instance import InstanceLock

    config = tmp_path / "agent.toml"
    config.write_text(f'[agent]\nrole = "worker"\ndevice_id = "pi"\ndata_dir = "{tmp_path / "data"}"\n'
                      '[mqtt]\nurl = "mqtt://127.0.0.1:1"\n')
    (tmp_path / "data").mkdir()
    held = InstanceLock(tmp_path / "data").acquire()  # as a running agent holds it
    try:
        assert cli_main(["run", "--config", str(config)]) == 2
    finally:
        held.release()
    err = capsys.readouterr().err
    assert err.strip() == (f"edge-agent run: {config}: agent.data_dir: another agent runs on {tmp_path / 'data'}"
                           f" (pid {os.getpid()}); one data directory holds one agent")
