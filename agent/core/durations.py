"""Durations as people write them (`90`, `90s`, `10m`, `1.5h`, `7d`, `250ms`: `parse_seconds`)
and as the product prints them (`format_age`: `45s`, `2m05s`, `3h07m`, `12d04h`; `ago`), and a
moment as the product prints it (`utc_iso`: `2026-12-03T10:42:36Z`)."""

from __future__ import annotations

import re
import time

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_seconds(text: str) -> float:
    """The seconds `text` says; `ValueError` for anything else."""
    match = _DURATION.match(str(text))
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 10m, 1h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def format_age(seconds: float) -> str:
    """A duration for a person, in its two largest units: `45s`, `2m05s`, `3h07m`, `12d04h`."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def ago(now_ms: int, at_ms: int | None) -> str:
    """How long before `now_ms` the moment `at_ms` was: `2m05s ago`, or `never`."""
    return "never" if at_ms is None else f"{format_age((now_ms - at_ms) / 1000)} ago"


def utc_iso(ms: int) -> str:
    """A moment (ms since the Unix epoch) in UTC, to the second: `2026-12-03T10:42:36Z`."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


__all__ = ["ago", "format_age", "parse_seconds", "utc_iso"]
