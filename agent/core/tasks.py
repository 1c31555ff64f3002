"""Ending a background task the agent started itself."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: nothing to end) and wait until it has ended. The task's own
    cancellation is its expected end; a cancellation aimed at the caller while it waits is
    raised, so a stopping caller stops (the task is cancelled either way)."""
    if task is None:
        return
    current = asyncio.current_task()
    # (a caller already being cancelled, ending its tasks on the way out, is not cancelled anew)
    before = current.cancelling() if current is not None else 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > before:
            raise


__all__ = ["cancel_and_wait"]
