"""A hold whose word a test gives, as a release gives it to its parts."""

from __future__ import annotations

import asyncio


class Word:
    """A hold whose word the test gives: `asked` is set when the part is held."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.word: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def __call__(self) -> str:
        self.asked.set()
        return await self.word
