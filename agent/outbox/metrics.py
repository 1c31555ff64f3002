"""Plain snapshots of the relay's and the store's numbers, for logs, tests and exporters.

`RelayMetrics` comes from `Relay.metrics()` (counters since the relay started, live limits);
`OutboxMetrics` joins it with the store's `OutboxStats` (counters persisted in the database,
depths) and carries the conservation law:

    enqueued == delivered + dead_lettered + expired + dropped + overwritten + pending - replayed

(`replayed` rows left the dead letters for pending again, so they were counted twice.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agent.outbox.types import OutboxStats


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneMetrics:
    """One message class in one partition: its AIMD limiter and its in-memory queue."""

    partition: int
    kind: str
    limit: int
    in_flight: int  # deliveries started and not finished
    queued: int  # rows taken from the store, waiting for a sender
    successes: int
    capacity_rejections: int
    transient_failures: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayMetrics:
    """Relay counters since start. `dead_lettered` counts permanent failures and rows whose
    last allowed try failed; `released` counts rows handed back untried (gate closed, stop)."""

    lanes: tuple[LaneMetrics, ...] = ()
    sending: bool = False
    delivered: int = 0
    retried: int = 0
    capacity_rejections: int = 0
    transient_failures: int = 0
    permanent_failures: int = 0
    dead_lettered: int = 0
    released: int = 0
    store_errors: int = 0
    resumes: int = 0
    acks_pending: int = 0

    @property
    def in_flight(self) -> int:
        return sum(lane.in_flight for lane in self.lanes)

    def lane(self, partition: int, kind: str) -> LaneMetrics | None:
        for lane in self.lanes:
            if lane.partition == partition and lane.kind == kind:
                return lane
        return None

    def limits(self) -> dict[tuple[int, str], int]:
        """Current AIMD limit per (partition, class)."""
        return {(lane.partition, lane.kind): lane.limit for lane in self.lanes}


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxMetrics:
    """The relay's view and the store's view, taken together."""

    relay: RelayMetrics
    store: OutboxStats

    @property
    def conservation_ok(self) -> bool:
        return self.store.conservation_ok

    def conservation_gap(self) -> int:
        """enqueued minus everything accounted for (0 when the law holds)."""
        s = self.store
        return s.enqueued - (
            s.delivered + s.dead_lettered + s.expired + s.dropped + s.overwritten + s.pending
            - s.replayed
        )

    def as_dict(self) -> dict[str, float]:
        """Flat name -> value, ready for an exporter (labels folded into the names)."""
        s, r = self.store, self.relay
        out: dict[str, float] = {
            "outbox_enqueued": s.enqueued,
            "outbox_delivered": s.delivered,
            "outbox_dead_lettered": s.dead_lettered,
            "outbox_expired": s.expired,
            "outbox_dropped": s.dropped,
            "outbox_overwritten": s.overwritten,
            "outbox_pending": s.pending,
            "outbox_in_flight": s.in_flight,
            "outbox_dead": s.dead,
            "outbox_replayed": s.replayed,
            "outbox_duplicates": s.duplicates,
            "outbox_rejected_full": s.rejected_full,
            "outbox_oldest_pending_age_ms": float(s.oldest_pending_age_ms or 0),
            "outbox_conservation_ok": 1.0 if s.conservation_ok else 0.0,
            "relay_delivered": r.delivered,
            "relay_retried": r.retried,
            "relay_capacity_rejections": r.capacity_rejections,
            "relay_transient_failures": r.transient_failures,
            "relay_permanent_failures": r.permanent_failures,
            "relay_dead_lettered": r.dead_lettered,
            "relay_released": r.released,
            "relay_in_flight": r.in_flight,
        }
        for kind, cls in s.by_class.items():
            out[f"outbox_pending{{class={kind}}}"] = cls.pending
            out[f"outbox_in_flight{{class={kind}}}"] = cls.in_flight
            out[f"outbox_dead{{class={kind}}}"] = cls.dead
            out[f"outbox_pending_bytes{{class={kind}}}"] = cls.pending_bytes
        for lane in r.lanes:
            labels = f"{{partition={lane.partition},class={lane.kind}}}"
            out[f"relay_limit{labels}"] = lane.limit
            out[f"relay_in_flight{labels}"] = lane.in_flight
            out[f"relay_queued{labels}"] = lane.queued
        return out


class _HasStats(Protocol):
    async def stats(self) -> OutboxStats: ...


class _HasMetrics(Protocol):
    def metrics(self) -> RelayMetrics: ...


async def collect_metrics(store: _HasStats, relay: _HasMetrics | None = None) -> OutboxMetrics:
    """One snapshot of both sides (the relay's part is empty when there is no relay)."""
    stats = await store.stats()
    return OutboxMetrics(relay=relay.metrics() if relay is not None else RelayMetrics(), store=stats)


__all__ = ["LaneMetrics", "OutboxMetrics", "RelayMetrics", "collect_metrics"]
