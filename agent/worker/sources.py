"""Built-in sources of application messages, each off unless configured (`[sources]`).

    SystemSource    the psutil sample as a JSON message every `interval_s` (the heartbeat keeps
                    only the newest sample; a time series needs its own class)
    CommandSource   runs a command every `interval_s`; each line of its stdout (JSON) is a message
    FileSource      tails a file of JSON lines; the offset after the last line handed over is kept
                    in worker.db, and each line's message id is derived from the file and the
                    line's offset, so a restart neither skips a line nor stores one twice (a line
                    re-read after a crash carries the same id: the outbox or the leader drops it).
                    A file replaced (logrotate: a new inode) or truncated in place is read from its
                    start; lines appended to a truncated file before the next poll, up to the old
                    size, cannot be told from old ones (copytruncate's race: prefer a rename)

A line that is not JSON is skipped with a warning (counted); a full class holds the source back
until there is room (its lines wait in the file, the command's next run comes later).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from agent.core.clock import Clock
from agent.core.config import CommandSourceSection, FileSourceSection, SystemSourceSection
from agent.core.sqlite import Synchronous, atomic
from agent.core.store import Store
from agent.core.tasks import cancel_and_wait
from agent.protocol import SystemSample
from agent.service.parts import PartBase
from agent.worker.messages import MessageIntake, Refusal, Submission

log = logging.getLogger(__name__)

JSON = "application/json"
RETRY_S = 5.0  # a refused or failed hand-over is tried again after this


class SourceOffsets(Store):
    """Where each file source stopped, in worker.db: (source name) -> (inode, offset, generation).
    The generation counts the times the file was truncated in place: a line at an offset read
    before has another id after that."""

    COMPONENT = "sources"
    WHAT = "source offsets"

    @staticmethod
    def _v1(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE source_offsets (name TEXT PRIMARY KEY, inode INTEGER NOT NULL,"
                     " offset INTEGER NOT NULL, generation INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID")

    MIGRATIONS = (_v1,)

    @classmethod
    def open(cls, path: str | Path, *, synchronous: Synchronous = "FULL") -> SourceOffsets:
        return cls(cls.connect_migrated(path, synchronous=synchronous), path=str(path))

    def get(self, name: str) -> tuple[int, int, int] | None:
        self.check_open()
        row = self._conn.execute("SELECT inode, offset, generation FROM source_offsets WHERE name = ?",
                                 (name,)).fetchone()
        return None if row is None else (int(row[0]), int(row[1]), int(row[2]))

    def put(self, name: str, inode: int, offset: int, generation: int = 0) -> None:
        self.check_open()
        with atomic(self._conn):
            self._conn.execute(
                "INSERT INTO source_offsets (name, inode, offset, generation) VALUES (?, ?, ?, ?) ON CONFLICT (name)"
                " DO UPDATE SET inode = excluded.inode, offset = excluded.offset, generation = excluded.generation",
                (name, inode, offset, generation))


class Source:
    """A loop on the Clock; `start()` / `stop()`."""

    name = "source"

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.skipped = 0  # lines that were not JSON
        self.errors = 0

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"source:{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        raise NotImplementedError

    async def _hand_over(self, intake: MessageIntake, subs: Sequence[Submission]) -> bool:
        """Submit `subs` (one transaction); False (and a warning) if they were not taken."""
        try:
            if len(subs) == 1:
                await intake.submit(subs[0])
            else:
                await intake.submit_many(subs)
        except Refusal as exc:
            self.errors += 1
            log.warning("source %s: %d messages not taken yet: %s", self.name, len(subs), exc)
            return False
        self.sent += len(subs)
        return True


def _json_lines(text: str, source: str) -> tuple[list[bytes], int]:
    """The JSON lines of `text` re-encoded compactly, and how many lines were not JSON."""
    out: list[bytes] = []
    bad = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            bad += 1
            log.warning("source %s: skipped a line that is not JSON: %r", source, line[:80])
            continue
        out.append(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    return out, bad


class SystemSource(Source):
    name = "system"

    def __init__(self, intake: MessageIntake, settings: SystemSourceSection, *, clock: Clock,
                 sample: Callable[[], SystemSample]) -> None:
        super().__init__(clock)
        self._intake = intake
        self._settings = settings
        self._sample = sample

    async def _run(self) -> None:
        while True:
            payload = msgspec.json.encode(self._sample())
            await self._hand_over(self._intake, [Submission(self._settings.cls, payload, JSON)])
            await self._clock.sleep(self._settings.interval_s)


class CommandSource(Source):
    def __init__(self, name: str, intake: MessageIntake, settings: CommandSourceSection, *, clock: Clock) -> None:
        super().__init__(clock)
        self.name = f"command.{name}"
        self._intake = intake
        self._settings = settings

    async def _run(self) -> None:
        while True:
            await self.run_once()
            await self._clock.sleep(self._settings.interval_s)

    async def run_once(self) -> None:
        s = self._settings
        try:
            proc = await asyncio.create_subprocess_exec(
                *s.command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL)
        except OSError as exc:
            self.errors += 1
            log.warning("source %s: cannot run %s: %s", self.name, s.command[0], exc.strerror or exc)
            return
        try:
            out, _ = await self._clock.wait_for(proc.communicate(), s.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            self.errors += 1
            log.warning("source %s: %s ran longer than %gs; killed", self.name, s.command[0], s.timeout_s)
            return
        if proc.returncode != 0:
            self.errors += 1
            log.warning("source %s: %s exited %s; its output is not sent", self.name, s.command[0], proc.returncode)
            return
        lines, bad = _json_lines(out.decode("utf-8", "replace"), self.name)
        self.skipped += bad
        if len(lines) > s.max_lines:
            log.warning("source %s: %d lines, only the first %d are sent", self.name, len(lines), s.max_lines)
            lines = lines[: s.max_lines]
        if lines:
            await self._hand_over(self._intake, [Submission(s.cls, line, JSON) for line in lines])


class FileSource(Source):
    def __init__(self, name: str, intake: MessageIntake, settings: FileSourceSection, *, clock: Clock,
                 offsets: SourceOffsets, device_id: str, batch_max: int = 200) -> None:
        super().__init__(clock)
        self.name = f"file.{name}"
        self._intake = intake
        self._settings = settings
        self._offsets = offsets
        self._device = device_id
        self._batch_max = batch_max
        self.path = Path(settings.path)

    def _msg_id(self, inode: int, generation: int, offset: int) -> str:
        digest = hashlib.blake2b(f"{self._device}\0{self.name}\0{inode}\0{generation}\0{offset}".encode(),
                                 digest_size=16)
        return "f" + digest.hexdigest()

    async def _run(self) -> None:
        while True:
            try:
                progressed = await self.poll()
            except OSError as exc:
                self.errors += 1
                log.warning("source %s: cannot read %s: %s", self.name, self.path, exc.strerror or exc)
                progressed = False
            if not progressed:
                await self._clock.sleep(self._settings.poll_s)

    async def poll(self) -> bool:
        """Hand over the complete lines after the kept offset (up to `batch_max`); True if any."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        kept = self._offsets.get(self.name)
        inode, offset, generation = (kept if kept is not None and kept[0] == st.st_ino else (st.st_ino, 0, 0))
        if offset > st.st_size:  # truncated in place: start again at the top, its lines are new ones
            offset, generation = 0, generation + 1
        if offset == st.st_size:
            return False
        limit = self._settings.max_line_bytes
        subs: list[Submission] = []
        end = offset
        with open(self.path, "rb") as f:
            f.seek(offset)
            while len(subs) < self._batch_max:
                line = f.readline(limit + 1)
                if not line or not line.endswith(b"\n"):
                    if len(line) > limit:  # one line over the limit: skipped whole
                        self.skipped += 1
                        log.warning("source %s: skipped a line over %d bytes at offset %d", self.name, limit, end)
                        rest = f.readline()
                        while rest and not rest.endswith(b"\n"):
                            rest = f.readline()
                        end += len(line) + len(rest)
                        continue
                    break  # a line still being written: next time
                at = end
                end += len(line)
                payloads, bad = _json_lines(line.decode("utf-8", "replace"), self.name)
                self.skipped += bad
                subs += [Submission(self._settings.cls, p, JSON, msg_id=self._msg_id(inode, generation, at))
                         for p in payloads]
        if subs and not await self._hand_over(self._intake, subs):
            await self._clock.sleep(RETRY_S)
            return False
        self._offsets.put(self.name, inode, end, generation)  # after the hand-over: a crash re-reads, same ids
        return end > offset


class Sources(PartBase):
    """The configured sources of one worker: a part of it (`agent.service.parts`)."""

    name = "sources"

    def __init__(self, sources: Sequence[Source], offsets: SourceOffsets | None) -> None:
        self.sources = list(sources)
        self._offsets = offsets

    async def start(self) -> None:
        for source in self.sources:
            await source.start()

    async def stop(self) -> None:
        for source in self.sources:
            await source.stop()
        if self._offsets is not None:
            self._offsets.close()


__all__ = ["CommandSource", "FileSource", "Source", "SourceOffsets", "Sources", "SystemSource"]
