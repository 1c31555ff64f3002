"""The single writer thread: one queue of operations, group commit, results back on the loop.

Callers on the event loop submit operations (a function of the `Engine`) and await a future.
The thread takes everything queued, runs all write operations in ONE transaction (group
commit: a hundred concurrent enqueues share one COMMIT), commits, and only then runs the read
operations, so a read never sees uncommitted work. Results go back to the loop in one
`call_soon_threadsafe` per round, so an `enqueue` returns only after its commit.

With `inline=True` (the simulator's virtual clock asks for it) there is no thread: the queued
operations run on the loop itself, in a callback scheduled by the first submit of a loop turn,
still as one group commit. Nothing then depends on thread timing, so a simulated run with a
seed is reproducible, and no loop turn is spent waiting for another thread.

Durability is chosen per transaction: a round of writes commits at `synchronous = NORMAL` (the
commit is not synced: it survives a crash of the agent, not a power cut) unless it holds a write
submitted `durable=True`; then it commits at FULL (the WAL is synced before the commit returns, which
makes every earlier commit durable too). One fsync per round is the whole price of group
commit: a hundred durable enqueues in one round share it.

If a grouped transaction fails in SQLite (disk full, I/O error), it is rolled back and each of
its operations is retried alone, so one failing enqueue does not fail the acks next to it.
SQLite errors become `StoreError`; no sqlite3 exception reaches the caller.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from agent.core.errors import EdgeAgentError, StoreClosed, StoreError
from agent.core.marks import StoreMark
from agent.outbox.engine import Engine
from agent.outbox.schema import MARK_COUNTER, describe

log = logging.getLogger("agent.outbox")

# How often a synced commit also renews the store's mark (`agent.core.marks`): a rename and two
# fsyncs, so rarely enough not to wear an SD card (the mark at a clean stop is always written).
MARK_EVERY_S = 300.0
OpFn = Callable[[Engine], Any]
Results = list[tuple[Any, Any, BaseException | None]]
Deliver = Callable[[Results, bool], None]


class _Op:
    """One operation. `fut` is a future, or a list of futures when `fn` serves several callers
    at once and returns one (value, error) pair per future."""

    __slots__ = ("fn", "write", "wakes", "fut", "durable")

    def __init__(self, fn: OpFn, write: bool, wakes: bool, fut: Any, durable: bool = False) -> None:
        self.fn = fn
        self.write = write
        self.wakes = wakes
        self.fut = fut
        self.durable = durable


class _Close:
    __slots__ = ("fut",)

    def __init__(self, fut: asyncio.Future[Any]) -> None:
        self.fut = fut


def translate(exc: sqlite3.Error) -> StoreError:
    """The StoreError for a sqlite3 error (its text names a full disk as such)."""
    text = describe(exc)
    if getattr(exc, "sqlite_errorcode", 0) & 0xFF == 13 or "full" in str(exc).lower():
        err = StoreError(f"outbox database is full: {text}")
    else:
        err = StoreError(f"outbox database error: {text}")
    err.__cause__ = exc
    return err


class Writer:
    """Owns the thread and the `Engine` (created on that thread by `factory`)."""

    def __init__(
        self,
        factory: Callable[[], Engine],
        loop: asyncio.AbstractEventLoop,
        deliver: Deliver,
        *,
        name: str = "outbox-writer",
        inline: bool = False,
        mark: StoreMark | None = None,
    ) -> None:
        self._factory = factory
        self._mark = mark
        self._mark_due = 0.0  # monotonic time the next synced commit renews the mark
        self._loop = loop
        self._deliver = deliver
        self._ops: deque[_Op | _Close] = deque()
        self._wake = threading.Event()
        self._signalled = False  # a wake-up is already on its way: skip Event.set (a lock)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._opened: asyncio.Future[Engine] = loop.create_future()
        self.engine: Engine | None = None
        self.rounds = 0
        self.synced_commits = 0  # commits made at FULL (each one fsync of the WAL)
        self._full = True  # the connection's synchronous setting is FULL (as the store opens it)
        self.closed = False
        self.inline = inline

    # -- loop side -------------------------------------------------------------------------
    def start(self) -> asyncio.Future[Engine]:
        if not self.inline:
            self._thread.start()
            return self._opened
        try:
            self.engine = self._factory()
        except BaseException as exc:
            self.closed = True
            self._opened.set_exception(exc)
        else:
            self._opened.set_result(self.engine)
        return self._opened

    def _signal(self) -> None:
        self._signalled = True
        if self.inline:
            self._loop.call_soon(self._run_queued)
        else:
            self._wake.set()

    def _run_queued(self) -> None:
        """Inline mode: run everything queued so far (one round, like the thread's)."""
        self._signalled = False
        engine = self.engine
        if engine is not None:
            self._drain_queue(engine)

    def submit(self, fn: OpFn, *, write: bool, wakes: bool = False, durable: bool = False) -> asyncio.Future[Any]:
        """Queue `fn`; `durable`: its commit must survive a power cut before the answer."""
        if self.closed:
            raise StoreClosed("the outbox store is closed")
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._ops.append(_Op(fn, write, wakes, fut, durable))
        if not self._signalled:
            self._signal()
        return fut

    def submit_fanout(
        self, fn: OpFn, futs: list[asyncio.Future[Any]], *, write: bool, wakes: bool = False,
        durable: bool = False,
    ) -> None:
        """Like `submit`, for an `fn` returning a list of (value, error), one per future."""
        if self.closed:
            raise StoreClosed("the outbox store is closed")
        self._ops.append(_Op(fn, write, wakes, futs, durable))
        if not self._signalled:
            self._signal()

    def close(self) -> asyncio.Future[Any]:
        """Finish everything queued, close the connection, end the thread."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        if self.closed:
            fut.set_result(None)
            return fut
        self.closed = True
        self._ops.append(_Close(fut))
        if self.inline:
            if not self._signalled:
                self._signal()
        else:
            self._signalled = True
            self._wake.set()
        return fut

    def join(self, timeout_s: float | None = None) -> None:
        if not self.inline:
            self._thread.join(timeout_s)

    # -- thread side -----------------------------------------------------------------------
    def _post(self, fn: Callable[..., object], *args: object) -> None:
        if self.inline:
            self._loop.call_soon(fn, *args)
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:
            self.closed = True
            self._post(_fail, self._opened, exc)
            return
        self.engine = engine
        self._post(_succeed, self._opened, engine)
        while True:
            self._wake.wait()
            self._wake.clear()
            # From here on a submit must signal again; ops queued before are seen below.
            self._signalled = False
            if self._drain_queue(engine):
                return

    def _drain_queue(self, engine: Engine) -> bool:
        """Run the queued operations in rounds; True once the store has been closed."""
        while self._ops:
            batch: list[_Op] = []
            closer: _Close | None = None
            ops = self._ops
            while ops:
                op = ops.popleft()
                if isinstance(op, _Close):
                    closer = op
                    break
                batch.append(op)
            if batch:
                self._round(engine, batch)
            if closer is not None:
                self._shutdown(engine, closer)
                return True
        return False

    def _round(self, engine: Engine, batch: list[_Op]) -> None:
        self.rounds += 1
        results: Results = []
        wakes = False
        writes = [op for op in batch if op.write]
        if writes:
            for op, value, error in self._write_group(engine, writes):
                results.append((op.fut, value, error))
                wakes = wakes or (op.wakes and error is None)
        for op in batch:
            if op.write:
                continue
            try:
                value, error = op.fn(engine), None
            except sqlite3.Error as exc:
                value, error = None, translate(exc)
            except Exception as exc:
                value, error = None, exc
            results.append((op.fut, value, error))
            wakes = wakes or (op.wakes and error is None)
        if engine.books.flight.pop_freed():  # a settle let a row waiting behind another go
            wakes = True
        self._post(self._deliver, results, wakes)
        if self._mark is not None and self._full and writes and time.monotonic() >= self._mark_due:
            # the last commit was synced: what the counters say is on the disk
            self._mark_due = time.monotonic() + MARK_EVERY_S
            self._mark.write(MARK_COUNTER, engine.books.counters[MARK_COUNTER])

    def _write_group(
        self, engine: Engine, writes: list[_Op]
    ) -> list[tuple[_Op, Any, BaseException | None]]:
        out: list[tuple[_Op, Any, BaseException | None]] = []
        try:
            full = any(op.durable for op in writes)
            if full != self._full:  # outside any transaction: SQLite applies it to the next commit
                engine.books.conn.execute(f"PRAGMA synchronous = {'FULL' if full else 'NORMAL'}")
                self._full = full
            engine.books.begin()
            for op in writes:
                try:
                    out.append((op, op.fn(engine), None))
                except (EdgeAgentError, ValueError) as exc:
                    # Refused before it changed anything (or rolled back to its savepoint).
                    out.append((op, None, exc))
            engine.books.commit()
            if full:
                self.synced_commits += 1
            return out
        except sqlite3.Error as exc:
            engine.books.rollback()
            if len(writes) == 1:
                return [(writes[0], None, translate(exc))]
            log.warning("outbox: grouped write of %d operations failed (%s); retrying one by "
                        "one", len(writes), describe(exc))
        except Exception as exc:
            engine.books.rollback()
            if len(writes) == 1:
                return [(writes[0], None, exc)]
        return [self._write_group(engine, [op])[0] for op in writes]

    def _shutdown(self, engine: Engine, closer: _Close) -> None:
        for op in list(self._ops):
            if isinstance(op, _Op):
                futs = op.fut if isinstance(op.fut, list) else [op.fut]
                for fut in futs:
                    self._post(_fail, fut, StoreClosed("the outbox store is closed"))
        self._ops.clear()
        try:
            engine.books.conn.execute("PRAGMA optimize")
        except sqlite3.Error:
            pass
        try:
            engine.books.conn.close()  # the last connection: checkpoints and syncs
        except sqlite3.Error as exc:
            log.warning("outbox: closing the database failed: %s", describe(exc))
        else:
            if self._mark is not None:
                self._mark.write(MARK_COUNTER, engine.books.counters[MARK_COUNTER])
        self._post(_succeed, closer.fut, None)


def _succeed(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


__all__ = ["Writer", "translate"]
