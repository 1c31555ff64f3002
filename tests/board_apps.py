"""Applications for a booted board (tests/qemu_board.py): the board's worker config with the
application helper on, and bundles of the test application (tests/board/hello) at a version,
healthy or not, with an optional data file."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.board_updates import DEVICE
from tests.e2e.agent_support import FLEET, db_query
from tests.identity_broker import cli
from tests.qemu_board import HERE, HOST_FROM_GUEST

APP = HERE / "hello"


def apps_config(path: Path, mqtt_port: int) -> Path:
    """The board's agent.toml: a worker with the fleet's key and the application helper."""
    path.write_text(f'[agent]\nrole = "worker"\ndevice_id = "{DEVICE}"\nfleet = "{FLEET}"\n'
                    f'data_dir = "/var/lib/edge-agent"\n\n[mqtt]\nurl = "mqtt://{HOST_FROM_GUEST}:{mqtt_port}"\n\n'
                    '[heartbeat]\ninterval_s = 5.0\n\n[firmware]\npublic_key = "/etc/edge-agent/fleet-public.pem"\n\n'
                    '[apps]\nhelper_socket = "/run/edge-agent-apps.sock"\n')
    return path


def hello_bundle(tmp: Path, version: str, private: Path, *, healthy: bool, data: dict[str, bytes] | None = None,
                 timeout_s: float = 60.0, command: str = "") -> Path:
    """hello-VERSION.eaapp: the test application (its health URL answers 500 unless `healthy`),
    with `data` (name -> content) as files under files/data; `command`: its health check is this
    shell command (run as the application) instead of the URL."""
    src = tmp / f"hello-{version}"
    (src / "files" / "bin").mkdir(parents=True)
    shutil.copy(APP / "server", src / "files" / "bin" / "server")
    (src / "files" / "bin" / "server").chmod(0o755)
    if healthy:
        (src / "files" / "healthy").write_text("yes\n")
    if data:
        (src / "files" / "data").mkdir()
        for name, content in data.items():
            (src / "files" / "data" / name).write_bytes(content)
    shutil.copy(APP / "hello.service", src / "hello.service")
    check = (f'check = "command"\ncommand = ["/bin/sh", "-c", {command!r}]\n'.replace("'", '"') if command
             else 'check = "http"\nurl = "http://127.0.0.1:8080/"\n')
    (src / "app.toml").write_text(f'[app]\nname = "hello"\nversion = "{version}"\nunit = "hello.service"\n\n'
                                  f'[health]\n{check}settle_s = 3\ntimeout_s = {timeout_s}\n')
    out = tmp / f"hello-{version}.eaapp"
    built = cli("app", "build", str(src), "--key", str(private), "--out", str(out))
    assert built.returncode == 0, built.stderr
    return out


def device_events(db: Path, rid: str) -> list[tuple[int, str, str]]:
    """What the board reported in rollout `rid`: (at_ms, state, detail), in order."""
    rows = db_query(db, "SELECT at_ms, state, detail FROM rollout_device_events WHERE rollout_id = ? AND"
                        " device_id = ? ORDER BY at_ms", (rid, DEVICE))
    return [(int(at), str(state), str(detail)) for at, state, detail in rows]


__all__ = ["APP", "apps_config", "device_events", "hello_bundle"]
