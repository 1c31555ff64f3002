"""The relay: drains the outbox to a `Deliver` callable, adapting its rate to the receiver.

Shape (no task per message):

    Relay
    ├── watcher            awaits store.wait_for_change() and wakes every partition
    ├── ack flusher        acks delivered rows in groups (one store.ack per batch; a drain
    │                      loop lets the ack under way land before its next take)
    └── partition i of N   receivers hashed by FNV-1a (the store filters by partition)
        ├── drain loop     take_ready() into per-class lanes, sleeps when nothing is ready
        └── lane per class (bulkhead): its own AimdLimiter, an in-memory queue and up to
            `limits.max` long-lived sender coroutines pulling from it

A lane keeps at most twice its limit in memory; once full, the drain loop takes only the other
classes it knows, so a slow class or receiver does not stall the rest. Classes are known from
`classes=` (pass the configured ones), from rows seen, and, while some lane is full, from the
store's per-class stats every `discovery_interval_s` (the only periodic read, and only while
there is a backlog). FIFO classes are enforced by the store (at most one row per receiver in
flight).

Outcomes of one delivery (typed, never by text):

* returns: success, AIMD +1, the row is acked in the next batch;
* `Capacity(retry_after_ms)`: AIMD halves, nack with `retry_after_ms` plus full jitter;
* `Transient`: limit unchanged, nack with backoff (at least the transient floor);
* `Permanent`: dead letter at once;
* anything else: logged and treated as `Transient` with the exception's text.

Readiness: while `ready` is closed nothing is sent and no attempt is spent. Rows already taken
but not started are handed back untried (`release`). A delivery already started when the gate
closes is allowed to finish; a success or a `Capacity`/`Permanent` answer counts as usual, while a
`Transient` failure is released untried instead of nacked (the link went away, not the message's
fault). On reopen, sending resumes after a jittered delay in `[0, reconnect_jitter_s]`.

Idle: when nothing is ready the drain loops sleep until a store change or the earliest `send_at`
(through the `Clock`). No polling, no write transaction. (While a row is due but another
partition or a full lane has not taken it yet, a drain loop looks again after a backoff of
0.05 s doubling to 5 s, reads only: `next_due_ms` spans all partitions.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from agent.core.clock import Clock, TimerHandle
from agent.core.errors import (
    Capacity,
    DeliveryError,
    Permanent,
    StoreClosed,
    StoreError,
    Transient,
)
from agent.core.gate import Gate
from agent.outbox._lane import Lane
from agent.outbox.limiter import AimdSettings
from agent.outbox.metrics import LaneMetrics, RelayMetrics
from agent.outbox.partition import fnv1a_32
from agent.outbox.retry import RetryPolicy
from agent.outbox.types import OutboxReader, OutboxRow, OutboxStats

log = logging.getLogger(__name__)

RELAY_STOP_S = 15.0  # the longest an agent's shutdown waits for its relay (`Relay.stop_within`)

Deliver = Callable[[OutboxRow], Awaitable[None]]

_STORE_RETRY_S = 1.0  # pause after a store error before the drain loop tries again
_RECHECK_MIN_S = 0.05  # first look again at a due row another partition has not taken yet
_RECHECK_MAX_S = 5.0
_DUE_EPSILON_S = 0.001


class _Partition:
    __slots__ = ("index", "lanes", "wake", "task", "discovered_at", "recheck_s", "want_room")

    def __init__(self, index: int) -> None:
        self.index = index
        self.recheck_s = _RECHECK_MIN_S
        self.discovered_at = float("-inf")
        self.lanes: dict[str, Lane] = {}
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        # False while the drain loop sleeps having taken every ready row it could see: a lane
        # making room then has nothing to take (new rows come with a store change).
        self.want_room = True

    def room(self) -> None:
        """A lane could take a batch again: wake the drain loop if it waits for room."""
        if self.want_room:
            self.wake.set()


class Relay:
    """Drains `store` through `deliver` while `ready` is open. Start with `start()` or
    `async with`; `stop()` hands every untried row back to the store and flushes acks."""

    def __init__(
        self,
        store: OutboxReader,
        deliver: Deliver,
        *,
        clock: Clock,
        ready: Gate,
        partitions: int = 4,
        retry: RetryPolicy | None = None,
        limits: AimdSettings | None = None,
        rng: random.Random | None = None,
        reconnect_jitter_s: float = 5.0,
        classes: Sequence[str] = (),
        discovery_interval_s: float = 5.0,
        name: str = "relay",
    ) -> None:
        if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
            raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")
        if not reconnect_jitter_s >= 0:
            raise ValueError(f"reconnect_jitter_s must be >= 0, got {reconnect_jitter_s!r}")
        self._store = store
        self._deliver = deliver
        self._clock = clock
        self._ready = ready
        self._retry = retry if retry is not None else RetryPolicy()
        self._limits = limits if limits is not None else AimdSettings()
        self._rng = rng if rng is not None else random.Random()
        self._jitter_s = float(reconnect_jitter_s)
        self._classes = tuple(classes)
        self._discovery_s = float(discovery_interval_s)
        stats = getattr(store, "stats", None)
        self._stats: Callable[[], Awaitable[OutboxStats]] | None = (
            stats if callable(stats) else None
        )
        self._name = name
        self._n = partitions
        self._parts = [_Partition(i) for i in range(partitions)]
        # Sending is allowed while `_active` is open: `ready` is open and the jitter has passed.
        self._active = Gate(is_open=False)
        self._sending = False  # mirrors `_active` for the per-row check
        self._resume_timer: TimerHandle | None = None
        self._running = False
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._acks: list[int] = []
        self._ack_wake = asyncio.Event()
        self._ack_round = asyncio.Event()  # set, then replaced, when an ack write finishes
        self._acking = False
        self._flusher: asyncio.Task[None] | None = None
        self._stop_event = asyncio.Event()
        self._unsent: list[int] = []  # rows held by a sender that was cancelled at stop
        # counters
        self._retried = 0
        self._capacity = 0
        self._transient = 0
        self._permanent = 0
        self._dead = 0
        self._released = 0
        self._store_errors = 0
        self._resumes = 0

    # -- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        return self._running

    @property
    def partitions(self) -> int:
        return self._n

    @property
    def sending(self) -> bool:
        """True while the relay may send (gate open and the reconnect jitter has passed)."""
        return self._sending

    def partition_of(self, receiver: str) -> int:
        """The partition that owns `receiver` (FNV-1a, the same rule the store applies)."""
        return fnv1a_32(receiver) % self._n

    async def start(self) -> None:
        if self._running:
            raise RuntimeError(f"{self._name} is already running")
        if self._stopping:
            raise RuntimeError(f"{self._name} was stopped; make a new Relay")
        self._running = True
        for part in self._parts:
            for kind in self._classes:
                self._lane(part, kind)
        self._ready.add_listener(self._on_ready_change)
        if self._ready.is_open:
            self._set_sending(True)  # already connected: no herd to spread
        self._tasks.append(asyncio.create_task(self._watch(), name=f"{self._name}-watch"))
        self._flusher = asyncio.create_task(self._flush_acks(), name=f"{self._name}-acks")
        self._tasks.append(self._flusher)
        for part in self._parts:
            part.task = asyncio.create_task(
                self._drain(part), name=f"{self._name}-p{part.index}"
            )

    async def stop_within(self, timeout_s: float = RELAY_STOP_S) -> None:
        """`stop`, waiting at most `timeout_s`: an agent's shutdown must finish. The store close
        that follows flushes every committed row; untried rows are simply pending again."""
        stopping = asyncio.ensure_future(self.stop())
        try:
            await self._clock.wait_for(asyncio.shield(stopping), timeout_s)
        except TimeoutError:
            log.warning("%s did not stop within %.0fs; closing anyway", self._name, timeout_s)

    async def stop(self) -> None:
        """Stop sending. Deliveries in progress are cancelled and their rows released untried
        (at-least-once: the receiver may have seen them); delivered rows are acked."""
        if not self._running:
            return
        self._stopping = True
        self._running = False
        self._stop_event.set()
        self._set_sending(False)
        with contextlib.suppress(ValueError):
            self._ready.remove_listener(self._on_ready_change)
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None
        flusher = self._tasks[1]
        tasks = [t for t in self._tasks if t is not flusher]
        tasks += [p.task for p in self._parts if p.task is not None]
        for part in self._parts:
            for lane in part.lanes.values():
                tasks += lane.workers
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # The ack flusher goes last: it writes what the senders collected before they stopped.
        self._ack_wake.set()
        await asyncio.gather(flusher, return_exceptions=True)
        self._tasks.clear()
        leftovers = self._unsent
        self._unsent = []
        for part in self._parts:
            for lane in part.lanes.values():
                leftovers.extend(row.row_id for row in lane.take_queued())
                lane.reset()
        with contextlib.suppress(StoreError):
            if self._acks:
                acks = self._acks[:]
                self._acks.clear()
                await self._store.ack(acks)
            if leftovers:
                self._released += len(leftovers)
                await self._store.release(leftovers)

    # -- readiness gate --------------------------------------------------------------------
    def _on_ready_change(self, is_open: bool) -> None:
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None
        if not is_open:
            self._set_sending(False)
            self._wake_all()
            return
        delay = self._rng.uniform(0.0, self._jitter_s) if self._jitter_s > 0 else 0.0
        self._resume_timer = self._clock.call_later(delay, self._resume)

    def _resume(self) -> None:
        self._resume_timer = None
        if self._running and self._ready.is_open:
            self._resumes += 1
            self._set_sending(True)
            self._wake_all()

    def _set_sending(self, on: bool) -> None:
        self._sending = on
        if on:
            self._active.open()
        else:
            self._active.close()

    def _wake_all(self) -> None:
        for part in self._parts:
            part.wake.set()

    # -- background tasks ------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            try:
                await self._store.wait_for_change()
            except StoreClosed:
                return
            except StoreError as exc:
                self._store_errors += 1
                log.warning("%s: waiting for outbox changes failed: %s", self._name, exc)
                await self._clock.sleep(_STORE_RETRY_S)
            self._wake_all()

    async def _flush_acks(self) -> None:
        """Ack delivered rows in groups: whatever collected while the previous ack was being
        written goes in the next one. Exits once `stop()` is under way and nothing is left."""
        while True:
            await self._ack_wake.wait()
            self._ack_wake.clear()
            while self._acks:
                batch = self._acks[:]  # the list object is shared with the lanes
                self._acks.clear()
                self._acking = True
                try:
                    await self._store.ack(batch)
                except StoreClosed:
                    return
                except StoreError as exc:
                    self._store_errors += 1
                    log.warning("%s: ack of %d rows failed: %s", self._name, len(batch), exc)
                    self._acks[:0] = batch
                    if self._stopping:
                        return
                    await self._pause(_STORE_RETRY_S)  # cut short by stop()
                    continue
                finally:
                    self._acking = False
                    self._ack_round.set()
                    self._ack_round = asyncio.Event()
                # No wake here: an ack that lets a row go (a FIFO receiver's next one, a newer
                # row of an OVERWRITE key) is a store change; other acks free nothing to take.
            if self._stopping:
                return

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds` of the clock, or until `stop()` begins."""
        if self._stopping:
            return
        timer = self._clock.call_later(seconds, self._stop_event.set)
        try:
            await self._stop_event.wait()
        finally:
            timer.cancel()
            if not self._stopping:
                self._stop_event.clear()

    # -- drain loop ------------------------------------------------------------------------
    def _lane(self, part: _Partition, kind: str) -> Lane:
        lane = part.lanes.get(kind)
        if lane is None:
            lane = part.lanes[kind] = Lane(
                kind,
                self._limits,
                host=self,
                deliver=self._deliver,
                acks=self._acks,
                ack_wake=self._ack_wake,
                room=part.room,
                name=f"{self._name}-p{part.index}-{kind}",
            )
        return lane

    async def _drain(self, part: _Partition) -> None:
        store = self._store
        while not self._stopping:
            part.want_room = True
            if not self._sending:
                await self._release_queued(part)
                await self._active.wait_open()
                continue
            limit, kinds = self._wanted(part)
            if kinds is not None and self._discovery_wait(part) == 0.0:
                await self._discover(part)
                limit, kinds = self._wanted(part)
            if limit <= 0 or kinds == []:
                part.wake.clear()
                await self._wait(part, self._discovery_wait(part))
                continue
            part.wake.clear()
            if self._acking or (self._acks and self._flusher and not self._flusher.done()):
                # Rows delivered but not acked yet are still in flight, and a take reads past
                # every one of them: let the ack under way land first (one store round).
                await self._ack_round.wait()
            taken_at = self._clock.now_ms()
            try:
                rows = await store.take_ready(
                    limit=limit, partition=part.index, partitions=self._n, kinds=kinds
                )
            except StoreClosed:
                return
            except StoreError as exc:
                self._store_errors += 1
                log.warning("%s: take_ready failed: %s", self._name, exc)
                await self._wait(part, _STORE_RETRY_S)
                continue
            if rows and not self._sending:
                self._released += len(rows)
                await self._settle(store.release([r.row_id for r in rows]), "release")
                continue
            if rows:
                part.recheck_s = _RECHECK_MIN_S
            lanes = part.lanes
            for row in rows:
                lane = lanes.get(row.kind)
                if lane is None:
                    lane = self._lane(part, row.kind)
                lane.push(row)
            if len(rows) >= limit:
                continue  # probably more ready; go again once the lanes have room
            # Short of `limit` with every class asked for: nothing else was ready to take.
            part.want_room = kinds is not None
            await self._idle(part, taken_at, saturated=kinds is not None)

    def _wanted(self, part: _Partition) -> tuple[int, list[str] | None]:
        """How many rows to take, and of which classes (None: any, including unseen ones)."""
        room = 0
        open_kinds: list[str] = []
        saturated = False
        for lane in part.lanes.values():
            r = lane.room
            if r > 0:
                room += r
                open_kinds.append(lane.kind)
            else:
                saturated = True
        if saturated:
            return room, open_kinds
        return room + 2 * self._limits.initial, None  # leave room for a class not seen yet

    def _discovery_wait(self, part: _Partition) -> float | None:
        """Seconds until the next look for unseen classes (only while some lane is full, as
        then the drain loop takes named classes only), or None when the store cannot tell."""
        if self._stats is None:
            return None
        left = self._discovery_s - (self._clock.monotonic() - part.discovered_at)
        # Within a millisecond counts as due: a timer set for `left` may fire a rounding error
        # early, and waiting again for that sliver would spin on a virtual clock.
        return left if left > _DUE_EPSILON_S else 0.0

    async def _discover(self, part: _Partition) -> None:
        """Open a lane for every class the store holds pending rows of."""
        part.discovered_at = self._clock.monotonic()
        assert self._stats is not None
        try:
            stats = await self._stats()
        except StoreError as exc:
            self._store_errors += 1
            log.warning("%s: reading outbox stats failed: %s", self._name, exc)
            return
        for kind, cls in stats.by_class.items():
            if cls.pending > 0 and kind not in part.lanes:
                self._lane(part, kind)

    async def _idle(self, part: _Partition, taken_at: int, *, saturated: bool = False) -> None:
        """Sleep until something may be ready: a store change, a lane with room again, or the
        earliest send_at. A due time at or before our last take belongs to a row we could not
        take (another partition's, or a full lane's): those wake us by other means."""
        if part.wake.is_set():
            return
        try:
            due = await self._store.next_due_ms()
        except StoreClosed:
            await part.wake.wait()
            return
        except StoreError as exc:
            self._store_errors += 1
            log.warning("%s: next_due_ms failed: %s", self._name, exc)
            await self._wait(part, _STORE_RETRY_S)
            return
        timeout: float | None = None
        if due is not None and due > taken_at:
            part.recheck_s = _RECHECK_MIN_S
            timeout = max(0.0, (due - self._clock.now_ms()) / 1000.0)
            if timeout == 0.0:
                return
        elif due is not None:
            # Due already, yet not ours to take now: another partition's row (it will take it
            # soon) or a full lane's. The store's next_due_ms spans all partitions, so look
            # again later, backing off, rather than sleeping past a row of our own.
            timeout = part.recheck_s
            part.recheck_s = min(_RECHECK_MAX_S, part.recheck_s * 2)
        if saturated:
            discovery = self._discovery_wait(part)
            if discovery is not None and (timeout is None or discovery < timeout):
                timeout = discovery
        await self._wait(part, timeout)

    async def _wait(self, part: _Partition, timeout_s: float | None) -> None:
        if part.wake.is_set():
            return
        if timeout_s is None:
            await part.wake.wait()
            return
        # A timer that sets the same event: no extra task, and a cancellation (stop) is never
        # lost the way asyncio.wait_for can lose one when its inner await finishes meanwhile.
        timer = self._clock.call_later(timeout_s, part.wake.set)
        try:
            await part.wake.wait()
        finally:
            timer.cancel()

    async def _release_queued(self, part: _Partition) -> None:
        ids = [row.row_id for lane in part.lanes.values() for row in lane.take_queued()]
        if ids:
            self._released += len(ids)
            await self._settle(self._store.release(ids), "release")

    # -- what the lanes' senders call (LaneHost) --------------------------------------------
    async def release_untried(self, row: OutboxRow) -> None:
        self._released += 1
        await self._settle(self._store.release([row.row_id]), "release")

    def abandoned(self, row: OutboxRow) -> None:
        self._unsent.append(row.row_id)

    async def failed(self, row: OutboxRow, exc: Exception) -> None:
        """Settle a failed delivery in the store (the limiter already took the outcome)."""
        if isinstance(exc, Permanent):
            self._permanent += 1
            self._dead += 1
            await self._settle(self._store.dead_letter(row.row_id, error=str(exc)), "dead_letter")
            return
        error: DeliveryError
        if isinstance(exc, Capacity):
            self._capacity += 1
            error = exc
        else:
            if isinstance(exc, DeliveryError):
                error = exc if isinstance(exc, Transient) else Transient(str(exc))
            else:
                log.warning(
                    "%s: deliver raised %s for row %d to %s: %s",
                    self._name,
                    type(exc).__name__,
                    row.row_id,
                    row.receiver,
                    exc,
                )
                error = Transient(f"{type(exc).__name__}: {exc}")
            if not self._sending:
                # The link went down under this delivery: not the message's fault.
                self._released += 1
                await self._settle(self._store.release([row.row_id]), "release")
                return
            self._transient += 1
        delay_ms = self._retry.delay_ms(error, row.attempts, self._rng)
        text = str(error) or type(error).__name__
        dead = await self._settle(
            self._store.nack(row.row_id, delay_ms=delay_ms, error=text,
                             outcome="capacity" if isinstance(error, Capacity) else "transient"), "nack"
        )
        if dead is True:
            self._dead += 1
        elif dead is False:
            self._retried += 1

    async def _settle(self, op: Awaitable[Any], what: str) -> Any:
        """Run a store write to completion even if our task is cancelled meanwhile (the row's
        fate is decided; abandoning the write halfway would leave it in flight in memory)."""
        task = asyncio.ensure_future(op)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await task
            raise
        except StoreClosed:
            return None
        except StoreError as exc:
            self._store_errors += 1
            log.warning("%s: %s failed: %s", self._name, what, exc)
            return None

    # -- metrics ---------------------------------------------------------------------------
    def metrics(self) -> RelayMetrics:
        lanes = tuple(
            LaneMetrics(
                partition=part.index,
                kind=lane.kind,
                limit=lane.limiter.limit,
                in_flight=lane.limiter.in_flight,
                queued=len(lane.queue),
                successes=lane.limiter.successes,
                capacity_rejections=lane.limiter.capacity_rejections,
                transient_failures=lane.limiter.transients,
            )
            for part in self._parts
            for lane in part.lanes.values()
        )
        return RelayMetrics(
            lanes=lanes,
            sending=self._sending,
            delivered=sum(lane.successes for lane in lanes),
            retried=self._retried,
            capacity_rejections=self._capacity,
            transient_failures=self._transient,
            permanent_failures=self._permanent,
            dead_lettered=self._dead,
            released=self._released,
            store_errors=self._store_errors,
            resumes=self._resumes,
            acks_pending=len(self._acks),
        )


__all__ = ["RELAY_STOP_S", "Deliver", "Relay"]
