"""The disk reserve: given back only when the disk is full, made anew only when there is room
for it and to spare, and what /healthz says meanwhile. The whole worker on a full disk is
tests/e2e/test_full_disk.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.core.reserve import FULL_BELOW_BYTES, DiskReserve

MIB = 1024 * 1024


class Disk:
    """What the reserve sees of a disk with `free` bytes of room."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int) -> None:
        self.free = free
        self.reserve = DiskReserve(tmp_path, size=2 * MIB)
        monkeypatch.setattr(self.reserve, "free_bytes", lambda: self.free)


def test_a_disk_with_room_keeps_its_reserve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = Disk(tmp_path, monkeypatch, 500 * MIB)
    assert disk.reserve.restore() and disk.reserve.held
    assert (tmp_path / "disk-reserve").stat().st_size == 2 * MIB
    assert not disk.reserve.release_if_full()
    assert disk.reserve.held and disk.reserve.disk_state(min_free_bytes=64 * MIB)[0]


def test_a_full_disk_gets_the_reserve_back_once_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    disk = Disk(tmp_path, monkeypatch, 500 * MIB)
    disk.reserve.restore()
    disk.free = FULL_BELOW_BYTES - 1
    assert disk.reserve.release_if_full()
    assert not (tmp_path / "disk-reserve").exists() and disk.reserve.released
    assert [r.levelname for r in caplog.records] == ["ERROR"] and "disk full" in caplog.text
    disk.free = 2 * MIB  # the room it gave back
    healthy, line = disk.reserve.disk_state(min_free_bytes=1)
    assert not healthy and line.startswith("disk full: 2.0 MiB free") and "reserve is given back" in line
    assert not disk.reserve.release_if_full()  # nothing left to give


def test_the_reserve_comes_back_only_with_room_to_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = Disk(tmp_path, monkeypatch, 2 * MIB)
    assert not disk.reserve.restore()  # taking the last of the room would only fill the disk again
    assert not (tmp_path / "disk-reserve").exists()
    disk.free = 2 * MIB + FULL_BELOW_BYTES
    assert disk.reserve.restore() and not disk.reserve.released


def test_a_disk_with_little_room_is_nearly_full_not_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = Disk(tmp_path, monkeypatch, 500 * MIB)
    disk.reserve.restore()
    disk.free = 10 * MIB
    healthy, line = disk.reserve.disk_state(min_free_bytes=64 * MIB)
    assert not healthy and line.startswith("disk nearly full: 10.0 MiB free")
