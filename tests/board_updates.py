"""Firmware updates for a booted board (tests/qemu_board.py): the device's configs for a version
(the agent on RAUC through the root helper), a RAUC bundle of a slot image inside the fleet's
signed artifact, a bad image whose boot panics, and a rollout of one artifact to the board."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

from tests.e2e.agent_support import FLEET, db_query, wait_for
from tests.identity_broker import cli
from tests.qemu_board import HOST_FROM_GUEST

DEVICE = "board-1"
COMPATIBLE = "edge-agent-board"  # build-board.sh's system.conf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def device_files(tmp: Path, version: str, mqtt_port: int, public: Path, *, heartbeat_s: float | None = 5.0
                 ) -> tuple[Path, tuple[tuple[Path, str], ...]]:
    """The board's agent.toml and the files beside it (the helper's config, the fleet's key) for a
    root file system of `version` (`heartbeat_s` None: the default interval)."""
    conf = tmp / f"agent-{version}.toml"
    conf.write_text(f'[agent]\nrole = "worker"\ndevice_id = "{DEVICE}"\nfleet = "{FLEET}"\n'
                    f'data_dir = "/var/lib/edge-agent"\nfirmware_version = "{version}"\n\n'
                    f'[mqtt]\nurl = "mqtt://{HOST_FROM_GUEST}:{mqtt_port}"\n\n'
                    + (f'[heartbeat]\ninterval_s = {heartbeat_s}\n\n' if heartbeat_s else '') +
                    '[firmware]\npublic_key = "/etc/edge-agent/fleet-public.pem"\n'
                    'helper_socket = "/run/edge-agent-installer.sock"\nhealth_timeout_s = 600.0\n')
    helper = tmp / f"installer-{version}.toml"
    helper.write_text(f'[agent]\ndevice_id = "{DEVICE}"\nfirmware_version = "{version}"\n\n'
                      '[firmware]\npublic_key = "/etc/edge-agent/fleet-public.pem"\ninstaller = "rauc"\n'
                      'helper_state_dir = "/var/lib/edge-agent-installer"\nhelper_group = "edge-agent-installer"\n'
                      'helper_user = "edge-agent"\nreboot_command = ["systemctl", "reboot"]\n')
    return conf, ((helper, "/etc/edge-agent/installer.toml:0600:root:root"),
                  (public, "/etc/edge-agent/fleet-public.pem:0644"))


def rauc_bundle(tmp: Path, image: Path, version: str, cert: Path, key: Path) -> Path:
    src = tmp / f"bundle-{version}"
    src.mkdir()
    (src / "rootfs.img").hardlink_to(image)
    (src / "manifest.raucm").write_text(f"[update]\ncompatible={COMPATIBLE}\nversion={version}\n"
                                        "[bundle]\nformat=plain\n[image.rootfs]\nfilename=rootfs.img\n")
    out = tmp / f"update-{version}.raucb"
    # lz4: the board decompresses it under emulation (xz would save a quarter of the bytes and cost
    # minutes there)
    made = subprocess.run(["rauc", "bundle", "--mksquashfs-args=-comp lz4", "--cert", str(cert), "--key", str(key),
                           str(src), str(out)], capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stderr
    return out


#: RAUC installs a bundle whole (no chunk is copied from the active slot), so its artifact is cut in
#: fixed chunks of 1 MiB, as docs/firmware-devices.md advises: a sixteenth of the chunks (each
#: checked, written and fsynced by the helper, and recorded) that content-defined chunks make
RAUC_CHUNK_BYTES = 1024 * 1024


def artifact(tmp: Path, bundle: Path, version: str, private: Path) -> Path:
    out = tmp / f"update-{version}.eafw"
    built = cli("firmware", "build", str(bundle), "--version", version, "--key", str(private), "--out", str(out),
                "--chunk-size", str(RAUC_CHUNK_BYTES))
    assert built.returncode == 0, built.stderr
    return out


def start_rollout(tmp: Path, db: Path, rid: str, art: Path, *, kind: str = "firmware") -> None:
    """A rollout of `art` (an artifact, or a config release with `kind="config"`) to the board, in
    one wave."""
    spec = tmp / f"{rid}.toml"
    spec.write_text(f'[rollout]\nname = "{rid}"\nkind = "{kind}"\nartifact = "{art}"\n[waves]\ncounts = [1]\n'
                    '[device]\ntimeout_s = 1200\n')
    # queued, then waited for as an event: the leader admits the artifact first (a 230 MiB image's
    # hash takes longer than the CLI's own 10 s wait on a loaded host)
    started = cli("rollout", "start", str(spec), "--db", str(db), "--id", rid, "--no-wait")
    assert started.returncode == 0, started.stderr

    def applied() -> str | None:
        rows = db_query(db, "SELECT COALESCE(outcome, ''), result FROM rollout_controls WHERE rollout_id = ?"
                            " AND action = 'start' AND applied_ms IS NOT NULL", (rid,))
        return f"{rows[0][0]}: {rows[0][1]}" if rows else None

    outcome = wait_for(applied, f"the leader's start of {rid}", limit_s=900)
    assert outcome.startswith("applied"), outcome


def rollout_status(db: Path, rid: str) -> dict[str, Any]:
    out = cli("rollout", "status", rid, "--db", str(db), "--json", "--devices")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def rollout_end(db: Path, rid: str) -> dict[str, Any]:
    """The rollout's status once it is no longer running (or waiting to)."""

    def ended() -> dict[str, Any] | None:
        status = rollout_status(db, rid)
        return None if status["state"] in ("running", "scheduled") else status

    return dict(wait_for(ended, f"rollout {rid} to end", limit_s=2400))


