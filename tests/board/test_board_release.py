"""A device on the bench, releases: the whole desired state of a booted A/B board (its root file
system through RAUC and the root install helper, a configuration target its service reloads, and a
container application the root application helper runs with podman under systemd), rolled out from
the host's leader as one signed release each time, all or nothing.

- R1 (firmware 1.0.0, the version the board runs; config app 1.0.0; web 1.0.0) converges without
  a reboot: the configuration is confirmed and held, the container healthy on trial (its image's
  own health check), then both are committed.
- R2 (firmware 2.0.0, config app 1.1.0, web 2.0.0) converges across a reboot: RAUC writes slot B,
  GRUB boots it on trial, and on that boot the configuration and the application converge and are
  held; all healthy, the slot is marked good, then the others are committed. web 2.0.0's image
  shares its base layer with 1.0.0's: the device fetches the chunks of the layer that changed, and
  the container finds the data its volume kept.
- R3 (firmware 3.0.0, config app 1.2.0, web 3.0.0 whose container fails its health check) boots
  slot A on trial and converges there: the configuration is applied and held, the application
  fails its health check; the configuration is written back, the application taken back, the
  trial boot not committed: the board boots B again and runs R2 in every part, firmware included.
  The leader names the part that failed, and says the board runs R2 whole."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.board_releases import release_board
from tests.board_updates import (
    DEVICE,
    device_story,
    free_port,
    heard_from,
    rollout_end,
    start_rollout,
)
from tests.e2e.agent_support import kill, run_agent, wait_for, write_config
from tests.identity_broker import cli
from tests.mosquitto import Mosquitto
from tests.qemu_board import HOST_FROM_GUEST, QemuBoard, have_board_tools

pytestmark = [pytest.mark.slow, pytest.mark.mqtt, pytest.mark.timeout(3600),
              pytest.mark.skipif(bool(have_board_tools()), reason=have_board_tools() or "-")]


def the_device(status: dict[str, object]) -> dict[str, str]:
    devices = status["device_list"]
    assert isinstance(devices, list) and len(devices) == 1, status
    return {k: str(v) for k, v in devices[0].items()}


def test_releases_converge_whole_and_a_failing_one_returns_every_part_firmware_included(
        tmp_path: Path, mosquitto: Mosquitto) -> None:
    board_set = release_board(tmp_path, mosquitto.port)
    images, public = board_set.images, board_set.public
    r1, r2, r3 = (board_set.releases[name] for name in ("R1", "R2", "R3"))
    port = free_port()
    leader_dir = tmp_path / "gw"
    db = leader_dir / "leader.db"
    leader = run_agent(write_config(tmp_path / "leader.toml", "leader", "gw", agent={"data_dir": str(leader_dir)},
                                    mqtt={"url": f"mqtt://127.0.0.1:{mosquitto.port}"},
                                    firmware={"public_key": str(public)},
                                    artifacts={"listen": f"127.0.0.1:{port}",
                                               "url": f"http://{HOST_FROM_GUEST}:{port}"}), tmp_path / "leader.log")
    board = QemuBoard(images, tmp_path / "console").power_on()
    try:
        with board.explained():
            first = board.report()
            assert first["slot"] == "A version 1.0.0" and first["agent"] == "active 0 restarts", first
            assert "error" not in first, first["error"]
            wait_for(lambda: heard_from(db), "the board's heartbeat", limit_s=600)

            # R1: the firmware it runs, a configuration and an application: no reboot
            mark = board.mark()
            start_rollout(tmp_path, db, "r1", r1, kind="release")
            done = the_device(rollout_end(db, "r1"))
            assert done["state"] == "succeeded" and "release board 1.0.0 converged" in done["detail"], done
            board.wait_for("BOARD-APP: loaded mode=r1", since=mark)
            board.wait_for("WEB: 1.0.0 up starts=1", since=mark)
            assert board.boots() == ["A"]

            # R2: a new root file system, booted on trial; the others converge on that boot
            mark = board.mark()
            start_rollout(tmp_path, db, "r2", r2, kind="release")
            done = the_device(rollout_end(db, "r2"))
            story = device_story(db, "r2")
            assert done["state"] == "succeeded", story
            assert board.boots() == ["A", "B"], (board.boots(), story)
            # each part's time to its hold; web 2.0.0's image: the chunks of its changed layer fetched
            assert "firmware 2.0.0 booted on trial after" in done["detail"], done
            assert "config:app held after" in done["detail"], done
            fetched = re.search(r"app:web held after [\d.]+ s \(fetched (\d+) bytes, reused (\d+)\)", done["detail"])
            assert fetched, done
            assert int(fetched.group(1)) < board_set.apps["2.0.0"].stat().st_size // 8 < int(fetched.group(2)), done
            after = board.report(since=board.last_boot())
            assert after["slot"] == "B version 2.0.0" and after["agent"] == "active 0 restarts", after
            board.wait_for("BOARD-APP: loaded mode=r2", since=mark)
            line = board.wait_for("WEB: 2.0.0 up", since=mark)
            assert int(line.rsplit("starts=", 1)[1].split()[0]) >= 2, line  # its volume kept 1.0.0's start

            # R3: its application fails on the trial boot of slot A: every part back on R2
            mark = board.mark()
            start_rollout(tmp_path, db, "r3", r3, kind="release")
            done = the_device(rollout_end(db, "r3"))
            story = device_story(db, "r3")
            assert done["state"] == "rolled_back", story
            assert "app:web failed: web 3.0.0 failed its health check" in done["detail"], done
            assert "its container's healthcheck did not pass" in done["detail"], done
            assert "taken back whole" in done["detail"], done
            # (decided on the trial boot and said before its reboot: the board boots B again)
            wait_for(lambda: len(board.boots()) == 4, "the board to boot again", limit_s=900)
            assert board.boots() == ["A", "B", "A", "B"], (board.boots(), story)
            board.wait_for("BOARD-APP: loaded mode=r3", since=mark)  # applied and held on the trial boot...
            board.wait_for("WEB: 3.0.0 up", since=mark)
            back = board.report(since=board.last_boot())
            assert back["slot"] == "B version 2.0.0" and back["agent"].startswith("active"), back
            loaded = [line for line in board.text(board.last_boot()).splitlines() if "BOARD-APP: loaded" in line]
            assert loaded and loaded[-1].endswith("loaded mode=r2"), loaded  # ...and written back
            board.wait_for("WEB: 2.0.0 up", since=board.last_boot())
            said = "release: board 1.1.0 (rollout r2): runs every part of it"
            wait_for(lambda: said in cli("status", "--device", DEVICE, "--db", str(db)).stdout,
                     "the leader to say the board runs R2 whole", limit_s=300)
    finally:
        board.power_cut()
        kill(leader, signal.SIGTERM)
