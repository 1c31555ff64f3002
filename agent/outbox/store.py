"""`OutboxStore`: the durable outbox, as seen from the event loop.

Writes are handed to the single writer thread (`agent.outbox.writer`) and awaited, so the loop
never waits on a lock or an fsync. Writes from concurrent callers share one transaction (group
commit); `enqueue` returns once its message is committed, and, for a class of durability
"power" (the default), once that commit is synced to the disk: it survives a power cut. Acks,
nacks and the other bookkeeping commit unsynced (a power cut may deliver a message again, which
the receiver's dedup absorbs; it never loses one).

The relay's view (`take_ready`, `ack`, `nack`, `release`, `dead_letter`, `next_due_ms`,
`wait_for_change`) follows `agent.outbox.types.OutboxReader`. Its polls (`take_ready`,
`next_due_ms`) read on the loop's own thread through a second, read-only connection: in WAL
mode a reader sees the last commit without taking a lock, never syncs, and costs no thread hop.
In-flight rows are tracked in memory; an idle store performs no write transaction.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from agent.core.clock import Clock, SystemClock, TimerHandle
from agent.core.errors import StoreClosed
from agent.core.marks import StoreMark
from agent.outbox.engine import Engine
from agent.outbox.policy import DEFAULT_CLASS, DURABILITIES, ClassPolicy, Durability
from agent.outbox.reads import Reader
from agent.outbox.schema import PAGE_SIZE, PAGE_SIZES, open_database
from agent.outbox.settle import NACK_OUTCOMES, NackOutcome
from agent.outbox.types import EnqueueResult, OutboxMessage, OutboxRow, OutboxStats
from agent.outbox.writer import Writer, translate

T = TypeVar("T")

# How long the commit of an OVERWRITE row's ack may wait for the next write (see
# `OutboxStore.ack`): longer than the default heartbeat interval (5 s), so an idle worker's
# delivered heartbeat leaves in the same transaction as the next one arrives.
ACK_DELAY_MS = 10_000
_ACK_BATCH = 1_024  # deferred acks that are committed without waiting any longer

log = logging.getLogger("agent.outbox")


class OutboxStore:
    """Durable store-and-forward queue in one SQLite file. Create with `await OutboxStore.open()`.

    Raises `StoreError` (disk full, I/O), `OutboxFull` (a class at its cap under policy
    `reject`), `StoreClosed` (after `close()`), `ValueError` for malformed arguments.
    """

    def __init__(
        self,
        *,
        path: Path,
        clock: Clock,
        writer: Writer,
        reader: Reader,
        recovered_from: str | None,
        lost_from: str | None = None,
        ack_delay_ms: int = 0,
        durability: Durability = "power",
        classes: Mapping[str, ClassPolicy] | None = None,
    ) -> None:
        self.path = path
        self._clock = clock
        self._writer = writer
        self._reader = reader
        self.recovered_from = recovered_from  # where a damaged file was moved at open
        self.lost_from = lost_from  # where a file that had lost state was moved at open
        self._version = 0
        self._seen: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = (
            weakref.WeakKeyDictionary()
        )
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._enq: list[tuple[OutboxMessage, int, int]] = []
        self._enq_futs: list[asyncio.Future[EnqueueResult]] = []
        self._enq_now = 0  # clock reading of this loop turn's first enqueue
        # Deferred acks (see `ack`): ids, the timer that commits them, the delay.
        self._acks: list[int] = []
        self._ack_timer: TimerHandle | None = None
        self._ack_delay_s = ack_delay_ms / 1000.0
        # SystemClock.busy() is a no-op: skip building a context manager per call.
        self._plain_clock = type(clock) is SystemClock
        # Durability: the store's, and the classes that name another one.
        self.durability: Durability = durability
        self._other = frozenset(k for k, c in (classes or {}).items()
                                if c.durability is not None and c.durability != durability)

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        clock: Clock,
        durability: Durability = "power",
        max_attempts: int = 20,
        classes: Mapping[str, ClassPolicy] | None = None,
        default_class: ClassPolicy = DEFAULT_CLASS,
        busy_timeout_ms: int = 5_000,
        max_db_bytes: int | None = None,
        ack_delay_ms: int = ACK_DELAY_MS,
        page_size: int = PAGE_SIZE,
    ) -> OutboxStore:
        """Open (or create) the outbox at `path`. A damaged file is moved aside and a fresh one
        started (`recovered_from` names where it went); so is a file that lost state since its
        mark says otherwise (`lost_from`; see `agent.core.marks`). `max_db_bytes` caps the file size:
        beyond it writes fail with `StoreError` until space is freed or the cap raised.
        `ack_delay_ms`: how long the commit of an OVERWRITE row's ack may wait to share a
        transaction with the next write (see `ack`); 0 commits every ack at once.
        `page_size` (bytes, a power of two) applies when the file is created: small pages wear
        an SD card less, large ones drain big backlogs faster (see `schema.PAGE_SIZE`).
        `durability`: what `enqueue` promises for a class whose policy names none ("power": the
        commit is synced before it returns; "crash": committed, not synced; see `Writer`)."""
        p = Path(path)
        if ack_delay_ms < 0:
            raise ValueError(f"ack_delay_ms must be >= 0, got {ack_delay_ms}")
        if page_size not in PAGE_SIZES:
            raise ValueError(f"page_size must be a power of two from 512 to 65536: {page_size!r}")
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be power or crash, got {durability!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        recovered: list[str | None] = [None, None]
        readers: list[Reader] = []
        now_ms = clock.now_ms()

        def factory() -> Engine:
            # FULL while the tables are made: a power cut must not take a store's tables away.
            conn, recovered[0], recovered[1] = open_database(
                p, synchronous="FULL", busy_timeout_ms=busy_timeout_ms, now_ms=now_ms,
                page_size=page_size,
            )
            rconn: sqlite3.Connection | None = None
            try:
                engine = Engine(
                    conn, max_attempts=max_attempts, classes=classes, default_class=default_class
                )
                if max_db_bytes is not None:
                    engine.set_max_pages(_pages(conn, max_db_bytes))
                # The relay's polls read on the loop's thread through a connection of their own.
                rconn = sqlite3.connect(
                    str(p), isolation_level=None, check_same_thread=False
                )
                # A WAL reader only waits in rare cases (recovery); never stall the loop long.
                rconn.execute(f"PRAGMA busy_timeout = {min(int(busy_timeout_ms), 250)}")
                rconn.execute("PRAGMA query_only = ON")
                readers.append(Reader(rconn, engine.books.flight))
            except BaseException as exc:
                conn.close()
                if rconn is not None:
                    rconn.close()
                if isinstance(exc, sqlite3.Error):
                    raise translate(exc) from exc
                raise
            return engine

        loop = asyncio.get_running_loop()
        holder: list[OutboxStore] = []

        def deliver(results: list[tuple[Any, Any, BaseException | None]], wakes: bool) -> None:
            for fut, value, error in results:
                if type(fut) is list:
                    if error is not None:
                        value = [(None, error)] * len(fut)
                    for f, (v, e) in zip(fut, value, strict=True):
                        if not f.done():
                            if e is None:
                                f.set_result(v)
                            else:
                                f.set_exception(e)
                elif fut.done():
                    continue
                elif error is None:
                    fut.set_result(value)
                else:
                    fut.set_exception(error)
            if wakes and holder:
                holder[0]._changed()  # noqa: SLF001 - the store itself, made by this classmethod

        # A clock may ask for store work on the loop itself (the simulator's virtual clock does,
        # so a run does not depend on thread timing): see `Writer`'s `inline`.
        inline = clock.inline_io
        writer = Writer(factory, loop, deliver, name=f"outbox-writer:{p.name}", inline=inline, mark=StoreMark(p))
        with clock.busy():
            await writer.start()
        store = cls(
            path=p, clock=clock, writer=writer, reader=readers[0], recovered_from=recovered[0], lost_from=recovered[1],
            ack_delay_ms=ack_delay_ms, durability=durability, classes=classes,
        )
        holder.append(store)
        return store

    # -- plumbing --------------------------------------------------------------------------
    async def _call(self, fn: Callable[[Engine], T], *, write: bool, wakes: bool = False,
                    durable: bool = False) -> T:
        if self._closed:
            raise StoreClosed("the outbox store is closed")
        if self._acks:  # deferred acks go first, in the same round: every read sees them
            self._flush_acks()
        fut = self._writer.submit(fn, write=write, wakes=wakes, durable=durable)
        if self._plain_clock:
            return await fut
        with self._clock.busy():
            return await fut

    def _changed(self) -> None:
        self._version += 1
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def _observe(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._seen[task] = self._version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def write_transactions(self) -> int:
        """Write transactions committed by this store since it was opened."""
        engine = self._writer.engine
        return engine.books.write_transactions if engine is not None else 0

    def durability_of(self, kind: str) -> Durability:
        """What an enqueue of `kind` promises once it returns."""
        if kind in self._other:
            return "crash" if self.durability == "power" else "power"
        return self.durability

    def _durable(self, kinds: Sequence[str]) -> bool:
        """Whether a write of messages of these kinds must be synced before it is answered."""
        if self.durability == "power":
            other = self._other
            return not other or any(k not in other for k in kinds)
        return any(k in self._other for k in kinds)

    @property
    def synced_commits(self) -> int:
        """Commits synced to the disk (durable rounds) since the store was opened."""
        return self._writer.synced_commits

    @property
    def pending(self) -> int:
        """Pending rows of every class as the store's own books count them (no query: what a
        heartbeat reports). Read from the loop thread, so a commit under way may not be in it."""
        engine = self._writer.engine
        return sum(d[0] for d in list(engine.books.depth.values())) if engine is not None else 0

    @property
    def in_flight(self) -> int:
        engine = self._writer.engine
        return len(engine.books.inflight) if engine is not None else 0

    # -- producers -------------------------------------------------------------------------
    async def enqueue(self, msg: OutboxMessage, *, delay_ms: int = 0) -> EnqueueResult:
        """Store one message; returns once it is committed. See `EnqueueResult`.

        Enqueues made in the same event-loop turn travel to the writer as one operation (and
        are committed together with everything else queued there)."""
        if self._closed:
            raise StoreClosed("the outbox store is closed")
        fut: asyncio.Future[EnqueueResult] = self._loop.create_future()
        pending = self._enq
        if not pending:
            self._enq_now = self._clock.now_ms()
            self._loop.call_soon(self._send_enqueues)
        # On the system clock the enqueues of one loop turn share its first reading (they are
        # microseconds apart); a virtual clock is read for each (it may move within a turn).
        now = self._enq_now if self._plain_clock else self._clock.now_ms()
        pending.append((msg, now, delay_ms))
        self._enq_futs.append(fut)
        if self._plain_clock:
            return await fut
        with self._clock.busy():
            return await fut

    def _send_enqueues(self) -> None:
        items, futs = self._enq, self._enq_futs
        self._enq, self._enq_futs = [], []
        try:
            if self._acks:  # one transaction: the delivered heartbeat out, the next one in
                self._flush_acks()
            durable = self._durable([m.kind for m, _, _ in items])
            self._writer.submit_fanout(
                lambda e: e.enqueue_each(items), futs, write=True, wakes=True, durable=durable
            )
        except StoreClosed as exc:
            for f in futs:
                if not f.done():
                    f.set_exception(exc)

    async def supersede(self, owner: str, receiver: str, key: str, seq: int) -> int:
        """Drop the pending rows of an OVERWRITE `key` older than `seq`: a newer message of
        the key was delivered directly, so they would only arrive stale (counted overwritten;
        rows in flight are left to their ack). Returns how many were dropped."""
        if self._closed:
            raise StoreClosed("the outbox store is closed")
        result: int = await self._call(lambda e: e.supersede(owner, receiver, key, seq), write=True)
        return result

    async def enqueue_many(
        self, msgs: Sequence[OutboxMessage], *, delay_ms: int = 0
    ) -> list[EnqueueResult]:
        """Store several messages in one go, all or nothing (OutboxFull stores none)."""
        if not msgs:
            return []
        now = self._clock.now_ms()
        batch = list(msgs)
        return await self._call(
            lambda e: e.enqueue(batch, now, delay_ms), write=True, wakes=True,
            durable=self._durable([m.kind for m in batch]),
        )

    # -- the relay's view (OutboxReader) ---------------------------------------------------
    async def take_ready(
        self,
        *,
        limit: int,
        partition: int = 0,
        partitions: int = 1,
        kinds: Sequence[str] | None = None,
    ) -> list[OutboxRow]:
        """Due rows of this partition, marked in flight (see `OutboxReader`). A read on the
        loop's thread (WAL reader: no lock, no sync); expired rows met are handed to the writer
        to be deleted and counted, never returned."""
        if self._closed:
            raise StoreClosed("the outbox store is closed")
        now = self._clock.now_ms()
        self._observe()
        reader = self._reader
        try:
            rows, expired = reader.take_ready(now, limit, partition, partitions, kinds)
        except sqlite3.Error as exc:
            raise translate(exc) from exc
        if expired:
            self._expire_soon(now, expired)
        if reader.unblock:  # a row waits for a deferred ack of its key: commit it now
            reader.unblock = False
            self._flush_acks()
        if reader.retake:  # a row's blocker was settled while we scanned: look again
            reader.retake = False
            self._changed()
        await asyncio.sleep(0)  # a poll stays a suspension point for the caller's loop
        return rows

    def _expire_soon(self, now: int, ids: list[int]) -> None:
        self._write_behind(lambda e: e.settle.expire(now, ids), "deleting expired rows")

    def _write_behind(self, op: Callable[[Any], Any], what: str) -> None:
        """Queue a write nobody awaits; the virtual clock counts it as work in progress. A
        failure is logged: its rollback leaves the rows as they were (expired rows are found
        again by the next take, rows whose ack failed are delivered again)."""
        fut = self._writer.submit(op, write=True)
        busy = None if self._plain_clock else self._clock.busy()
        if busy is not None:
            busy.__enter__()

        def done(f: asyncio.Future[Any]) -> None:
            if busy is not None:
                busy.__exit__(None, None, None)
            if not f.cancelled() and f.exception() is not None:
                log.warning("outbox: %s failed: %s", what, f.exception())

        fut.add_done_callback(done)

    async def ack(self, row_ids: Sequence[int]) -> None:
        """Delivered: the rows leave the outbox.

        Acks of OVERWRITE rows the relay holds (heartbeats: their key is written again soon)
        are done at once in memory (the rows stay in flight, so they are never handed out
        again) while the commit that deletes them waits up to `ack_delay_ms` to share its
        transaction with the next write: an idle device then writes once per heartbeat (the
        delivered one out, the next one in: the same pages), not twice. Any other store call,
        `close`, a batch of `_ACK_BATCH` acks, or a newer row of the key waiting commits them
        at once. A crash before that commit delivers those rows again (at least once; the
        receiver keeps the latest seq of a key). Every other ack (append rows, FIFO classes,
        rows not in flight) is committed before this returns."""
        ids = list(row_ids)
        if not ids:
            return
        if self._closed:
            raise StoreClosed("the outbox store is closed")
        engine = self._writer.engine
        if self._ack_delay_s <= 0 or engine is None or not engine.books.flight.defer_acks(ids):
            # No wake of its own: the settle tells whether a row waited behind these.
            await self._call(lambda e: e.settle.ack(ids), write=True)
            return
        self._acks.extend(ids)
        if len(self._acks) >= _ACK_BATCH:
            self._flush_acks()
        elif self._ack_timer is None:
            self._ack_timer = self._clock.call_later(self._ack_delay_s, self._flush_acks)
        # No wake: a row of the key arriving meanwhile is found behind this one by the next
        # take (its enqueue wakes the relay), which commits the deferred acks at once.
        await asyncio.sleep(0)

    def _flush_acks(self) -> None:
        """Hand the deferred acks to the writer (queued ahead of whatever comes next)."""
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        ids, self._acks = self._acks, []
        if not ids or self._writer.closed:
            return
        # On failure the rows stay pending (the rollback put them back): delivered again later.
        self._write_behind(lambda e: e.settle.ack(ids), f"committing {len(ids)} acks")

    async def nack(
        self, row_id: int, *, delay_ms: int, error: str, outcome: NackOutcome = "transient"
    ) -> bool:
        """See `OutboxReader.nack`: `outcome="capacity"` (the receiver was busy) spends no
        attempt; `"transient"` does."""
        if outcome not in NACK_OUTCOMES:
            raise ValueError(f"outcome must be one of {NACK_OUTCOMES}, got {outcome!r}")
        now = self._clock.now_ms()
        return await self._call(
            lambda e: e.settle.nack(row_id, now, delay_ms, error, outcome), write=True, wakes=True
        )

    async def release(self, row_ids: Sequence[int]) -> None:
        ids = list(row_ids)
        if not ids:
            return
        engine = self._writer.engine
        # Only an OVERWRITE row can need a write (coalesced behind a newer one of its key).
        keyed = engine is not None and engine.books.flight.keyed(ids)
        await self._call(lambda e: e.settle.release(ids), write=keyed, wakes=True)

    async def dead_letter(self, row_id: int, *, error: str) -> None:
        await self._call(lambda e: e.settle.dead_letter(row_id, error), write=True, wakes=True)

    async def next_due_ms(self) -> int | None:
        if self._closed:
            raise StoreClosed("the outbox store is closed")
        self._observe()
        try:
            return self._reader.next_due_ms()
        except sqlite3.Error as exc:
            raise translate(exc) from exc

    async def wait_for_change(self) -> None:
        """Return when an enqueue, nack, release or replay, or an ack of a row another one waited
        behind (a FIFO receiver's, an OVERWRITE key's), may have made work ready since the
        calling task last looked (take_ready, next_due_ms or this call). Acks of other rows
        wake nobody."""
        if self._closed:
            raise StoreClosed("the outbox store is closed")
        task = asyncio.current_task()
        seen = self._seen.get(task) if task is not None else None
        if seen is None or seen == self._version:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
            if self._closed:
                raise StoreClosed("the outbox store is closed")
        if task is not None:
            self._seen[task] = self._version

    async def expire_due(self) -> int:
        """Delete (and count) every pending row past its expires_at. take_ready also expires
        the rows it meets, so calling this is only needed to free space early."""
        now = self._clock.now_ms()
        return await self._call(lambda e: e.settle.expire(now), write=True)

    # -- inspection and dead letters -------------------------------------------------------
    async def stats(self) -> OutboxStats:
        now = self._clock.now_ms()
        return await self._call(lambda e: e.stats(now), write=False)

    async def list_dead(self, limit: int = 100, offset: int = 0) -> list[OutboxRow]:
        return await self._call(
            lambda e: e.list_dead(limit, offset), write=False
        )

    async def get(self, row_id: int) -> OutboxRow | None:
        return await self._call(lambda e: e.get(row_id), write=False)

    async def replay(self, row_ids: Sequence[int] | None = None) -> int:
        """Dead rows back to pending (attempts 0, due now); all of them when `row_ids` is None."""
        now = self._clock.now_ms()
        ids = None if row_ids is None else list(row_ids)
        return await self._call(
            lambda e: e.settle.replay(ids, now), write=True, wakes=True
        )

    async def purge(self, row_ids: Sequence[int] | None = None) -> int:
        """Delete dead rows (all of them when `row_ids` is None); returns how many."""
        ids = None if row_ids is None else list(row_ids)
        return await self._call(lambda e: e.settle.purge(ids), write=True)

    async def set_max_db_bytes(self, max_db_bytes: int) -> None:
        """Change the file size cap (see `open`)."""
        await self._call(
            lambda e: e.set_max_pages(_pages(e.books.conn, max_db_bytes)), write=False
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def close(self) -> None:
        """Finish every queued write, close the database. Idempotent."""
        if self._closed:
            return
        self._flush_acks()  # queued before the close: committed by it
        self._closed = True
        # The reader goes first, so the writer's connection is the last one and its close
        # (which checkpoints the WAL and syncs) runs on the writer thread, not on the loop.
        try:
            self._reader.conn.close()
        except sqlite3.Error as exc:
            log.warning("outbox: closing the reader failed: %s", exc)
        fut = self._writer.close()
        with self._clock.busy():
            await fut
        self._writer.join(5.0)  # the thread ends right after posting the close result
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()

    async def __aenter__(self) -> OutboxStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _pages(conn: Any, max_db_bytes: int) -> int:
    if max_db_bytes < 1:
        raise ValueError(f"max_db_bytes must be >= 1, got {max_db_bytes}")
    page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
    return max(1, max_db_bytes // page_size)


__all__ = ["ACK_DELAY_MS", "ClassPolicy", "OutboxStore"]
