"""Durations as people write them: `90`, `90s`, `10m`, `1.5h`, `7d`, `250ms` (seconds)."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_seconds(text: str) -> float:
    """The seconds `text` says; `ValueError` for anything else."""
    match = _DURATION.match(str(text))
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 10m, 1h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


__all__ = ["parse_seconds"]
