"""Maintenance windows: device-local time ranges ("HH:MM-HH:MM") in which an update may start.

Shared by both sides: the rollout spec checks them (and how long a device may wait for one),
the device waits for the next one before it downloads. A window's end may lie before its start
(it crosses midnight).
"""

from __future__ import annotations

import re

_WINDOW = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-4]):([0-5]\d)$")
DAY_S = 86_400


def parse_window(text: str) -> tuple[int, int]:
    """`"22:00-06:00"` -> (79200, 21600) seconds of the day; the end may lie before the start
    (the window crosses midnight). Raises ValueError."""
    match = _WINDOW.match(text.strip())
    if match is None:
        raise ValueError(f"not a time range HH:MM-HH:MM: {text!r}")
    h1, m1, h2, m2 = (int(g) for g in match.groups())
    start, end = h1 * 3600 + m1 * 60, h2 * 3600 + m2 * 60
    if end > DAY_S or start == end:
        raise ValueError(f"empty or invalid time range: {text!r}")
    return start, end


def in_windows(windows: list[tuple[int, int]], second_of_day: float) -> bool:
    """True when `second_of_day` (device-local) lies in one of `windows` (none: always)."""
    if not windows:
        return True
    for start, end in windows:
        if start < end and start <= second_of_day < end:
            return True
        if start > end and (second_of_day >= start or second_of_day < end):
            return True
    return False


def seconds_until_window(windows: list[tuple[int, int]], second_of_day: float) -> float:
    """Seconds from `second_of_day` to the next moment inside a window (0 when inside)."""
    if in_windows(windows, second_of_day):
        return 0.0
    waits = [(start - second_of_day) % DAY_S for start, _ in windows]
    return min(waits)


def window_wait(windows: list[tuple[int, int]], now_ms: int, utc_offset_s: float) -> tuple[float, str]:
    """How long a device at `now_ms` (UTC, its zone `utc_offset_s` east) waits for its next
    window, and when that opens in its own time ("until 01:00 device time"); (0, "") inside one."""
    second = (now_ms / 1000 + utc_offset_s) % DAY_S
    wait = seconds_until_window(windows, second)
    if wait <= 0:
        return 0.0, ""
    opens = (second + wait) % DAY_S
    return wait, f"until {int(opens // 3600):02d}:{int(opens % 3600 // 60):02d} device time"


def longest_gap_s(windows: list[tuple[int, int]]) -> float:
    """The longest stretch of a day outside every window (a device may wait this long)."""
    if not windows:
        return 0.0
    covered = [False] * (DAY_S // 60)
    for minute in range(len(covered)):
        covered[minute] = in_windows(windows, minute * 60)
    if all(covered):
        return 0.0
    longest = run = 0
    for flag in covered + covered:  # twice round the clock: gaps crossing midnight
        run = 0 if flag else run + 1
        longest = max(longest, run)
    return float(min(longest, len(covered)) * 60)


__all__ = ["DAY_S", "in_windows", "longest_gap_s", "parse_window", "seconds_until_window", "window_wait"]
