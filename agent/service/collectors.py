"""Collectors that turn the agent's own snapshots into Prometheus families at scrape time.

Each takes a callable returning the snapshot (so the exporter holds no reference to internals
and always sees the current object):

    mailbox_collector(system.statistics)      # ActorSystem -> list[MailboxStatistics]
    outbox_collector(store.stats)             # async OutboxStore.stats -> OutboxStats
    relay_collector(relay.metrics)            # Relay.metrics -> RelayMetrics
    process_collector()                       # RSS, CPU seconds, fds, threads (psutil)
    snapshot_collector("ea_rollout", fn)      # any dataclass/struct of numbers
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from agent.service.prom import Collector, MetricFamily, MetricType, family

if TYPE_CHECKING:
    import psutil

    from agent.actors.mailbox import MailboxStatistics
    from agent.outbox.metrics import RelayMetrics
    from agent.outbox.types import OutboxStats


def process_collector(process: psutil.Process | None = None) -> Collector:
    """The standard `process_*` series for this process (psutil loads at the first scrape)."""
    held: list[psutil.Process] = [process] if process is not None else []

    def collect() -> list[MetricFamily]:
        import psutil

        if not held:
            held.append(psutil.Process())
        proc = held[0]
        with proc.oneshot():
            mem = proc.memory_info()
            cpu = proc.cpu_times()
            fams = [
                family("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
                       mem.rss),
                family("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
                       mem.vms),
                family("process_cpu_seconds_total", "counter",
                       "Total user and system CPU time spent in seconds.", cpu.user + cpu.system),
                family("process_start_time_seconds", "gauge",
                       "Start time of the process since unix epoch in seconds.",
                       proc.create_time()),
                family("process_threads", "gauge", "Number of OS threads.", proc.num_threads()),
            ]
            try:
                fams.append(family("process_open_fds", "gauge", "Number of open file descriptors.",
                                   proc.num_fds()))
            except (AttributeError, psutil.Error):
                pass
        return fams

    return collect


_MAILBOX_GAUGES = (
    ("depth", "Messages waiting in the mailbox."),
    ("capacity", "Capacity of the mailbox."),
    ("high_water", "Highest depth the mailbox reached."),
)
_MAILBOX_COUNTERS = (
    ("enqueued", "Messages accepted into the mailbox."),
    ("processed", "Messages handed to the actor."),
    ("rejected", "Messages refused because the mailbox was full (reject policy)."),
    ("dropped", "Messages dropped by a drop_oldest/drop_newest policy or a stale sequence."),
    ("coalesced", "Messages that replaced a pending one with the same coalescing key."),
    ("failed", "Messages whose processing raised."),
)


def mailbox_collector(
    statistics: Callable[[], Iterable[MailboxStatistics]], *, prefix: str = "ea_mailbox"
) -> Collector:
    def collect() -> list[MetricFamily]:
        snaps = list(statistics())
        fams = [
            family(f"{prefix}_{field}", "gauge", text,
                   (({"mailbox": s.name}, getattr(s, field, 0)) for s in snaps))
            for field, text in _MAILBOX_GAUGES
        ]
        fams += [
            family(f"{prefix}_{field}_total", "counter", text,
                   (({"mailbox": s.name}, getattr(s, field, 0)) for s in snaps))
            for field, text in _MAILBOX_COUNTERS
        ]
        return fams

    return collect


_OUTBOX_COUNTERS = (
    ("enqueued", "Messages stored in the outbox."),
    ("delivered", "Messages delivered and acknowledged."),
    ("dead_lettered", "Messages moved to the dead letters."),
    ("expired", "Messages that reached their TTL."),
    ("dropped", "Messages dropped by a class size cap (drop_oldest)."),
    ("overwritten", "Pending messages replaced by a newer one with the same key."),
    ("replayed", "Dead letters moved back to pending."),
    ("duplicates", "Enqueues refused as duplicates of a pending key."),
    ("rejected_full", "Enqueues refused because a class was full (reject policy)."),
)


def outbox_collector(
    stats: Callable[[], Awaitable[OutboxStats] | OutboxStats], *, prefix: str = "ea_outbox"
) -> Collector:
    async def collect() -> list[MetricFamily]:
        result = stats()
        snap: OutboxStats = await result if inspect.isawaitable(result) else result
        fams = [
            family(f"{prefix}_{field}_total", "counter", text, getattr(snap, field))
            for field, text in _OUTBOX_COUNTERS
        ]
        fams += [
            family(f"{prefix}_pending", "gauge", "Messages waiting (including in flight).",
                   snap.pending),
            family(f"{prefix}_in_flight", "gauge", "Messages being delivered.", snap.in_flight),
            family(f"{prefix}_dead", "gauge", "Messages in the dead letters.", snap.dead),
            family(f"{prefix}_oldest_pending_age_seconds", "gauge",
                   "Age of the oldest pending message (0 when none).",
                   (snap.oldest_pending_age_ms or 0) / 1000.0),
            family(f"{prefix}_conservation_ok", "gauge",
                   "1 while enqueued = delivered + dead + expired + dropped + overwritten + "
                   "pending - replayed.", 1 if snap.conservation_ok else 0),
        ]
        classes = sorted(snap.by_class.items())
        for field, text in (
            ("pending", "Pending messages per class."),
            ("in_flight", "In-flight messages per class."),
            ("dead", "Dead letters per class."),
            ("pending_bytes", "Bytes of pending payload per class."),
        ):
            fams.append(family(f"{prefix}_class_{field}", "gauge", text,
                               (({"class": k}, getattr(c, field)) for k, c in classes)))
        for field, text in _CLASS_FLOWS:
            fams.append(family(f"{prefix}_class_{field}_total", "counter", text,
                               (({"class": k}, getattr(c, field)) for k, c in classes)))
        return fams

    return collect


# What entered and left each class (persisted in the outbox): the conservation law per class is
# enqueued = delivered + dead_lettered + expired + dropped + overwritten + pending - replayed.
_CLASS_FLOWS = (
    ("enqueued", "Messages stored in the class."),
    ("delivered", "Messages of the class the receiver acknowledged."),
    ("dead_lettered", "Messages of the class moved to the dead letters."),
    ("expired", "Messages of the class past their TTL, deleted undelivered."),
    ("dropped", "Messages of the class dropped to make room (drop_oldest) or stale overwrites."),
    ("overwritten", "Messages of the class replaced by a newer one of their key."),
    ("replayed", "Dead letters of the class moved back to pending."),
)

_RELAY_COUNTERS = (
    ("delivered", "Deliveries acknowledged by the receiver."),
    ("retried", "Deliveries scheduled for another try."),
    ("capacity_rejections", "Deliveries answered busy (AIMD decrease)."),
    ("transient_failures", "Deliveries that timed out or hit a network error."),
    ("permanent_failures", "Deliveries refused for good."),
    ("dead_lettered", "Messages the relay moved to the dead letters."),
    ("released", "Rows handed back untried (transport down, stop)."),
    ("store_errors", "Store failures seen by the relay."),
)


def relay_collector(metrics: Callable[[], RelayMetrics], *, prefix: str = "ea_relay") -> Collector:
    def collect() -> list[MetricFamily]:
        snap = metrics()
        fams = [
            family(f"{prefix}_{field}_total", "counter", text, getattr(snap, field, 0))
            for field, text in _RELAY_COUNTERS
        ]
        fams.append(family(f"{prefix}_sending", "gauge",
                           "1 while the relay is draining (transport connected).",
                           1 if getattr(snap, "sending", False) else 0))
        lanes = list(getattr(snap, "lanes", ()))

        def per_lane(field: str) -> Iterable[tuple[Mapping[str, object], float]]:
            return (({"partition": ln.partition, "class": ln.kind}, getattr(ln, field))
                    for ln in lanes)

        fams += [
            family(f"{prefix}_aimd_limit", "gauge", "Current AIMD concurrency limit per lane.",
                   per_lane("limit")),
            family(f"{prefix}_in_flight", "gauge", "Deliveries in flight per lane.",
                   per_lane("in_flight")),
            family(f"{prefix}_queued", "gauge", "Rows taken from the store, waiting per lane.",
                   per_lane("queued")),
            family(f"{prefix}_lane_capacity_rejections_total", "counter",
                   "Busy answers per lane.", per_lane("capacity_rejections")),
        ]
        return fams

    return collect


def _numbers(obj: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    names = getattr(obj, "__struct_fields__", None)  # msgspec.Struct
    if names is not None:
        return {n: getattr(obj, n) for n in names}
    if isinstance(obj, Mapping):
        return dict(obj)
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def snapshot_collector(
    prefix: str,
    snapshot: Callable[[], Any],
    *,
    counters: Iterable[str] = (),
    help_: Mapping[str, str] | None = None,
    label: str = "key",
) -> Collector:
    """Export every number of a snapshot as `{prefix}_{field}` (a gauge, or `_total` counter for
    names in `counters`); a mapping of numbers becomes one series per key with label `label`."""
    counter_names = frozenset(counters)
    texts = dict(help_ or {})

    async def collect() -> list[MetricFamily]:
        result = snapshot()
        snap = await result if inspect.isawaitable(result) else result
        fams: list[MetricFamily] = []
        for field, value in _numbers(snap).items():
            is_counter = field in counter_names
            name = f"{prefix}_{field}_total" if is_counter else f"{prefix}_{field}"
            kind: MetricType = "counter" if is_counter else "gauge"
            text = texts.get(field, field.replace("_", " "))
            if isinstance(value, bool | int | float):
                fams.append(family(name, kind, text, float(value)))
            elif isinstance(value, Mapping) and all(
                isinstance(v, bool | int | float) for v in value.values()
            ):
                fams.append(family(name, kind, text,
                                   (({label: k}, v) for k, v in sorted(value.items()))))
        return fams

    return collect


def agent_collectors(
    *,
    relay_metrics: Callable[[], RelayMetrics] | None,
    mailbox_statistics: Callable[[], Iterable[MailboxStatistics]],
    outbox_stats: Callable[[], Awaitable[OutboxStats] | OutboxStats],
    housekeeping_metrics: Callable[[], Any] | None,
) -> dict[str, Collector]:
    """What every agent's core part exports: its relay (when it runs one), mailboxes, outbox and
    housekeeping (when it prunes its stores)."""
    found = {"relay": relay_collector(relay_metrics)} if relay_metrics is not None else {}
    found["mailbox"] = mailbox_collector(mailbox_statistics)
    found["outbox"] = outbox_collector(outbox_stats)
    if housekeeping_metrics is not None:
        found["housekeeping"] = snapshot_collector("ea_housekeeping", housekeeping_metrics,
                                                   counters=("pruned", "rounds", "errors"), label="table")
    return found


__all__ = [
    "agent_collectors",
    "mailbox_collector",
    "outbox_collector",
    "per_class_collector",
    "process_collector",
    "relay_collector",
    "snapshot_collector",
]


def per_class_collector(prefix: str, snapshot: Callable[[], Any], *, counters: Iterable[str] = (),
                        help_: Mapping[str, str] | None = None) -> Collector:
    """`{class: {field: number, or {reason: number}}}` (sync or async) as one family per field,
    labelled by class: `{prefix}_{field}_total{class=...}` for names in `counters`, else a gauge;
    a mapping becomes `{prefix}_{field}_total{class=..., reason=...}`."""
    counter_names = frozenset(counters)
    texts = dict(help_ or {})

    async def collect() -> list[MetricFamily]:
        result = snapshot()
        snap: Mapping[str, Mapping[str, Any]] = await result if inspect.isawaitable(result) else result
        series: dict[str, list[tuple[dict[str, str], float]]] = {}
        for cls, fields in sorted(snap.items()):
            for field, value in fields.items():
                if isinstance(value, Mapping):
                    for reason, n in sorted(value.items()):
                        series.setdefault(field, []).append(({"class": cls, "reason": str(reason)}, float(n)))
                elif isinstance(value, bool | int | float):
                    series.setdefault(field, []).append(({"class": cls}, float(value)))
        fams = []
        for field, samples in series.items():
            is_counter = field in counter_names
            name = f"{prefix}_{field}_total" if is_counter else f"{prefix}_{field}"
            fams.append(family(name, "counter" if is_counter else "gauge", texts.get(field, field.replace("_", " ")),
                               samples))
        return fams

    return collect
