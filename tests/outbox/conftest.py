"""Fixtures for the outbox store tests: a virtual clock, a store factory that closes what it
opened. Helpers (message builder, conservation check) live in `store_support`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from store_support import OpenStore

from agent.core.clock import VirtualClock
from agent.outbox.store import OutboxStore


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "outbox.db"


@pytest.fixture
async def open_store(db_path: Path, clock: VirtualClock) -> AsyncIterator[OpenStore]:
    """`await open_store(**options)` opens the outbox at `db_path`; all are closed at the end."""
    opened: list[OutboxStore] = []

    async def _open(path: Path | None = None, **kwargs: Any) -> OutboxStore:
        kwargs.setdefault("clock", clock)
        store = await OutboxStore.open(path or db_path, **kwargs)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        await store.close()


@pytest.fixture
async def store(open_store: OpenStore) -> OutboxStore:
    return await open_store(max_attempts=3)
