"""A device on the bench, scenarios 2 and 3: firmware rollouts from the host's leader to a booted
A/B board. The board's disk has a boot partition (GRUB running RAUC's A/B logic), root file
systems A and B and a data partition; RAUC 1.8 with a real system.conf (`bootloader=grub`) under
the root helper, which the agent asks for every slot write, boot switch and reboot.

2. A new root file system (version 2.0.0, a RAUC bundle inside the fleet's signed artifact) is
   downloaded from the leader's artifact server, written into slot B by RAUC through the root
   helper; the board reboots, GRUB picks B, the agent starts under systemd, checks its health and
   commits: the leader sees `succeeded`, and B keeps booting. The power is cut during the install
   (the helper's check of the whole bundle, RAUC writing slot B): the board boots A again and the
   update goes on from where it was.
3. A bad image (version 3.0.0: a kernel and an initramfs, no init) goes into slot A: its boot
   panics, GRUB does not try it twice and boots B, the agent reports `rolled_back`, and the
   device keeps working on 2.0.0."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from tests.board_updates import (
    artifact,
    bad_image,
    device_files,
    device_story,
    free_port,
    heard_from,
    rauc_bundle,
    rauc_keys,
    rollout_end,
    rollout_status,
    start_rollout,
    telemetry,
)
from tests.e2e.agent_support import kill, run_agent, wait_for, write_config
from tests.identity_broker import cli
from tests.mosquitto import Mosquitto
from tests.qemu_board import HOST_FROM_GUEST, QemuBoard, build_board, build_deb, have_board_tools

pytestmark = [pytest.mark.slow, pytest.mark.mqtt, pytest.mark.timeout(3600),
              pytest.mark.skipif(bool(have_board_tools()) or shutil.which("rauc") is None,
                                 reason=have_board_tools() or "needs Debian's rauc and squashfs-tools")]


def test_a_new_root_file_system_boots_commits_and_a_bad_one_falls_back(tmp_path: Path, mosquitto: Mosquitto) -> None:
    keys = tmp_path / "keys"
    assert cli("firmware", "keygen", "--out", str(keys)).returncode == 0
    rauc_key, rauc_cert = rauc_keys(tmp_path)
    deb = build_deb(tmp_path / "debs")
    conf_1, files_1 = device_files(tmp_path, "1.0.0", mosquitto.port, keys / "public.pem")
    images = build_board(deb, conf_1, tmp_path / "board", adds=files_1,
                         options=("--version", "1.0.0", "--rauc-keyring", str(rauc_cert)))
    conf_2, files_2 = device_files(tmp_path, "2.0.0", mosquitto.port, keys / "public.pem")
    v2 = build_board(deb, conf_2, tmp_path / "v2", adds=files_2,
                     options=("--version", "2.0.0", "--rauc-keyring", str(rauc_cert), "--slot-only"))
    art_2 = artifact(tmp_path, rauc_bundle(tmp_path, v2 / "rootfs.img", "2.0.0", rauc_cert, rauc_key), "2.0.0",
                     keys / "private.pem")
    art_3 = artifact(tmp_path, rauc_bundle(tmp_path, bad_image(tmp_path, v2, "3.0.0"), "3.0.0", rauc_cert, rauc_key),
                     "3.0.0", keys / "private.pem")

    leader_dir = tmp_path / "gw"
    db = leader_dir / "leader.db"
    port = free_port()
    conf = write_config(tmp_path / "leader.toml", "leader", "gw", agent={"data_dir": str(leader_dir)},
                        mqtt={"url": f"mqtt://127.0.0.1:{mosquitto.port}"},
                        artifacts={"listen": f"127.0.0.1:{port}", "url": f"http://{HOST_FROM_GUEST}:{port}"},
                        firmware={"public_key": str(keys / "public.pem")})
    leader = run_agent(conf, tmp_path / "leader.log")
    board = QemuBoard(images, tmp_path / "console").power_on()
    try:
        with board.explained():
            first = board.report()
            assert first["slot"] == "A version 1.0.0", first
            assert first["agent"] == "active 0 restarts", first
            assert "error" not in first, first["error"]
            wait_for(lambda: heard_from(db), "the board's heartbeat", limit_s=600)

            # scenario 2: the new root file system into B, a reboot, GRUB picks B, health, commit; and
            # a power cut once it is all downloaded, while it is installed (scenario 4): the helper
            # checks the bundle whole and RAUC writes slot B (the download's last progress report is
            # the mark: `verifying` follows it at once)
            start_rollout(tmp_path, db, "v2", art_2)
            wait_for(lambda: (lambda d: d["bytes_total"] and d["bytes_done"] >= d["bytes_total"])(
                rollout_status(db, "v2")["waves"][0]["download"]), "the whole update downloaded", limit_s=1200)
            cut = board.mark()
            board.power_cut()
            board.power_on()
            after_cut = board.report(since=cut)  # the agent is up again (a trial boot may come first)
            assert after_cut["agent"].startswith("active"), after_cut
            done = rollout_end(db, "v2")
            story = device_story(db, "v2")
            assert [d["state"] for d in done["device_list"]] == ["succeeded"], story
            assert board.boots() == ["A", "A", "B"], (board.boots(), story)
            after = board.report(since=board.last_boot())
            assert after["slot"] == "B version 2.0.0", after
            assert after["agent"] == "active 0 restarts", after
            assert "error" not in after, after["error"]
            assert after["send"].startswith("exit 0 "), after["send"]

            # scenario 3: the bad image into A; its boot panics, GRUB boots B again, the agent reports
            start_rollout(tmp_path, db, "v3", art_3)
            done = rollout_end(db, "v3")
            assert [d["state"] for d in done["device_list"]] == ["rolled_back"], done["device_list"]
            assert board.boots() == ["A", "A", "B", "A", "B"], (board.boots(), device_story(db, "v3"))
            assert "Target filesystem doesn't have requested /sbin/init" in board.text()
            back = board.report(since=board.last_boot())
            assert back["slot"] == "B version 2.0.0", back
            assert back["agent"].startswith("active"), back
            # the device keeps working: the message its shell sent after the fall-back reaches the leader
            wait_for(lambda: telemetry(db) >= 4, "the board's messages of its four good boots", limit_s=600)
    finally:
        board.power_cut()
        kill(leader, signal.SIGTERM)
