"""Maintenance windows: parsed, crossing midnight, the wait until the next one, the longest gap."""

from __future__ import annotations

import pytest

from rollout_engine.windows import in_windows, longest_gap_s, parse_window, seconds_until_window


def test_maintenance_windows() -> None:
    night = [parse_window("22:00-04:00")]
    assert in_windows(night, 23 * 3600) and in_windows(night, 3600) and not in_windows(night, 12 * 3600)
    assert seconds_until_window(night, 21 * 3600) == 3600
    assert seconds_until_window(night, 23 * 3600) == 0
    assert longest_gap_s(night) == 18 * 3600
    assert longest_gap_s([]) == 0
    assert in_windows([], 0)
    with pytest.raises(ValueError):
        parse_window("10:00-10:00")
