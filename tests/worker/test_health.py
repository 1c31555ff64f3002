"""The device's count of how its agent runs on its firmware (`agent.worker.health`): the seconds it
ran, and an unexpected restart when a start finds the run before not stopped; a clean stop counts
none; a new firmware counts from zero; a power cut loses at most `FLUSH_S` of counted time."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.core.clock import VirtualClock
from agent.worker.health import FILE, FLUSH_S, HealthLedger


def started(tmp_path: Path, clock: VirtualClock) -> HealthLedger:
    ledger = HealthLedger(tmp_path, clock)
    ledger.open()
    return ledger


async def test_a_clean_stop_counts_no_restart_and_a_start_that_finds_the_run_not_stopped_counts_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = VirtualClock()
    first = started(tmp_path, clock)
    assert first.stated("") is None  # the firmware not known yet (the updater has not read the slots)
    await clock.advance(100)
    count = first.stated("1.0.0")
    assert count is not None and (count.firmware, count.operating_s, count.unexpected_restarts) == ("1.0.0", 100, 0)
    await clock.advance(50)
    first.close()

    second = started(tmp_path, clock)  # after a clean stop
    assert not second.restarted_unexpectedly
    await clock.advance(10)
    count = second.stated("1.0.0")
    assert count is not None and (count.operating_s, count.unexpected_restarts) == (160, 0)
    # ... and it is never closed: a crash, a SIGKILL, a power cut

    with caplog.at_level(logging.WARNING, logger="agent.worker.health"):
        third = started(tmp_path, clock)
    assert third.restarted_unexpectedly and "did not stop cleanly" in caplog.text
    count = third.stated("1.0.0")
    # (the 10 s the second run counted were not written: within FLUSH_S of its last write)
    assert count is not None and (count.operating_s, count.unexpected_restarts) == (150, 1)


async def test_a_new_firmware_counts_from_zero(tmp_path: Path) -> None:
    clock = VirtualClock()
    ledger = started(tmp_path, clock)
    await clock.advance(30)
    ledger.stated("1.0.0")
    ledger.close()
    ledger = HealthLedger(tmp_path, clock)
    ledger.open()
    ledger.open()  # (a second start without a stop in between: one unexpected restart, on 1.0.0)
    await clock.advance(20)
    count = ledger.stated("1.1.0")  # booted a new release: its own count
    assert count is not None and (count.firmware, count.operating_s, count.unexpected_restarts) == ("1.1.0", 20, 0)


async def test_a_running_count_is_written_every_flush_interval_and_an_unreadable_record_starts_again(
        tmp_path: Path) -> None:
    clock = VirtualClock()
    ledger = started(tmp_path, clock)
    ledger.stated("1.0.0")  # the firmware known: written at once (a crash from here is charged to it)
    written = (tmp_path / FILE).read_bytes()
    assert b'"1.0.0"' in written
    await clock.advance(FLUSH_S - 1)
    ledger.stated("1.0.0")
    assert (tmp_path / FILE).read_bytes() == written  # not yet
    await clock.advance(1)
    ledger.stated("1.0.0")
    after_crash = started(tmp_path, clock)  # never closed
    count = after_crash.stated("1.0.0")
    assert count is not None and (count.operating_s, count.unexpected_restarts) == (FLUSH_S, 1)

    (tmp_path / FILE).write_bytes(b"\x00 not json")
    fresh = started(tmp_path, clock)
    count = fresh.stated("1.0.0")
    assert count is not None and (count.operating_s, count.unexpected_restarts) == (0, 0)
