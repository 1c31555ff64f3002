"""Run an asyncio program, on uvloop when it is installed and wanted."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None when uvloop is not importable."""
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run `main` to completion on a new event loop and return its result.

    With `use_uvloop` (the default) the loop is uvloop's when it is installed, else asyncio's.
    """
    factory = uvloop_factory() if use_uvloop else None
    if factory is None:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


__all__ = ["run", "uvloop_factory"]
