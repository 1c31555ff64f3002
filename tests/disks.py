"""File systems for the tests that a disk decides: the power-cut approximation (`LoopDisk`) and
a small tmpfs to fill up (`Tmpfs`).

The power-cut approximation: an ext4 file system on a loop-mounted image file.

A process writes to files on it; the test SIGKILLs the process and at once copies the image
file (`cut`): the copy holds what the block device held at that moment, without the file
system's dirty pages that never reached it, which is what a sudden power loss leaves behind.
Mounted (`mount_copy`), ext4 replays its journal and SQLite its WAL as they would at the next
boot. The image lives on a tmpfs of its own: what the loop device wrote is in the image at
once (an fsync reaching the device is honoured), and a busy host disk cannot slow the test.
Needs root and loop devices (CI's machines have both); elsewhere the tests skip, naming what
is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120)


class LoopDisk:
    """`with LoopDisk(workdir) as disk:` `disk.root` is the mounted file system."""

    def __init__(self, workdir: Path, *, size_mb: int = 32) -> None:
        self.workdir = workdir
        self.ram = workdir / "ram"  # a tmpfs for the image and its copies
        self.image = self.ram / "disk.img"
        self.root = workdir / "disk"
        self.size_mb = size_mb
        self._mounted: list[Path] = []
        self._cuts = 0

    def __enter__(self) -> LoopDisk:
        if os.geteuid() != 0:
            pytest.skip("the power-cut approximation mounts a loop device: needs root")
        for tool in ("mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                pytest.skip(f"the power-cut approximation needs {tool}")
        self.ram.mkdir(parents=True, exist_ok=True)
        ram = _run("mount", "-t", "tmpfs", "-o", f"size={3 * self.size_mb + 8}m", "tmpfs", str(self.ram))
        if ram.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {ram.stderr.strip()}")
        self._mounted.append(self.ram)
        with self.image.open("wb") as f:
            f.truncate(self.size_mb * 1024 * 1024)
        made = _run("mkfs.ext4", "-q", "-F", str(self.image))
        if made.returncode != 0:
            self.__exit__()
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
        self._mount(self.image, self.root, first=True)
        return self

    def _mount(self, image: Path, at: Path, *, first: bool = False) -> None:
        at.mkdir(parents=True, exist_ok=True)
        done = _run("mount", "-o", "loop", str(image), str(at))
        if done.returncode != 0:
            self.__exit__()
            if first:
                pytest.skip(f"cannot mount a loop device here: {done.stderr.strip()}")
            raise RuntimeError(f"mount {image}: {done.stderr.strip()}")
        self._mounted.append(at)

    def cut(self) -> Path:
        """The image as the block device holds it now (call it right after the SIGKILL)."""
        self._cuts += 1
        copy = self.ram / f"cut-{self._cuts}.img"
        shutil.copyfile(self.image, copy)
        return copy

    def mount_copy(self, copy: Path) -> Path:
        """Mount a `cut` (its journal replayed as at the next boot); its root."""
        at = self.workdir / copy.stem
        self._mount(copy, at)
        return at

    def __exit__(self, *exc: object) -> None:
        for at in reversed(self._mounted):
            if _run("umount", str(at)).returncode != 0:
                _run("umount", "-l", str(at))  # a process of the test still holds it: detach
        self._mounted.clear()  # (the images went with the tmpfs)


class Tmpfs:
    """`with Tmpfs(path, size_mb) as disk:` a small file system of its own at `disk.at`, to fill up."""

    def __init__(self, at: Path, size_mb: int) -> None:
        self.at = at
        self.size_mb = size_mb

    def __enter__(self) -> Tmpfs:
        if os.geteuid() != 0:
            pytest.skip("a file system to fill up is a tmpfs mount: needs root")
        self.at.mkdir(parents=True, exist_ok=True)
        done = _run("mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.at))
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        return self

    def fill(self, name: str = "filler") -> Path:
        """Write a file until the file system is full; its path."""
        filler = self.at / name
        chunk = b"\0" * 65536
        with filler.open("ab", buffering=0) as f:
            try:
                while True:
                    f.write(chunk)
            except OSError:
                pass
        return filler

    def __exit__(self, *exc: object) -> None:
        if _run("umount", str(self.at)).returncode != 0:
            _run("umount", "-l", str(self.at))
