"""The console's one way to write a moment: 24-hour, to the second, in the time zone of the host
the console runs on (the fleet's gateway), which every page states. The charts' axes, the
tables and the live pages' "updated" stamp all use it; nothing is left to the browser's locale."""

from __future__ import annotations

import time


def moment(ms: int) -> str:
    """`2026-12-06 11:30:05`, in the console host's zone."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


def zone(ms: int | None = None) -> str:
    """The zone `moment` writes in, as the pages state it: `UTC` or `UTC+01:00` (its name beside)."""
    t = time.localtime((ms if ms is not None else time.time() * 1000) / 1000)
    offset = t.tm_gmtoff or 0
    if offset == 0:
        return "UTC"
    sign, offset = ("+" if offset > 0 else "-"), abs(offset)
    name = f" ({t.tm_zone})" if t.tm_zone and t.tm_zone not in ("UTC", "GMT") else ""
    return f"UTC{sign}{offset // 3600:02d}:{offset % 3600 // 60:02d}{name}"


__all__ = ["moment", "zone"]
