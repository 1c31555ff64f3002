"""A device on the bench, scenario 4: real power cuts. An application on the booted board hands
the agent events through the local API while the leader is away (so each is acknowledged once
the device's outbox holds it); QEMU is killed with SIGKILL (the guest's page cache is lost, as in
a power loss) at a moment drawn at random, and the board boots again, several times. Then the
leader comes: every event acknowledged before any cut reaches it, the agent runs after each boot
and the root file system comes back without an error."""

from __future__ import annotations

import json
import random
import re
import signal
from pathlib import Path

import pytest

from tests.e2e.agent_support import db_query, kill, run_agent, wait_for, write_config
from tests.mosquitto import Mosquitto
from tests.qemu_board import HERE, HOST_FROM_GUEST, QemuBoard, board_config, build_board, build_deb, have_board_tools

pytestmark = [pytest.mark.slow, pytest.mark.mqtt, pytest.mark.timeout(2400),
              pytest.mark.skipif(bool(have_board_tools()), reason=have_board_tools() or "-")]

DEVICE = "board-1"
TRIALS = 3  # scripts/bench_device.py runs more


def acknowledged(board: QemuBoard) -> set[tuple[str, int]]:
    """(boot, n) of each event the application printed as acknowledged (whatever shares its line)."""
    return {(boot, int(n)) for boot, n in re.findall(r"ACK ([0-9a-f]{8}) (\d+)\r?$", board.text(), re.MULTILINE)}


def test_every_acknowledged_message_survives_power_cuts(tmp_path: Path, mosquitto: Mosquitto) -> None:
    rng = random.Random()
    device_conf = board_config(tmp_path / "agent.toml", DEVICE, f"mqtt://{HOST_FROM_GUEST}:{mosquitto.port}")
    images = build_board(build_deb(tmp_path / "debs"), device_conf, tmp_path / "board", adds=(
        (HERE / "board-sender", "/usr/local/sbin/board-sender:0755"),
        (HERE / "board-sender.service", "/etc/systemd/system/board-sender.service")))
    acked: set[tuple[str, int]] = set()
    for trial in range(TRIALS):
        board = QemuBoard(images, tmp_path / f"boot-{trial}").power_on("board.sender")
        try:
            with board.explained():
                report = board.report()
                assert report["agent"].startswith("active"), report
                assert "error" not in report, report["error"]
                enough = 3 + rng.randrange(6)  # the moment of the cut: after a random number of events
                wait_for(lambda b=board, n=enough: len(acknowledged(b)) >= n, "events acknowledged", limit_s=600)
        finally:
            board.power_cut()
        acked |= acknowledged(board)
    leader_dir = tmp_path / "gw"
    conf = write_config(tmp_path / "leader.toml", "leader", "gw", agent={"data_dir": str(leader_dir)},
                        mqtt={"url": f"mqtt://127.0.0.1:{mosquitto.port}"})
    leader = run_agent(conf, tmp_path / "leader.log")
    board = QemuBoard(images, tmp_path / "after").power_on()
    try:
        with board.explained():
            report = board.report()
            assert report["agent"].startswith("active"), report
            assert "error" not in report, report["error"]  # the file system came back clean, the agent started

            def arrived() -> set[tuple[str, int]]:
                rows = db_query(leader_dir / "leader.db", "SELECT payload FROM app_messages WHERE device_id = ?"
                                                          " AND class = 'events'", (DEVICE,))
                return {(event["boot"], int(event["n"])) for event in (json.loads(bytes(r[0])) for r in rows)}

            wait_for(lambda: acked <= arrived(), "every acknowledged event at the leader", limit_s=600)
            assert len(acked) >= 3 * TRIALS
    finally:
        board.power_cut()
        kill(leader, signal.SIGTERM)
