"""`atomic_write`, the one way a file is replaced: whole or not at all, the mode exactly as asked."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.core.files import atomic_write


def test_the_file_is_replaced_whole_with_exactly_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    old_umask = os.umask(0o077)
    try:
        atomic_write(target, b"new" * 100_000, mode=0o640)  # the umask would take the group's bit
        assert stat.S_IMODE(target.stat().st_mode) == 0o640
        atomic_write(tmp_path / "plain", b"x")  # no mode: what the umask leaves of 0666
        assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o600
    finally:
        os.umask(old_umask)
    assert target.read_bytes() == b"new" * 100_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "state.json"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)  # the disk fails once the temporary is written
    with pytest.raises(OSError, match="Input/output"):
        atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_directory_in_the_way_is_an_os_error_naming_nothing_half_done(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(OSError):
        atomic_write(tmp_path / "taken", b"data")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]
