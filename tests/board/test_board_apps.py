"""A device on the bench, applications: rollouts of a service's bundle from the host's leader to a
booted board, where the packaged root application helper installs it beside the running version
and systemd (PID 1) runs it as its own dynamic user.

- 1.0.0 installs, starts and answers its health URL: the leader says `succeeded`.
- 2.0.0 goes beside it and takes over; the data directory is the same (its start count goes on);
  its files are 1.0.0's, so the device copies them and downloads none; its health check is a
  command run as the application, in its sandbox (it finds its files, not the agent's data).
- 3.0.0 answers 500: it is taken back, 2.0.0 runs again, and the leader says which check failed.
- A signed removal at 4.0.0 stops it and removes its versions: the leader's registry no longer
  lists it; 5.0.0 installed after it finds the data the earlier versions left (kept).
- The agent's data is out of the application's sight."""

from __future__ import annotations

import signal
from pathlib import Path

import msgspec
import pytest

from tests.board_apps import apps_config, device_events, hello_bundle
from tests.board_updates import DEVICE, free_port, heard_from, rollout_end, start_rollout
from tests.e2e.agent_support import db_query, kill, run_agent, wait_for, write_config
from tests.identity_broker import cli
from tests.mosquitto import Mosquitto
from tests.qemu_board import HOST_FROM_GUEST, QemuBoard, build_board, build_deb, have_board_tools

pytestmark = [pytest.mark.slow, pytest.mark.mqtt, pytest.mark.timeout(2400),
              pytest.mark.skipif(bool(have_board_tools()), reason=have_board_tools() or "-")]

def registry_apps(db: Path) -> dict[str, object]:
    """The board's applications as the leader's registry holds them (its newest full heartbeat)."""
    rows = db_query(db, "SELECT apps FROM devices WHERE device_id = ?", (DEVICE,))
    return msgspec.msgpack.decode(rows[0][0]) if rows and rows[0][0] else {}


def device_detail(status: dict[str, object]) -> tuple[str, str]:
    devices = status["device_list"]
    assert isinstance(devices, list) and len(devices) == 1, status
    return str(devices[0]["state"]), str(devices[0].get("detail", ""))


def test_applications_install_beside_take_over_and_an_unhealthy_one_is_taken_back(
        tmp_path: Path, mosquitto: Mosquitto) -> None:
    keys = tmp_path / "keys"
    assert cli("firmware", "keygen", "--out", str(keys)).returncode == 0
    private = keys / "private.pem"
    conf = apps_config(tmp_path / "agent.toml", mosquitto.port)
    images = build_board(build_deb(tmp_path / "debs"), conf, tmp_path / "board", adds=(
        (keys / "public.pem", "/etc/edge-agent/fleet-public.pem:0644"),))
    port = free_port()
    leader_dir = tmp_path / "gw"
    db = leader_dir / "leader.db"
    leader = run_agent(write_config(tmp_path / "leader.toml", "leader", "gw", agent={"data_dir": str(leader_dir)},
                                    mqtt={"url": f"mqtt://127.0.0.1:{mosquitto.port}"},
                                    firmware={"public_key": str(keys / "public.pem")},
                                    artifacts={"listen": f"127.0.0.1:{port}",
                                               "url": f"http://{HOST_FROM_GUEST}:{port}"}), tmp_path / "leader.log")
    board = QemuBoard(images, tmp_path / "console").power_on()
    try:
        with board.explained():
            report = board.report()
            assert report["agent"] == "active 0 restarts", report
            assert "error" not in report, report["error"]
            wait_for(lambda: heard_from(db), "the board's heartbeat", limit_s=600)

            start_rollout(tmp_path, db, "hello-1", hello_bundle(tmp_path, "1.0.0", private, healthy=True), kind="app")
            done = rollout_end(db, "hello-1")
            assert done["state"] == "succeeded" and device_detail(done)[0] == "succeeded", done
            first = board.wait_for("HELLO: 1.0.0 up")
            assert "starts=1" in first and "agent_data=hidden" in first and "uid=0" not in first, first

            mark = board.mark()
            checked_as_the_app = "test -f healthy && ! ls /var/lib/edge-agent"  # its files, not the agent's data
            two = hello_bundle(tmp_path, "2.0.0", private, healthy=True, command=checked_as_the_app)
            start_rollout(tmp_path, db, "hello-2", two, kind="app")
            done = rollout_end(db, "hello-2")
            state, detail = device_detail(done)
            assert done["state"] == "succeeded" and state == "succeeded", done
            assert "fetched 0 bytes" in detail, detail  # its files are 1.0.0's: copied, none downloaded
            assert "starts=2" in board.wait_for("HELLO: 2.0.0 up", since=mark)  # the same data directory

            mark = board.mark()
            start_rollout(tmp_path, db, "hello-3", hello_bundle(tmp_path, "3.0.0", private, healthy=False), kind="app")
            done = rollout_end(db, "hello-3")
            state, detail = device_detail(done)
            assert state == "failed" and "failed its health check" in detail and "back on 2.0.0" in detail, done
            assert "500" in detail, detail  # what the health URL answered
            assert [s for _, s, _ in device_events(db, "hello-3")][-1] == "failed"
            board.wait_for("HELLO: 3.0.0 up", since=mark)
            assert "starts=4" in board.wait_for("HELLO: 2.0.0 up", since=mark)  # 2.0.0 runs again

            mark = board.mark()
            removal = tmp_path / "hello-removed-4.0.0.eaapp"
            assert cli("app", "removal", "hello", "--version", "4.0.0", "--key", str(private), "--out",
                       str(removal)).returncode == 0
            start_rollout(tmp_path, db, "hello-removed", removal, kind="app")
            done = rollout_end(db, "hello-removed")
            state, detail = device_detail(done)
            assert state == "succeeded" and "hello 2.0.0 stopped and removed" in detail, done
            board.wait_for("removed hello at 4.0.0", since=mark)  # the helper's journal
            wait_for(lambda: "hello" not in registry_apps(db), "the registry to forget hello", limit_s=300)
            start_rollout(tmp_path, db, "hello-5", hello_bundle(tmp_path, "5.0.0", private, healthy=True), kind="app")
            assert rollout_end(db, "hello-5")["state"] == "succeeded"
            assert "starts=5" in board.wait_for("HELLO: 5.0.0 up", since=mark)  # its data was kept
    finally:
        board.power_cut()
        kill(leader, signal.SIGTERM)
