"""A device on the bench, scenarios 4 and 5 for configuration: config rollouts from the host's
leader to a booted board whose agent runs under the shipped, sandboxed unit. The agent holds two
config targets through a drop-in (`ReadWritePaths=`): an application's folder and systemd-networkd's.
It writes, systemd applies: a path unit reloads the application (a real service) or networkd when
a file changes, so the agent needs no privilege for it.

- A release the application takes commits: the service reloads it and the leader says `succeeded`.
- The power is cut while a release is applied and not yet confirmed: at the next boot the agent
  writes the old content back, the service reloads it, and the leader says `rolled_back`.
- A network configuration that cuts the board off (no DHCP) is not confirmed: the agent writes
  the old one back by itself, networkd takes the address again, and the leader says
  `rolled_back` once the board is back."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.board_updates import DEVICE, heard_from, rollout_end, start_rollout
from tests.e2e.agent_support import FLEET, REPO, db_query, kill, run_agent, wait_for, write_config
from tests.identity_broker import cli
from tests.mosquitto import Mosquitto
from tests.qemu_board import HERE, HOST_FROM_GUEST, QemuBoard, build_board, build_deb, have_board_tools

pytestmark = [pytest.mark.slow, pytest.mark.mqtt, pytest.mark.timeout(2400),
              pytest.mark.skipif(bool(have_board_tools()), reason=have_board_tools() or "-")]

NETWORK = "[Match]\nName=en* eth*\n\n[Network]\nDHCP={dhcp}\n"
METRICS_PORT = 9100  # the agent's /healthz on the board's loopback: the service a forward reaches


def remote_sessions_reach_the_board(leader_conf: Path) -> None:
    """A shell on the booted board as the agent's user, inside the shipped unit's sandbox (reading
    another unit's journal through its systemd-journal group), and a forward to a service on the
    board's loopback."""
    ran = cli("devices", "shell", "--config", str(leader_conf), DEVICE, "--",
              "id -un; systemctl is-active edge-agent board-app; journalctl -q --no-pager -u systemd-networkd -n 1"
              " | wc -l")
    assert (ran.returncode, ran.stdout) == (0, "edge-agent\nactive\nactive\n1\n"), ran
    forward = subprocess.Popen([sys.executable, "-m", "agent.cli", "devices", "forward", "--config", str(leader_conf),
                                DEVICE, f"0:127.0.0.1:{METRICS_PORT}"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline()
        assert line.startswith("forwarding 127.0.0.1:"), line
        local = int(line.split()[1].rsplit(":", 1)[1])
        try:  # (200 or 503: what the agent's health endpoint says, over the forward either way)
            with urllib.request.urlopen(f"http://127.0.0.1:{local}/healthz", timeout=120) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        assert "transport" in json.loads(body)["checks"], body
    finally:
        forward.terminate()
        forward.communicate(timeout=30)


def release(tmp: Path, target: str, document: str, text: str, version: str, private: Path) -> Path:
    src = tmp / f"{target}-{version}"
    src.mkdir()
    (src / document).write_text(text)
    out = tmp / f"{target}-{version}.eacfg"
    built = cli("config", "release", "build", target, str(src / document), "--version", version, "--key",
                str(private), "--out", str(out))
    assert built.returncode == 0, built.stderr
    return out


def device_state(status: dict[str, object]) -> str:
    devices = status["device_list"]
    assert isinstance(devices, list) and len(devices) == 1, status
    return str(devices[0]["state"])


def test_config_rollouts_reload_a_service_survive_a_power_cut_and_a_cut_network_reverts(
        tmp_path: Path, mosquitto: Mosquitto) -> None:
    keys = tmp_path / "keys"
    assert cli("firmware", "keygen", "--out", str(keys)).returncode == 0
    conf = tmp_path / "agent.toml"
    conf.write_text(f'[agent]\nrole = "worker"\ndevice_id = "{DEVICE}"\nfleet = "{FLEET}"\n'
                    f'data_dir = "/var/lib/edge-agent"\n\n[mqtt]\nurl = "mqtt://{HOST_FROM_GUEST}:{mosquitto.port}"\n\n'
                    '[heartbeat]\ninterval_s = 5.0\n\n[firmware]\npublic_key = "/etc/edge-agent/fleet-public.pem"\n\n'
                    '[config_targets.app]\ndirectory = "/etc/board-app"\ndocuments = ["app.toml"]\n'
                    'health_command = ["/usr/local/sbin/board-app-healthy"]\nconfirm_s = 60.0\nsettle_s = 20.0\n'
                    'units = ["board-app.service"]\n\n'
                    '[config_targets.net]\ndirectory = "/etc/systemd/network"\ndocuments = ["20-wired.network"]\n'
                    'confirm_s = 60.0\nsettle_s = 10.0\nunits = ["systemd-networkd.service"]\n\n'
                    f'[metrics]\nlisten = "127.0.0.1:{METRICS_PORT}"\n\n'
                    f'[remote]\nshell = true\nforward = ["127.0.0.1:{METRICS_PORT}"]\n')
    app_v1 = tmp_path / "app.toml"
    app_v1.write_text('mode = "v1"\n')
    units = ("board-app.service", "board-app-config.path", "board-app-reload.service", "board-network.path",
             "board-network-reload.service")
    images = build_board(build_deb(tmp_path / "debs"), conf, tmp_path / "board", adds=(
        (keys / "public.pem", "/etc/edge-agent/fleet-public.pem:0644"),
        (app_v1, "/etc/board-app/app.toml:0644:edge-agent:edge-agent"),
        (HERE / "board-app", "/usr/local/sbin/board-app:0755"),
        (HERE / "board-app-healthy", "/usr/local/sbin/board-app-healthy:0755"),
        (HERE / "board-config.tmpfiles", "/etc/tmpfiles.d/board-config.conf:0644"),
        (HERE / "board-config-targets.conf", "/etc/systemd/system/edge-agent.service.d/config-targets.conf:0644"),
        *((HERE / unit, f"/etc/systemd/system/{unit}:0644") for unit in units)))
    leader_dir = tmp_path / "gw"
    db = leader_dir / "leader.db"
    me = pwd.getpwuid(os.geteuid()).pw_name
    leader_conf = write_config(tmp_path / "leader.toml", "leader", "gw", agent={"data_dir": str(leader_dir)},
                               mqtt={"url": f"mqtt://127.0.0.1:{mosquitto.port}"},
                               firmware={"public_key": str(keys / "public.pem")},
                               remote={"shell_operators": [me], "forward_operators": [me]})
    leader = run_agent(leader_conf, tmp_path / "leader.log")
    board = QemuBoard(images, tmp_path / "console").power_on()
    private = keys / "private.pem"
    try:
        with board.explained():
            report = board.report()
            assert report["agent"] == "active 0 restarts", report
            assert "error" not in report, report["error"]
            board.wait_for("BOARD-APP: loaded mode=v1")
            wait_for(lambda: heard_from(db), "the board's heartbeat", limit_s=600)
            remote_sessions_reach_the_board(leader_conf)

            # a release the service takes: written by the agent, reloaded by systemd, confirmed
            mark = board.mark()
            start_rollout(tmp_path, db, "app-v2",
                          release(tmp_path, "app", "app.toml", 'mode = "v2"\n', "2.0.0", private), kind="config")
            done = rollout_end(db, "app-v2")
            assert done["state"] == "succeeded" and device_state(done) == "succeeded", done
            board.wait_for("BOARD-APP: loaded mode=v2", since=mark)

            # the power goes while a release is applied and not yet confirmed (settle_s 20): at the
            # next boot the old content comes back and the service runs it
            mark = board.mark()
            start_rollout(tmp_path, db, "app-v3",
                          release(tmp_path, "app", "app.toml", 'mode = "v3"\n', "3.0.0", private), kind="config")
            board.wait_for("BOARD-APP: loaded mode=v3", since=mark)
            board.power_cut()
            board.power_on()
            done = rollout_end(db, "app-v3")
            assert device_state(done) == "rolled_back", done
            after = board.report(since=board.last_boot())
            assert after["agent"] == "active 0 restarts", after
            assert "error" not in after, after["error"]
            loaded = [line for line in board.text(board.last_boot()).splitlines() if "BOARD-APP: loaded" in line]
            assert loaded and loaded[-1].endswith("loaded mode=v2"), loaded

            # a network configuration that cuts the board off reverts by itself
            beats = db_query(db, "SELECT hb_seq FROM devices WHERE device_id = ?", (DEVICE,))[0][0]
            start_rollout(tmp_path, db, "net-bad",
                          release(tmp_path, "net", "20-wired.network", NETWORK.format(dhcp="no"), "2.0.0", private),
                          kind="config")
            done = rollout_end(db, "net-bad")
            assert device_state(done) == "rolled_back", done
            # its report explains it: the agent's lines and networkd's journal, as the board wrote them
            said = cli("rollout", "status", "net-bad", "--db", str(db), "--json", "--device", DEVICE)
            log = json.loads(said.stdout)["device"]["log"]
            assert "-- journal: systemd-networkd.service --" in log and "-- edge-agent --" in log, log
            wait_for(lambda: db_query(db, "SELECT hb_seq FROM devices WHERE device_id = ?", (DEVICE,))[0][0]
                     > beats + 2, "the board's heartbeats after the revert", limit_s=600)
            assert board.proc is not None and board.proc.poll() is None  # (the same boot: no reboot needed)
    finally:
        board.power_cut()
        kill(leader, signal.SIGTERM)
