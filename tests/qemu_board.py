"""A booted board: the disk scripts/build-board.sh makes (a boot partition with GRUB, or U-Boot's
boot script on arm64, running RAUC's A/B logic, root file systems A and B holding the agent's
Debian package in Debian bookworm, a data partition), booted by QEMU with systemd as PID 1; the
host is 10.0.2.2 to it (QEMU's user networking), and its serial console is a file the test reads.
A reboot inside the board is a reset of the same QEMU (the boot loader decides again);
`power_cut()` is SIGKILL of QEMU: the guest's page cache is lost, as in a power loss."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.e2e.agent_support import FLEET, REPO

HOST_FROM_GUEST = "10.0.2.2"  # QEMU's user networking: the host's loopback, seen from the guest
HERE = Path(__file__).with_name("board")  # what the tests put on a board: its report, an application
UBOOT_ARM64 = Path("/usr/lib/u-boot/qemu_arm64/u-boot.bin")  # Debian's u-boot-qemu


def have_board_tools(arch: str = "amd64") -> str:
    """Why a board cannot be built and booted here ("" when it can)."""
    if os.geteuid() != 0:
        return "builds a root file system: needs root"
    tools = ["mmdebstrap", "mkfs.ext4", "fakeroot", "dpkg-deb"]
    tools += ["qemu-system-x86_64"] if arch == "amd64" else ["qemu-system-aarch64", "mkimage", "mkfs.vfat", "mcopy"]
    missing = [t for t in tools if shutil.which(t) is None]
    if arch != "amd64" and not UBOOT_ARM64.exists():
        missing.append(str(UBOOT_ARM64))
    if arch != "amd64" and not Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists():
        missing.append("binfmt for arm64 (qemu-user-static; update-binfmts --enable qemu-aarch64)")
    return f"needs {', '.join(missing)} (scripts/test.sh, scripts/board.sh install them)" if missing else ""


def board_config(path: Path, device: str, mqtt_url: str, more: str = "") -> Path:
    """The board's /etc/edge-agent/agent.toml: a worker of the tests' fleet reaching the host's
    broker at `mqtt_url`, with `more` (further TOML) after it."""
    path.write_text(f'[agent]\nrole = "worker"\ndevice_id = "{device}"\nfleet = "{FLEET}"\n'
                    f'data_dir = "/var/lib/edge-agent"\n\n[mqtt]\nurl = "{mqtt_url}"\n{more}')
    return path


def package_inputs_key() -> str:
    """A hash of what the package is made of: every file git tracks outside the tests and docs."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    digest = hashlib.sha256()
    for name in sorted(n for n in listed.decode().split("\0") if n and not n.startswith(("tests/", "docs/", ".ci/"))):
        path = REPO / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def build_deb(out: Path, arch: str = "amd64") -> Path:
    """The package of this checkout, built once per content (kept in the bench's cache, beside the
    board's base: every board test and the package's own test install the same bytes)."""
    cache = Path(os.environ.get("EDGE_AGENT_CACHE", "/var/cache/edge-agent-bench")) / "debs"
    cache.mkdir(parents=True, exist_ok=True)
    kept = cache / (package_inputs_key() + ("" if arch == "amd64" else f"-{arch}"))
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two tests at once build it once
        if not any(kept.glob("*.deb")):
            built = subprocess.run(["bash", str(REPO / "scripts" / "build-deb.sh"), "--arch", arch, "--out", str(kept)],
                                   capture_output=True, text=True, timeout=900)
            assert built.returncode == 0, built.stderr
            for old in sorted(cache.iterdir(), key=lambda d: d.stat().st_mtime)[:-4]:  # keep the newest few
                if old.is_dir() and old != kept:
                    shutil.rmtree(old, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    deb = next(kept.glob("*.deb"))
    shutil.copy(deb, out / deb.name)
    return out / deb.name


def build_board(deb: Path, config: Path, out: Path, *, adds: tuple[tuple[Path, str], ...] = (),
                options: tuple[str, ...] = (), arch: str = "amd64") -> Path:
    """`adds`: (file, "DEST[:MODE[:OWNER]]") put into the board; `options`: build-board.sh's own
    (`--version V`, `--rauc-keyring CERT`, `--slot-only`)."""
    args = ["bash", str(REPO / "scripts" / "build-board.sh"), "--arch", arch, "--deb", str(deb),
            "--config", str(config), "--out", str(out),
            "--add", f"{HERE / 'board-report'}:/usr/local/sbin/board-report",
            "--add", f"{HERE / 'board-report.service'}:/etc/systemd/system/board-report.service",
            "--add", f"{HERE / 'board-journal.service'}:/etc/systemd/system/board-journal.service", *options]
    for src, dest in adds:
        args += ["--add", f"{src}:{dest}"]
    built = subprocess.run(args, capture_output=True, text=True, timeout=3600)  # (arm64's base: 8 min, once)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


class QemuBoard:
    def __init__(self, images: Path, workdir: Path, arch: str = "amd64") -> None:
        self.images = images
        self.arch = arch
        workdir.mkdir(parents=True, exist_ok=True)
        self.console = workdir / "console.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def power_on(self, oem: str = "") -> QemuBoard:
        """Boot from the disk (the boot loader picks the slot); `oem` is a string the board's units
        may test, e.g. "board.sender": an SMBIOS OEM string (/sys/firmware/dmi/entries/11-0/raw)
        on amd64, a firmware configuration file (/sys/firmware/qemu_fw_cfg/by_name/opt/board/raw)
        on arm64, whose U-Boot hands the kernel no SMBIOS."""
        accel = ["-accel", "tcg"]  # nested KVM does not work on these machines: never depend on it
        if self.arch == "amd64":
            machine = ["qemu-system-x86_64"]
        else:
            machine = ["qemu-system-aarch64", "-M", "virt", "-cpu", "cortex-a72", "-bios", str(UBOOT_ARM64)]
        argv = [*machine, *accel, "-m", "1024", "-smp", "2", "-nographic",
                "-drive", f"file={self.images / 'disk.img'},if=virtio,format=raw,cache=writeback",
                "-nic", "user,model=virtio-net-pci"]
        if oem:
            argv += (["-smbios", f"type=11,value={oem}"] if self.arch == "amd64"
                     else ["-fw_cfg", f"name=opt/board,string={oem}"])
        with self.console.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.started = time.monotonic()
        return self

    def text(self, since: int = 0) -> str:
        """The console from byte `since` on (see `mark`)."""
        if not self.console.exists():
            return ""
        with self.console.open("rb") as f:
            f.seek(since)
            return f.read().decode("utf-8", "replace")

    def tail(self, lines: int = 80) -> str:
        """The console's last `lines` lines (the agent's and the helper's journal among them)."""
        return "\n".join(self.text().splitlines()[-lines:])

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """A failed assertion inside says what the board's console said last."""
        try:
            yield
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- the board's console, last lines:\n{self.tail()}") from None

    def mark(self) -> int:
        """Where the console ends now: `wait_for` and `report` from here on see what comes later."""
        return self.console.stat().st_size if self.console.exists() else 0

    def wait_for(self, mark: str, limit_s: float = 600.0, *, since: int = 0) -> str:
        """The console's first line holding `mark` (polled as it grows; QEMU ending is a failure)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for line in self.text(since).splitlines():
                if mark in line:
                    return line.strip()
            assert self.proc is not None and self.proc.poll() is None, f"QEMU ended:\n{self.text()[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(f"{mark!r} not on the console within {limit_s}s:\n{self.text()[-3000:]}")

    def last_boot(self) -> int:
        """Where the console's last boot begins (GRUB's choice), for `report(since=...)`."""
        return self.console.read_bytes().rfind(b"EA-BOOT") if self.console.exists() else 0

    def boots(self) -> list[str]:
        """The slot GRUB chose at each boot, in order."""
        return [line.split("slot=", 1)[1].split()[0] for line in self.text().splitlines() if "EA-BOOT slot=" in line]

    def report(self, since: int = 0) -> dict[str, str]:
        """The board's report ("BOARD: key value..." lines up to "done") of the first boot after
        `since`: key -> the rest."""
        self.wait_for("BOARD: done", since=since)
        found: dict[str, str] = {}
        text = self.text(since)
        for line in text[:text.index("BOARD: done")].splitlines():
            if "BOARD: " in line:
                key, _, rest = line.split("BOARD: ", 1)[1].strip().partition(" ")
                found[key] = f"{found[key]}\n{rest}" if key in found and key in ("error", "warning") else rest
        return found

    def power_cut(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


__all__ = ["HERE", "HOST_FROM_GUEST", "QemuBoard", "board_config", "build_board", "build_deb", "have_board_tools"]
