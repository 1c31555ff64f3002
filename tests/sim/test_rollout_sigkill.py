"""The leader (with its devices) SIGKILLed mid-wave and restarted: the rollout completes exactly."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from agent.core.clock import SystemClock
from agent.core.errors import StoreError
from rollout_engine.messages import RolloutReport
from rollout_engine.store import RolloutStore

CHILD = Path(__file__).with_name("rollout_child.py")
DEVICES = 60


def spawn(work: Path, pace_s: float = 0.0) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    args = [sys.executable, str(CHILD), str(work), str(DEVICES), "3", str(pace_s)]
    return subprocess.Popen(args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def mid_wave(db: Path) -> bool:
    """Wave 1 is running with some devices mid-update and some not offered or answered yet."""
    if not db.exists():
        return False
    try:
        with RolloutStore.open_readonly(db, clock=SystemClock()) as store:
            rollout = store.latest()
            if rollout is None:
                return False
            states = store.counts(rollout.id).get(1, {})
            wave = store.wave(rollout.id, 1)
    except StoreError:  # the rollout tables are not there yet
        return False
    busy = sum(states.get(s, 0) for s in ("downloading", "installing", "rebooting", "verifying"))
    waiting = sum(states.get(s, 0) for s in ("queued", "notified", "downloading"))
    return wave is not None and wave.state == "running" and busy > 0 and waiting > 0


def committed_at(work: Path, device: str) -> int | None:
    conn = sqlite3.connect(work / "devices" / device / "updater.db")
    try:
        rows = conn.execute("SELECT body FROM reports ORDER BY seq").fetchall()
    finally:
        conn.close()
    for (body,) in rows:
        report = msgspec.msgpack.decode(body, type=RolloutReport)
        if report.phase == "committed":
            return report.ts_ms
    return None


@pytest.mark.slow
def test_leader_killed_mid_wave_resumes_exactly(tmp_path: Path) -> None:
    db = tmp_path / "leader" / "leader.db"
    first = spawn(tmp_path, pace_s=0.01)
    try:
        deadline = time.monotonic() + 90
        while not mid_wave(db):
            assert first.poll() is None, first.stderr.read() if first.stderr else ""  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the rollout never reached the middle of wave 1"
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate(timeout=30)  # reap it and close its pipes
    assert first.returncode == -signal.SIGKILL

    second = spawn(tmp_path)
    out, err = second.communicate(timeout=100)
    assert second.returncode == 0, err[-3000:]
    status = json.loads(out.strip().splitlines()[-1])

    assert status["state"] == "succeeded", status["detail"]
    assert [w["state"] for w in status["waves"]] == ["passed"] * 4
    assert status["counts"] == {"succeeded": DEVICES}
    assert sum(w["size"] for w in status["waves"]) == status["devices"] == DEVICES

    conn = sqlite3.connect(db)
    try:
        offers = conn.execute("SELECT device_id, at_ms FROM rollout_offers").fetchall()
        waves = conn.execute("SELECT idx, started_ms, finished_ms FROM rollout_waves ORDER BY idx").fetchall()
    finally:
        conn.close()
    for (_, _, finished), (_, started, _) in zip(waves, waves[1:], strict=False):
        assert started >= finished  # no wave skipped or started early
    by_device: dict[str, list[int]] = {}
    for device, at_ms in offers:
        by_device.setdefault(device, []).append(at_ms)
    assert len(by_device) == DEVICES
    for device, times in by_device.items():
        done = committed_at(tmp_path, device)
        assert done is not None, f"{device} never committed"
        assert all(at <= done for at in times), f"{device} was offered the image after it succeeded"
