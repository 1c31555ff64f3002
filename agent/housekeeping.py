"""Housekeeping: prune the tables that only grow, on an interval of the Clock, in bounded batches.

A production agent runs for months; without this, these tables grow for ever:

    leader  processed_messages  ids of applied telemetry/presence (DeviceRegistry: dedup)
    leader  rollout_processed   ids of applied firmware reports (RolloutStore: dedup)
    leader  jobs (confirmed)    finished jobs (JobQueue: idempotent submit, late results)
    worker  job_ledger          jobs done here (JobLedger: a re-offered job runs once)
    leader  rollout_devices,    a finished rollout's per-device rows (RolloutStore: status,
            _offers, _controls  rollback targets), after `rollouts_retention_s` (90 days)

Why the retentions (`[housekeeping]` in the config; 14 days by default, finished rollouts 90):

* A dedup record must outlive every possible redelivery of its message. Once the leader has
  applied a message, the same id comes again only if the reply was lost and the sender's outbox
  tries again. It keeps trying until the row is acknowledged, dead-lettered (after
  `outbox.max_attempts` with backoff capped at `outbox.backoff_cap_s`: 20 x 300 s = 100 min by
  default) or expired by its class TTL (the shipped worker config keeps telemetry for 7 days).
  The device may go offline between the lost reply and the retry, so the retry horizon alone is
  not enough: the window must cover the longest outbox TTL. 14 days is twice the shipped
  telemetry TTL, a margin for a leader that was down and for devices whose clock jumps at boot
  (a Pi has no RTC). `load_config` refuses a retention below this config's own retry horizon
  or longest TTL. What no finite window covers: a class without TTL (`ttl_s = 0`) whose device
  stays away for longer, and dead letters replayed by hand weeks later.
* Confirmed jobs: a `JobSubmit` resent after its job was pruned would be stored and run again,
  and a worker's result resent after that counts as a protocol violation: same window.
* The worker's ledger: the leader re-offers a job until it has applied the worker's result
  (after its restart, or when it presumed the worker lost), and that result may wait in the
  worker's outbox as long as any message: same window, plus the leader's downtime.

* Finished rollouts: their per-device rows are what `rollout status --devices` shows and what a
  rollback of that rollout targets; 90 days keeps them for a quarter of operations. The
  `rollouts` summary row stays, with the final per-state counts written into its detail.

Pending or unconfirmed jobs are never pruned (only `state = 'confirmed'` rows), nor an active
rollout's reports (`RolloutStore.prune_processed` keeps everything claimed since the oldest
running or paused rollout was created).

Bounded work: the stores are synchronous and used on the event loop, so each prune step is one
short transaction of at most `batch_rows` rows on the loop (no thread, so no `clock.busy()`),
with `pause_s` of the Clock between steps: a huge backlog (a table grown before housekeeping
existed) is worked off without holding the loop.

Pruned counts go to `metrics()` and DEBUG logs per round; an INFO summary at most once an hour.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from agent.core.clock import Clock
from agent.core.errors import StoreError
from agent.core.tasks import cancel_and_wait

log = logging.getLogger(__name__)

SUMMARY_EVERY_S = 3600.0

# One bounded step: given the most rows it may remove, (rows removed, more remain).
Step = Callable[[int], tuple[int, bool]]


@dataclass(frozen=True, slots=True)
class PruneTask:
    """A table to prune: `name` (metrics label) and `step`."""

    name: str
    step: Step


def limited(name: str, prune: Callable[[int], int]) -> PruneTask:
    """A task from `prune(limit) -> removed` that deletes the oldest due rows, at most `limit`:
    fewer than `limit` removed means nothing more is due."""

    def step(limit: int) -> tuple[int, bool]:
        removed = prune(limit)
        return removed, removed >= limit

    return PruneTask(name, step)


@dataclass(slots=True)
class HousekeepingMetrics:
    rounds: int = 0
    errors: int = 0
    pruned: dict[str, int] = field(default_factory=dict)  # per table, since start
    last_round: dict[str, int] = field(default_factory=dict)  # per table, the last round


class Housekeeper:
    """Runs every task each `interval_s` (the first round after `first_delay_s`).

    `start()` / `stop()` with the agent; `run_once()` runs one round now (tests, tools).
    A `StoreError` in a task is logged and counted; the other tasks and later rounds go on.
    """

    def __init__(self, *, clock: Clock, tasks: Iterable[PruneTask] = (), interval_s: float,
                 batch_rows: int, pause_s: float = 0.02, first_delay_s: float = 60.0,
                 name: str = "housekeeping") -> None:
        if interval_s <= 0 or batch_rows < 1 or pause_s < 0 or first_delay_s < 0:
            raise ValueError("housekeeping needs interval_s > 0, batch_rows >= 1, pauses >= 0")
        self._clock = clock
        self._tasks: list[PruneTask] = list(tasks)
        self.interval_s = interval_s
        self.batch_rows = batch_rows
        self._pause_s = pause_s
        self._first_delay_s = min(first_delay_s, interval_s)
        self.name = name
        self._metrics = HousekeepingMetrics()
        self._unreported: dict[str, int] = {}
        self._last_summary: float | None = None
        self._task: asyncio.Task[None] | None = None

    def add(self, task: PruneTask) -> None:
        self._tasks.append(task)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._tasks)

    def metrics(self) -> HousekeepingMetrics:
        m = self._metrics
        return HousekeepingMetrics(m.rounds, m.errors, dict(m.pruned), dict(m.last_round))

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        await self._clock.sleep(self._first_delay_s)
        while True:
            await self.run_once()
            await self._clock.sleep(self.interval_s)

    async def run_once(self) -> dict[str, int]:
        """One round over every task; rows removed per task."""
        removed: dict[str, int] = {}
        for task in list(self._tasks):
            removed[task.name] = await self._prune(task)
        m = self._metrics
        m.rounds += 1
        m.last_round = removed
        for name, n in removed.items():
            m.pruned[name] = m.pruned.get(name, 0) + n
            self._unreported[name] = self._unreported.get(name, 0) + n
        log.debug("%s: pruned %s", self.name, removed)
        self._summarise()
        return removed

    async def _prune(self, task: PruneTask) -> int:
        total = 0
        try:
            while True:
                n, more = task.step(self.batch_rows)
                total += n
                if not more:
                    break
                # Let the loop breathe between batches; an empty time band needs no pause.
                await self._clock.sleep(self._pause_s if n else 0)
        except StoreError as exc:
            self._metrics.errors += 1
            log.warning("%s: pruning %s failed (next round retries): %s", self.name, task.name, exc)
        return total

    def _summarise(self) -> None:
        now = self._clock.monotonic()
        if self._last_summary is not None and now - self._last_summary < SUMMARY_EVERY_S:
            return
        if not any(self._unreported.values()):
            return
        log.info("%s: pruned %s since %s", self.name,
                 ", ".join(f"{n} {name}" for name, n in sorted(self._unreported.items()) if n),
                 "start" if self._last_summary is None else "the last summary")
        self._last_summary = now
        self._unreported.clear()


__all__ = ["HousekeepingMetrics", "Housekeeper", "PruneTask", "Step", "limited"]
