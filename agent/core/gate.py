"""A two-state signal (open / closed) that tasks can wait on in either direction.

The transport owns one and opens it while connected; the relay's readiness gate waits on it, so
nothing is sent and no attempt is spent while offline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Gate:
    def __init__(self, *, is_open: bool = False) -> None:
        self._open = asyncio.Event()
        self._closed = asyncio.Event()
        (self._open if is_open else self._closed).set()
        self._listeners: list[Callable[[bool], object]] = []

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def open(self) -> None:
        if not self._open.is_set():
            self._closed.clear()
            self._open.set()
            self._notify(True)

    def close(self) -> None:
        if not self._closed.is_set():
            self._open.clear()
            self._closed.set()
            self._notify(False)

    async def wait_open(self) -> None:
        await self._open.wait()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def add_listener(self, callback: Callable[[bool], object]) -> None:
        """Call `callback(is_open)` on every change, synchronously, in registration order."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[bool], object]) -> None:
        self._listeners.remove(callback)

    def _notify(self, is_open: bool) -> None:
        for callback in list(self._listeners):
            callback(is_open)
