"""Fixtures of the worker tests: virtual time and an in-memory broker on it (`clock`, `broker`);
the local API in front of a worker with a leader (`online`) or without one (`offline`)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import until
from local_api_support import Setup, start_api, stop_api

from agent.core.clock import SystemClock
from agent.transport.memory import MemoryBroker


@pytest.fixture
async def online(tmp_path: Path) -> AsyncIterator[Setup]:
    setup = await start_api(tmp_path, MemoryBroker(clock=SystemClock()), with_leader=True)
    await until(SystemClock(), lambda: setup.device.transport.connected.is_open, what="connected")
    yield setup
    await stop_api(setup)


@pytest.fixture
async def offline(tmp_path: Path) -> AsyncIterator[Setup]:
    setup = await start_api(tmp_path, MemoryBroker(clock=SystemClock()), with_leader=False)
    yield setup
    await stop_api(setup)
