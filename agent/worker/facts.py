"""What a device says it is in its full heartbeats, read once from the system: `arch` (the
machine, as `uname -m`), `board` (the device tree's model on a Pi and other boards, else the
firmware's product name), `os` (os-release's PRETTY_NAME). Rollouts target by them
(`targets.match`); a value the system does not give is left out."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

BOARD_FILES = (Path("/proc/device-tree/model"), Path("/sys/firmware/devicetree/base/model"),
               Path("/sys/class/dmi/id/product_name"))
OS_RELEASE = (Path("/etc/os-release"), Path("/usr/lib/os-release"))
MAX_VALUE = 128


def _first_line(path: Path) -> str:
    try:
        return path.read_bytes()[:4096].decode(errors="replace").replace("\x00", "").strip().splitlines()[0]
    except (OSError, IndexError):
        return ""


def _pretty_name() -> str:
    for path in OS_RELEASE:
        try:
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("PRETTY_NAME="):
                    return line.partition("=")[2].strip().strip('"')
        except OSError:
            continue
    return ""


@functools.cache
def device_facts() -> dict[str, str]:
    """arch, board, os of this device (read once per process)."""
    board = next((v for v in map(_first_line, BOARD_FILES) if v), "")
    found = {"arch": platform.machine(), "board": board, "os": _pretty_name()}
    return {k: v[:MAX_VALUE] for k, v in found.items() if v}


__all__ = ["device_facts"]
