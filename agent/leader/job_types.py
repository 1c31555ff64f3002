"""The job queue's public value types (see `agent.leader.jobs` for what they mean)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.core.errors import StoreError
from agent.protocol import JobOffer

SubmitOutcome = Literal["stored", "duplicate"]
DemandOutcome = Literal["registered", "updated", "replaced", "violation", "posted"]
ResultOutcome = Literal["confirmed", "duplicate", "stale_epoch", "violation", "posted"]


class QueueFenced(StoreError):
    """A newer incarnation of the queue owns the database; this one must stop."""


class QueueStandby(StoreError):
    """Several leaders on PostgreSQL: another leader runs the fleet's job queue (it holds the
    queue's lease); a job message sent here is answered busy and sent again by its device."""


@dataclass(frozen=True, slots=True)
class SubmitResult:
    outcome: SubmitOutcome
    job_id: str
    store_seq: int


@dataclass(frozen=True, slots=True)
class ResultAck:
    """What `result()` did. `requeued`: jobs released by a violation (already at the head)."""

    outcome: ResultOutcome
    job_id: str
    requeued: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send `offer` to `worker`."""

    worker: str
    offer: JobOffer


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    store_seq: int
    kind: str
    payload: bytes
    state: Literal["pending", "confirmed"]
    submitted_ms: int
    confirmed_ms: int | None
    confirmed_by: str | None
    ok: bool | None
    result: bytes | None
    error: str | None


@dataclass(frozen=True, slots=True)
class QueueStats:
    epoch: int
    pending: int  # waiting for a worker
    in_flight: int  # held by a worker, unconfirmed
    workers: int
    free_demand: int
    submitted: int  # this incarnation
    confirmed: int  # this incarnation
    requeued: int  # this incarnation
    violations: int  # this incarnation
    held: int = 1  # 1 while this leader runs the queue (several leaders: holds its lease)
    taken: int = 1  # times this leader took the queue (at its start, and each takeover)


__all__ = [
    "DemandOutcome",
    "Dispatch",
    "JobRecord",
    "QueueFenced",
    "QueueStandby",
    "QueueStats",
    "ResultAck",
    "ResultOutcome",
    "SubmitOutcome",
    "SubmitResult",
]
