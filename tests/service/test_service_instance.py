"""One agent per data directory: a second `run` is refused; a killed agent leaves nothing held."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.service.instance import AlreadyRunning, InstanceLock, running_pid

REPO = Path(__file__).resolve().parents[2]


def test_a_second_agent_on_one_data_dir_is_refused_naming_the_first(tmp_path: Path) -> None:
    assert running_pid(tmp_path) is None  # no lock file yet: nothing created by asking
    assert not (tmp_path / "agent.lock").exists()
    first = InstanceLock(tmp_path).acquire()
    try:
        assert running_pid(tmp_path) == os.getpid()
        with pytest.raises(AlreadyRunning, match=rf"another agent runs on {tmp_path} \(pid {os.getpid()}\)"):
            InstanceLock(tmp_path).acquire()
    finally:
        first.release()
    assert running_pid(tmp_path) is None
    InstanceLock(tmp_path).acquire().release()  # free again


def test_an_agent_killed_with_sigkill_holds_nothing(tmp_path: Path) -> None:
    code = ("import sys, time; from pathlib import Path; from agent.service.instance import InstanceLock;"
            f"InstanceLock(Path({str(tmp_path)!r})).acquire(); print('held', flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert running_pid(tmp_path) == child.pid
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        assert running_pid(tmp_path) is None
        InstanceLock(tmp_path).acquire().release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdout is not None
        child.stdout.close()
