"""A device on the bench, scenario 1: the Debian package on a booted Debian board under QEMU,
systemd as PID 1. edge-agent.service starts (notify, watchdog) with the root helper's socket, the
journal holds no error, `systemd-analyze security` says OK; the device enrols with the claim
credential over the host's mosquitto (the shipped identity.conf and acl), is approved by an
operator on the host's leader, connects with its own certificate, and the README's own
`edge-agent send` reaches the leader from the board's shell. Scenario 5 on the same boot:
`systemctl reload` takes the settings in the same process, and a frozen agent is ended by
systemd's watchdog and started again."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.e2e.agent_support import db_query, kill, run_agent, wait_for, write_config
from tests.identity_broker import IdentityBroker, cli
from tests.qemu_board import HERE, HOST_FROM_GUEST, QemuBoard, board_config, build_board, build_deb, have_board_tools

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(bool(have_board_tools()), reason=have_board_tools() or "-")]

LEADER = "gw"
DEVICE = "board-1"


def test_a_board_boots_enrols_and_sends_under_systemd(tmp_path: Path) -> None:
    leader_dir, conf, certs = tmp_path / LEADER, tmp_path / "leader.toml", tmp_path / "certs"
    identity = {"claims": ["claim"]}
    write_config(conf, "leader", LEADER, agent={"data_dir": str(leader_dir)}, identity=identity)
    made = cli("devices", "certs", "--config", str(conf), "--out", str(certs), "--server-host", HOST_FROM_GUEST,
               "--server-host", "127.0.0.1")
    assert made.returncode == 0, made.stderr
    passwd = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwd), "claim", "claim-pw"], check=True, capture_output=True)
    (tmp_path / "claim-pw").write_text("claim-pw\n")
    broker = IdentityBroker(tmp_path / "broker", certs, leader_dir / "identity" / "crl.pem", passwd,
                            leader=LEADER).start()
    board: QemuBoard | None = None
    leader = None
    try:
        write_config(conf, "leader", LEADER, agent={"data_dir": str(leader_dir)}, identity=identity,
                     mqtt={"url": f"mqtts://127.0.0.1:{broker.port}", "tls_ca": str(certs / "ca.crt"),
                           "tls_cert": str(certs / "leader.crt"), "tls_key": str(certs / "leader.key")})
        leader = run_agent(conf, tmp_path / "leader.log")
        device_conf = board_config(tmp_path / "agent.toml", DEVICE, f"mqtts://{HOST_FROM_GUEST}:{broker.port}", f"""\
tls_ca = "/etc/edge-agent/fleet-ca.crt"

[identity]
claim_url = "mqtts://{HOST_FROM_GUEST}:{broker.claim_port}"
claim_username = "claim"
claim_password_file = "/etc/edge-agent/claim-password"
ask_interval_s = 5.0
""")
        images = build_board(build_deb(tmp_path / "debs"), device_conf, tmp_path / "board", adds=(
            (certs / "ca.crt", "/etc/edge-agent/fleet-ca.crt:0644"),
            (tmp_path / "claim-pw", "/etc/edge-agent/claim-password:0600:edge-agent:edge-agent"),
            (HERE / "board-watchdog", "/usr/local/sbin/board-watchdog:0755"),
            (HERE / "board-watchdog.service", "/etc/systemd/system/board-watchdog.service")))
        board = QemuBoard(images, tmp_path).power_on()
        with board.explained():

            wait_for(lambda: DEVICE in cli("devices", "pending", "--config", str(conf)).stdout, "the board's enrolment",
                     limit_s=900)
            approved = cli("devices", "approve", DEVICE, "--config", str(conf))
            assert approved.returncode == 0, approved.stderr
            report = board.report()
            assert report["agent"] == "active 0 restarts", report
            assert report["security"].split()[1] == "OK", report  # e.g. "1.3 OK :-)"
            assert report["helper"] == "socket active", report
            assert "error" not in report, report["error"]
            assert "local API" not in report.get("warning", ""), report["warning"]  # (its socket, its group)
            assert report["send"].startswith("exit 0 "), report["send"]
            assert int(report["agent_pid"].split()[2]) < 96 * 1024  # rss_kb under the unit's MemoryMax
            # with its own certificate: mutual TLS, its heartbeats and the shell's message at the leader
            wait_for(lambda: db_query(leader_dir / "leader.db", "SELECT 1 FROM devices WHERE device_id = ?"
                                      " AND hb_seq >= 0", (DEVICE,)), "the board's heartbeat", limit_s=300)
            wait_for(lambda: db_query(leader_dir / "leader.db", "SELECT 1 FROM app_messages WHERE device_id = ?"
                                      " AND class = 'telemetry'", (DEVICE,)), "the board's message", limit_s=300)
            # scenario 5: `systemctl reload` takes the settings in the same process; a frozen agent is
            # ended by systemd's watchdog and started again
            assert board.wait_for("BOARD: reload").endswith("reload 1 pid same")
            watchdog = board.wait_for("BOARD: watchdog").split()
            assert watchdog[2:4] == ["restarts", "1"] and watchdog[-1] == "active", watchdog
    finally:
        if board is not None:
            board.power_cut()
        if leader is not None:
            kill(leader, signal.SIGTERM)
        broker.stop()
