"""`edge-agent run` refuses MQTT credentials that others can read, before it connects anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, password_file: Path) -> Path:
    config = tmp_path / "agent.toml"
    config.write_text(
        '[agent]\nrole = "worker"\ndevice_id = "pi-9"\n'
        f'data_dir = "{tmp_path / "data"}"\n'
        f'[mqtt]\nurl = "mqtt://127.0.0.1:9"\nusername = "pi-9"\npassword_file = "{password_file}"\n'
    )
    return config


def run_agent(config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
                          capture_output=True, text=True, env=env, timeout=60)


def test_world_readable_password_file_is_refused_in_one_line(tmp_path: Path) -> None:
    secret = tmp_path / "mqtt-password"
    secret.write_text("hunter2\n")
    secret.chmod(0o644)
    result = run_agent(write_config(tmp_path, secret))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "mqtt.password_file" in lines[0] and str(secret) in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was created


def test_missing_password_file_is_refused_in_one_line(tmp_path: Path) -> None:
    result = run_agent(write_config(tmp_path, tmp_path / "absent"))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "mqtt.password_file" in result.stderr