def device_story(db: Path, rid: str) -> list[str]:
    """What the board reported in rollout `rid`, in order ("state: detail"), for a failure's message."""
    rows = db_query(db, "SELECT state, detail FROM rollout_device_events WHERE rollout_id = ? AND device_id = ? "
                        "ORDER BY at_ms", (rid, DEVICE))
    return [f"{state}: {detail}" for state, detail in rows]


def telemetry(db: Path) -> int:
    return len(db_query(db, "SELECT 1 FROM app_messages WHERE device_id = ? AND class = 'telemetry'", (DEVICE,)))


def bad_image(tmp: Path, slot: Path, version: str) -> Path:
    """A root file system whose boot panics: the slot's kernel and initramfs (made with `slot`),
    and no init for them to start."""
    root = tmp / f"bad-root-{version}"
    (root / "etc").mkdir(parents=True)
    shutil.copy(slot / "vmlinuz", root / "vmlinuz")
    shutil.copy(slot / "initrd.img", root / "initrd.img")
    (root / "etc" / "edge-agent-board").write_text(f"VERSION={version}\n")
    image = tmp / f"bad-{version}.img"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(root), str(image), "128M"], check=True,
                   capture_output=True)  # (bench_device's stdout is its JSON line alone)
    return image


def rauc_keys(tmp: Path) -> tuple[Path, Path]:
    """The key and certificate RAUC bundles are signed with (the board's keyring holds the cert)."""
    key, cert = tmp / "rauc.key.pem", tmp / "rauc.cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-subj", "/CN=edge-agent board updates", "-days", "30"], check=True,
                   capture_output=True)
    return key, cert


def heard_from(db: Path) -> bool:
    return bool(db_query(db, "SELECT 1 FROM devices WHERE device_id = ? AND hb_seq >= 0", (DEVICE,)))


__all__ = ["COMPATIBLE", "DEVICE", "artifact", "bad_image", "device_files", "free_port", "heard_from", "rauc_bundle",
           "rauc_keys", "rollout_end", "rollout_status", "start_rollout",
           "telemetry"]
