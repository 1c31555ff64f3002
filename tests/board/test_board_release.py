"""A device on the bench, releases: the whole desired state of a booted A/B board (its root file
system through RAUC and the root install helper, a configuration target its service reloads, and an
application the root application helper runs under systemd), rolled out from the host's leader as
one signed release each time, all or nothing.

- R1 (firmware 1.0.0, the version the board runs; config app 1.0.0; hello 1.0.0) converges without
  a reboot: the configuration is confirmed and held, the application healthy on trial, then both
  are committed.
- R2 (firmware 2.0.0, config app 1.1.0, hello 2.0.0) converges across a reboot: RAUC writes slot B,
  GRUB boots it on trial, and on that boot the configuration and the application converge and are
  held; all healthy, the slot is marked good, then the others are committed. hello 2.0.0's files
  are 1.0.0's: copied on the device, none fetched.
- R3 (firmware 3.0.0, config app 1.2.0, hello 3.0.0 whose health URL answers 500) boots slot A on
  trial and converges there: the configuration is applied and held, the application fails its
  health check; the configuration is written back, the application taken back, the trial boot not
  committed: the board boots B again and runs R2 in every part, firmware included. The leader
  names the part that failed, and says the board runs R2 whole."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.board_apps import hello_bundle
from tests.board_updates import (
    DEVICE,
    artifact,
    device_files,
    device_story,
    free_port,
    heard_from,
    rauc_bundle,
    rauc_keys,
    rollout_end,
    start_rollout,
)
from tests.e2e.agent_support import kill, run_agent, wait_for, write_config
from tests.identity_broker import cli
from tests.mosquitto import Mosquitto
from tests.qemu_board import HERE, HOST_FROM_GUEST, QemuBoard, build_board, build_deb, have_board_tools

pytestmark = [pytest.mark.slow, pytest.mark.mqtt, pytest.mark.timeout(3600),
              pytest.mark.skipif(bool(have_board_tools()), reason=have_board_tools() or "-")]

CONFIG_TARGET = ('\n[config_targets.app]\ndirectory = "/etc/board-app"\ndocuments = ["app.toml"]\n'
                 'health_command = ["/usr/local/sbin/board-app-healthy"]\nconfirm_s = 90.0\nsettle_s = 5.0\n'
                 '\n[apps]\nhelper_socket = "/run/edge-agent-apps.sock"\n')
UNITS = ("board-app.service", "board-app-config.path", "board-app-reload.service")


def board_files(tmp: Path, version: str, port: int, public: Path) -> tuple[Path, tuple[tuple[Path, str], ...]]:
    """The board's agent.toml at `version` (RAUC through the install helper, the config target
    `app`, the application helper) and the files beside it."""
    tmp.mkdir(parents=True, exist_ok=True)
    conf, files = device_files(tmp, version, port, public)
    conf.write_text(conf.read_text() + CONFIG_TARGET)
    first = tmp / "app.toml"
    first.write_text('mode = "factory"\n')
    return conf, (*files, (first, "/etc/board-app/app.toml:0644:edge-agent:edge-agent"),
                  (HERE / "board-app", "/usr/local/sbin/board-app:0755"),
                  (HERE / "board-app-healthy", "/usr/local/sbin/board-app-healthy:0755"),
                  (HERE / "board-config.tmpfiles", "/etc/tmpfiles.d/board-config.conf:0644"),
                  (HERE / "board-config-targets.conf",
                   "/etc/systemd/system/edge-agent.service.d/config-targets.conf:0644"),
                  *((HERE / unit, f"/etc/systemd/system/{unit}:0644") for unit in UNITS))


def release(tmp: Path, version: str, *, firmware: Path, mode: str, app: Path, private: Path) -> Path:
    """A release folder: the parts and release.toml, and the document `release build` signs."""
    folder = tmp / f"release-{version}"
    folder.mkdir()
    src = tmp / f"config-{version}"
    src.mkdir()
    (src / "app.toml").write_text(f'mode = "{mode}"\n')
    config = folder / f"app-{version}.eacfg"
    assert cli("config", "release", "build", "app", str(src / "app.toml"), "--version", version, "--key",
               str(private), "--out", str(config)).returncode == 0
    for part in (firmware, app):
        (folder / part.name).hardlink_to(part)
    (folder / "release.toml").write_text(f'name = "board"\nversion = "{version}"\nfirmware = "{firmware.name}"\n'
                                         f'config = ["{config.name}"]\napps = ["{app.name}"]\n')
    built = cli("release", "build", str(folder / "release.toml"), "--key", str(private))
    assert built.returncode == 0, built.stderr
    return folder / f"board-{version}.earel"


def the_device(status: dict[str, object]) -> dict[str, str]:
    devices = status["device_list"]
    assert isinstance(devices, list) and len(devices) == 1, status
    return {k: str(v) for k, v in devices[0].items()}


def test_releases_converge_whole_and_a_failing_one_returns_every_part_firmware_included(
        tmp_path: Path, mosquitto: Mosquitto) -> None:
    keys = tmp_path / "keys"
    assert cli("firmware", "keygen", "--out", str(keys)).returncode == 0
    private, public = keys / "private.pem", keys / "public.pem"
    rauc_key, rauc_cert = rauc_keys(tmp_path)
    deb = build_deb(tmp_path / "debs")
    conf_1, files_1 = board_files(tmp_path / "v1", "1.0.0", mosquitto.port, public)
    images = build_board(deb, conf_1, tmp_path / "board", adds=files_1,
                         options=("--version", "1.0.0", "--rauc-keyring", str(rauc_cert)))
    conf_2, files_2 = board_files(tmp_path / "v2", "2.0.0", mosquitto.port, public)
    v2 = build_board(deb, conf_2, tmp_path / "v2-board", adds=files_2,
                     options=("--version", "2.0.0", "--rauc-keyring", str(rauc_cert), "--slot-only"))
    firmware = {version: artifact(tmp_path, rauc_bundle(tmp_path, image, version, rauc_cert, rauc_key), version,
                                  private)
                for version, image in (("1.0.0", images / "rootfs.img"), ("2.0.0", v2 / "rootfs.img"),
                                       ("3.0.0", v2 / "rootfs.img"))}  # (3.0.0: 2.0.0's root file system again)
    apps = {version: hello_bundle(tmp_path, version, private, healthy=version != "3.0.0", timeout_s=60.0)
            for version in ("1.0.0", "2.0.0", "3.0.0")}
    r1 = release(tmp_path, "1.0.0", firmware=firmware["1.0.0"], mode="r1", app=apps["1.0.0"], private=private)
    r2 = release(tmp_path, "1.1.0", firmware=firmware["2.0.0"], mode="r2", app=apps["2.0.0"], private=private)
    r3 = release(tmp_path, "1.2.0", firmware=firmware["3.0.0"], mode="r3", app=apps["3.0.0"], private=private)

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
            board.wait_for("HELLO: 1.0.0 up", since=mark)
            assert board.boots() == ["A"]

            # R2: a new root file system, booted on trial; the others converge on that boot
            mark = board.mark()
            start_rollout(tmp_path, db, "r2", r2, kind="release")
            done = the_device(rollout_end(db, "r2"))
            story = device_story(db, "r2")
            assert done["state"] == "succeeded", story
            assert board.boots() == ["A", "B"], (board.boots(), story)
            # each part's time to its hold; hello 2.0.0's files are 1.0.0's: none fetched
            assert "firmware 2.0.0 booted on trial after" in done["detail"], done
            assert "config:app held after" in done["detail"] and "(fetched 0 bytes" in done["detail"], done
            after = board.report(since=board.last_boot())
            assert after["slot"] == "B version 2.0.0" and after["agent"] == "active 0 restarts", after
            board.wait_for("BOARD-APP: loaded mode=r2", since=mark)
            board.wait_for("HELLO: 2.0.0 up", since=mark)

            # R3: its application fails on the trial boot of slot A: every part back on R2
            mark = board.mark()
            start_rollout(tmp_path, db, "r3", r3, kind="release")
            done = the_device(rollout_end(db, "r3"))
            story = device_story(db, "r3")
            assert done["state"] == "rolled_back", story
            assert "app:hello failed: hello 3.0.0 failed its health check" in done["detail"], done
            assert "500" in done["detail"] and "taken back whole" in done["detail"], done
            # (decided on the trial boot and said before its reboot: the board boots B again)
            wait_for(lambda: len(board.boots()) == 4, "the board to boot again", limit_s=900)
            assert board.boots() == ["A", "B", "A", "B"], (board.boots(), story)
            board.wait_for("BOARD-APP: loaded mode=r3", since=mark)  # applied and held on the trial boot...
            board.wait_for("HELLO: 3.0.0 up", since=mark)
            back = board.report(since=board.last_boot())
            assert back["slot"] == "B version 2.0.0" and back["agent"].startswith("active"), back
            loaded = [line for line in board.text(board.last_boot()).splitlines() if "BOARD-APP: loaded" in line]
            assert loaded and loaded[-1].endswith("loaded mode=r2"), loaded  # ...and written back
            board.wait_for("HELLO: 2.0.0 up", since=board.last_boot())
            said = "release: board 1.1.0 (rollout r2): runs every part of it"
            wait_for(lambda: said in cli("status", "--device", DEVICE, "--db", str(db)).stdout,
                     "the leader to say the board runs R2 whole", limit_s=300)
    finally:
        board.power_cut()
        kill(leader, signal.SIGTERM)
