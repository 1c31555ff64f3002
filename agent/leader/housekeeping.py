"""The leader's housekeeping tasks: processed ids, confirmed jobs, rollout report ids, and the
per-device rows of long-finished rollouts (their summaries stay: `rollout_engine.store`).

Retentions and their reasons: `agent.housekeeping`. The rollout tables live in the same
database as the registry; their pruning opens its own `RolloutStore` on it at the first round
(the firmware modules load only then) and closes it when housekeeping stops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.core.clock import Clock
from agent.core.config import HousekeepingSection
from agent.core.sql import StoreTarget
from agent.housekeeping import Housekeeper, limited
from agent.leader.jobs import JobQueue
from agent.leader.messages import MessageLog
from agent.leader.registry import DeviceRegistry

if TYPE_CHECKING:
    from rollout_engine.store import RolloutStore


class RolloutReports:
    """Prunes `rollout_processed`, and finished rollouts' per-device rows, through a
    `RolloutStore` opened on first use."""

    def __init__(self, db_path: str | StoreTarget, *, clock: Clock, retention_s: float,
                 rollouts_retention_s: float) -> None:
        self._path = db_path
        self._clock = clock
        self._retention_s = retention_s
        self._rollouts_retention_s = rollouts_retention_s
        self._store: RolloutStore | None = None

    def _opened(self) -> RolloutStore:
        if self._store is None:
            from rollout_engine.store import RolloutStore

            self._store = RolloutStore.open(self._path, clock=self._clock)
        return self._store

    def prune(self, limit: int) -> int:
        return self._opened().prune_processed(self._retention_s, limit=limit)

    def prune_rollouts(self, limit: int) -> int:
        return self._opened().prune_finished(self._rollouts_retention_s, limit=limit)

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()


def leader_housekeeper(
    settings: HousekeepingSection, *, clock: Clock, registry: DeviceRegistry, jobs: JobQueue,
    rollout_db: str | StoreTarget | None = None, name: str = "housekeeping",
    messages: MessageLog | None = None, messages_retention_s: float = 14 * 86_400.0,
) -> tuple[Housekeeper, RolloutReports | None]:
    """The leader's housekeeper, and the rollout pruner to close after it stops (if any)."""
    tasks = [
        limited("processed_messages",
                lambda n: registry.prune_processed(settings.processed_retention_s, limit=n)),
        limited("confirmed_jobs",
                lambda n: jobs.prune_confirmed(settings.jobs_retention_s, limit=n)),
    ]
    if messages is not None:
        tasks.append(limited("app_messages", lambda n: messages.prune(messages_retention_s, limit=n)))
    reports = None
    if rollout_db is not None:
        reports = RolloutReports(rollout_db, clock=clock, retention_s=settings.processed_retention_s,
                                 rollouts_retention_s=settings.rollouts_retention_s)
        tasks.append(limited("rollout_processed", reports.prune))
        tasks.append(limited("finished_rollouts", reports.prune_rollouts))
    keeper = Housekeeper(clock=clock, tasks=tasks, interval_s=settings.interval_s,
                         batch_rows=settings.batch_rows, name=name)
    return keeper, reports


__all__ = ["RolloutReports", "leader_housekeeper"]
