"""Crash safety with real processes: a child enqueues and relays, and is SIGKILLed at random
moments, 50 times. After every kill: each message whose enqueue had returned (the child printed
its id) is still in the store or was delivered, no row's attempts went down, and the
conservation law holds. At the end a last child drains everything: all of it arrives."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.core.clock import SystemClock
from agent.outbox.store import OutboxStore

CHILD = Path(__file__).with_name("crash_child.py")
KILLS = 50


def read_delivered(path: Path) -> set[str]:
    if not path.exists():
        return set()
    text = path.read_text()
    lines = text.split("\n")
    return {line for line in lines[:-1] if line}  # the last piece may be a torn write


async def inspect(
    db: Path,
    printed: dict[int, str],
    delivered: set[str],
    attempts: dict[int, int],
    settled: set[int],
) -> tuple[int, int]:
    """Check every printed row not yet known to be delivered and gone (ids are never reused,
    so a settled row stays settled). Returns (rows still stored, pending count)."""
    store = await OutboxStore.open(db, clock=SystemClock(), max_attempts=10_000)
    try:
        stats = await store.stats()
        assert stats.conservation_ok, stats
        assert stats.enqueued >= len(printed)
        still = 0
        for row_id, msg_id in printed.items():
            if row_id in settled:
                continue
            row = await store.get(row_id)
            if row is None:
                assert msg_id in delivered, f"{msg_id} (row {row_id}) was lost"
                settled.add(row_id)
                continue
            assert row.msg_id == msg_id
            still += 1
            assert row.attempts >= attempts.get(row_id, 0), f"attempts of row {row_id} went down"
            attempts[row_id] = row.attempts
        return still, stats.pending
    finally:
        await store.close()


def start(db: Path, log: Path, run: int, mode: str, errfile) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(db), str(log), str(run), mode],
        stdout=subprocess.PIPE,
        stderr=errfile,
    )


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "outbox.db"
    log = tmp_path / "delivered.log"
    rng = random.Random(20261130)
    printed: dict[int, str] = {}
    attempts: dict[int, int] = {}
    settled: set[int] = set()
    retried_rows = 0
    with open(tmp_path / "child.err", "wb") as errfile:
        for run in range(KILLS):
            child = start(db, log, run, "produce", errfile)
            assert child.stdout is not None
            first = child.stdout.readline()
            if first != b"ready\n":
                child.kill()
                child.wait()
                raise AssertionError(
                    f"child {run} did not start: {first!r}\n"
                    + (tmp_path / "child.err").read_text()[-3000:]
                )
            time.sleep(rng.uniform(0.02, 0.3))
            child.send_signal(signal.SIGKILL)
            rest, _ = child.communicate()
            assert child.returncode == -signal.SIGKILL
            for line in rest.decode().split("\n")[:-1]:  # a torn last line was not "returned"
                row_id, msg_id = line.split(" ")
                assert int(row_id) not in printed or printed[int(row_id)] == msg_id
                printed[int(row_id)] = msg_id
            asyncio.run(inspect(db, printed, read_delivered(log), attempts, settled))
        retried_rows = sum(1 for a in attempts.values() if a > 0)

        drain = start(db, log, KILLS, "drain", errfile)
        drain.communicate(timeout=60)
        assert drain.returncode == 0, (tmp_path / "child.err").read_text()[-3000:]

    delivered = read_delivered(log)
    still, pending = asyncio.run(inspect(db, printed, delivered, attempts, settled))
    assert pending == 0 and still == 0
    assert set(printed.values()) <= delivered
    assert len(printed) > KILLS * 10  # the children did real work between kills
    print(f"{len(printed)} messages over {KILLS} kills, {retried_rows} rows retried")
    assert retried_rows > 0  # attempts were really exercised across the kills
