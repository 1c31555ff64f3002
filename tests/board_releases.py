"""Releases for a booted A/B board (tests/qemu_board.py): the board's agent.toml with RAUC through
the root install helper, a config target its service reloads and the application helper; the
folders of releases R1, R2 and R3 of its whole state, whose application is the container
application `web` (tests/oci_images.py) podman runs on the board (tests/board/test_board_release.py
and `scripts/bench_apps.py --release` take them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.board_updates import artifact, device_files, rauc_bundle, rauc_keys
from tests.identity_broker import cli
from tests.oci_images import web_bundle
from tests.qemu_board import HERE, build_board, build_deb

CONFIG_TARGET = ('\n[config_targets.app]\ndirectory = "/etc/board-app"\ndocuments = ["app.toml"]\n'
                 'health_command = ["/usr/local/sbin/board-app-healthy"]\nconfirm_s = 90.0\nsettle_s = 5.0\n'
                 '\n[apps]\nhelper_socket = "/run/edge-agent-apps.sock"\n')
UNITS = ("board-app.service", "board-app-config.path", "board-app-reload.service")
IMAGE_PADDING = 8 * 1024 * 1024  # the container image's base layer: busybox and 8 MiB that never change


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
                  *((HERE / unit, f"/etc/systemd/system/{unit}:0644") for unit in UNITS),
                  (HERE / "board-emulated-start.conf",
                   "/etc/systemd/system/edge-agent.service.d/emulated-start.conf:0644"),
                  (HERE / "board-rss", "/usr/local/sbin/board-rss:0755"),
                  (HERE / "board-rss@.service", "/etc/systemd/system/board-rss@.service:0644"),
                  (HERE / "board-rss.conf", "/etc/systemd/system/edge-app-web.service.d/board-rss.conf:0644"))


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


@dataclass(frozen=True)
class ReleaseBoard:
    images: Path  # the board (slot A: 1.0.0)
    public: Path  # the fleet's public key
    firmware: dict[str, Path]  # version -> its artifact (a RAUC bundle of a root file system)
    apps: dict[str, Path]  # version -> web's bundle (3.0.0's health check fails)
    releases: dict[str, Path]  # R1, R2, R3 -> the release document, its parts beside it


def release_board(tmp_path: Path, mqtt_port: int, *, health_timeout_s: float = 60.0) -> ReleaseBoard:
    """The board (podman installed) and three releases of its whole state: R1 (firmware 1.0.0,
    which it runs; config app 1.0.0; web 1.0.0), R2 (firmware 2.0.0, config 1.1.0, web 2.0.0: its
    image's base layer is 1.0.0's), R3 (firmware 3.0.0, 2.0.0's root file system again; config
    1.2.0; web 3.0.0, whose container's health check fails)."""
    keys = tmp_path / "keys"
    assert cli("firmware", "keygen", "--out", str(keys)).returncode == 0
    private, public = keys / "private.pem", keys / "public.pem"
    rauc_key, rauc_cert = rauc_keys(tmp_path)
    deb = build_deb(tmp_path / "debs")
    conf_1, files_1 = board_files(tmp_path / "v1", "1.0.0", mqtt_port, public)
    images = build_board(deb, conf_1, tmp_path / "board", adds=files_1,
                         options=("--version", "1.0.0", "--rauc-keyring", str(rauc_cert), "--containers"))
    conf_2, files_2 = board_files(tmp_path / "v2", "2.0.0", mqtt_port, public)
    v2 = build_board(deb, conf_2, tmp_path / "v2-board", adds=files_2,
                     options=("--version", "2.0.0", "--rauc-keyring", str(rauc_cert), "--slot-only", "--containers"))
    firmware = {version: artifact(tmp_path, rauc_bundle(tmp_path, image, version, rauc_cert, rauc_key), version,
                                  private)
                for version, image in (("1.0.0", images / "rootfs.img"), ("2.0.0", v2 / "rootfs.img"),
                                       ("3.0.0", v2 / "rootfs.img"))}  # (3.0.0: 2.0.0's root file system again)
    apps = {version: web_bundle(tmp_path, version, private, healthy=version != "3.0.0", padding=IMAGE_PADDING,
                                timeout_s=health_timeout_s) for version in ("1.0.0", "2.0.0", "3.0.0")}
    r1 = release(tmp_path, "1.0.0", firmware=firmware["1.0.0"], mode="r1", app=apps["1.0.0"], private=private)
    r2 = release(tmp_path, "1.1.0", firmware=firmware["2.0.0"], mode="r2", app=apps["2.0.0"], private=private)
    r3 = release(tmp_path, "1.2.0", firmware=firmware["3.0.0"], mode="r3", app=apps["3.0.0"], private=private)
    return ReleaseBoard(images=images, public=public, firmware=firmware, apps=apps,
                        releases={"R1": r1, "R2": r2, "R3": r3})


__all__ = ["ReleaseBoard", "board_files", "release", "release_board"]
