"""The worker's updater is assembled without blocking the event loop on the root helper.

With `[firmware] helper_socket` the installer asks the helper for its slots when it is built. A
helper's first start is socket-activated and starts RAUC's service on D-Bus: seconds on a small
device, tens of them on an emulated one (the arm64 bench board). Meanwhile the loop pings
systemd's watchdog; a loop held up past half of `WatchdogSec=` gets the agent killed while it
starts.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest
from e2e.agent_support import worker

from agent.core.clock import SystemClock
from agent.core.errors import EdgeAgentError
from agent.transport.memory import MemoryBroker
from agent.worker.env import DeviceEnv
from agent.worker.updating import updater_part
from firmware_rollout.artifact.keys import SigningKey


class SlowHelper:
    """A helper socket that takes the connection and answers nothing until `release()`, then
    hangs up (the installer is refused: what matters is the wait)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.asked = threading.Event()
        self._release = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._sock.accept()
        self.asked.set()
        self._release.wait(60)
        conn.close()
        self._sock.close()

    def release(self) -> None:
        self._release.set()
        self._thread.join(10)


async def test_the_loop_runs_while_the_helper_is_slow_to_answer(tmp_path: Path) -> None:
    (tmp_path / "public.pem").write_bytes(SigningKey.generate().public.to_pem())
    helper = SlowHelper(tmp_path / "helper.sock")
    clock = SystemClock()
    sections = {"firmware": {"public_key": str(tmp_path / "public.pem"), "helper_socket": str(helper.path)}}
    device = await worker(clock, tmp_path, "pi-1", broker=MemoryBroker(clock=clock), sections=sections)
    try:
        building = asyncio.create_task(updater_part(device, DeviceEnv()))
        ticks = 0
        while not helper.asked.is_set() or ticks < 20:  # the loop goes on while the helper is asked
            await asyncio.sleep(0.01)
            ticks += 1
            assert ticks < 6000, "the helper was never asked"
        assert not building.done()
        helper.release()
        with pytest.raises(EdgeAgentError):
            await building
    finally:
        helper.release()
        await device.stop()
