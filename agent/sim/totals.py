"""What the devices of one process add up to: for the progress samples (`DevicesNow`) and for the
report (`DeviceTotals`). A fleet run in one process has one of each; a fleet spread over processes
sums one per process (`add`), so the report reads the same numbers either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from agent.protocol import app_kind
from agent.sim.options import APP_CLASS
from agent.sim.report import peak_rss_mb

if TYPE_CHECKING:
    from agent.sim.fleet import SimFleet
    from agent.sim.runner import Simulation


@dataclass(slots=True)
class DevicesNow:
    devices: int = 0
    online: int = 0
    crashed: int = 0
    outbox_pending: int = 0  # in the devices' outbox files (the leader's outbox apart)
    heartbeats_pending: int = 0
    in_flight: int = 0  # in the devices' relays
    limits: list[int] = field(default_factory=list)  # the AIMD limit of every relay lane
    air_bytes: int = 0  # the devices' broker connections over TLS so far (`AirModel`)

    def add(self, other: DevicesNow) -> None:
        _add(self, other)


def _add(mine: DevicesNow | DeviceTotals, theirs: DevicesNow | DeviceTotals) -> None:
    """Sum `theirs` into `mine`, field by field, by what each field holds: numbers and lists add up,
    maps add up key by key (a map by device just joins: a device runs in one process), sets join,
    and a flag holds only if it holds in both."""
    for f in fields(mine):
        a, b = getattr(mine, f.name), getattr(theirs, f.name)
        if isinstance(a, bool):
            setattr(mine, f.name, a and b)
        elif isinstance(a, set):
            a |= b
        elif isinstance(b, dict):
            merged = dict(a or {})
            for key, value in b.items():
                merged[key] = merged.get(key, 0) + value
            setattr(mine, f.name, merged)
        elif b is not None:
            setattr(mine, f.name, a + b)


async def devices_now(fleet: SimFleet) -> DevicesNow:
    limits = [lane.limit for relay in fleet.relays for lane in relay.metrics().lanes]
    return DevicesNow(
        devices=len(fleet.workers), online=fleet.online(), crashed=len(fleet.down),
        outbox_pending=sum([(await store.stats()).pending for store in fleet.stores]),
        heartbeats_pending=await fleet.pending_of("heartbeat"),
        # read after the awaits above, as the samples always have (the relays move meanwhile)
        in_flight=sum(relay.metrics().in_flight for relay in fleet.relays), limits=limits,
        air_bytes=sum(c.on_air for c in (w.link_bytes() for w in fleet.workers.values()) if c is not None))


def telemetry_sending(fleet: SimFleet) -> int:
    """Telemetry records on their way directly to the leader: in no outbox, not answered yet."""
    return sum(w.telemetry_actor.sending for w in fleet.workers.values() if w.telemetry_actor)


# The outbox counters summed over the devices' files, named as `OutboxStats` names them.
STORE_FIELDS = ("enqueued", "delivered", "overwritten", "dead_lettered", "expired", "dropped", "pending",
                "duplicates")
RELAY_FIELDS = ("delivered", "retried", "capacity_rejections", "transient_failures", "dead_lettered")
BROKER_FIELDS = ("published", "delivered", "queued", "wills_published", "dropped_queue_full")


@dataclass(slots=True)
class DeviceTotals:
    """The report's counts of one process's devices, its outbox files, relays and broker."""

    stores: dict[str, int] = field(default_factory=dict)
    stores_conserve: bool = True
    files: int = 0
    telemetry_dead: int = 0
    telemetry_pending: int = 0
    telemetry_delivered: int = 0  # from the outbox files
    heartbeats_sent: int = 0
    heartbeats_coalesced: int = 0
    telemetry_direct: int = 0
    telemetry_stored: int = 0
    telemetry_refused: int = 0
    app_sent: int = 0  # the devices' applications, through the local API
    app_direct: int = 0
    app_stored: int = 0
    app_refused: int = 0
    app_refused_at_source: int = 0
    app_pending: int = 0  # in the outbox files
    app_dead: int = 0
    newest_seq: dict[str, int] = field(default_factory=dict)  # device -> seq of its newest beat (sent any)
    holding: set[str] = field(default_factory=set)  # devices whose newest beat waits in their outbox
    relay: dict[str, int] = field(default_factory=dict)
    redeliveries_suppressed: int = 0
    broker: dict[str, int] | None = None
    devices: int = 0
    timers_fired: int = 0
    cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    air_bytes: int = 0  # the devices' broker connections over TLS, as `AirModel` counts them
    # one entry per process, in process order: its devices, CPU seconds and peak RSS
    by_process: list[dict[str, float]] = field(default_factory=list)

    def add(self, other: DeviceTotals) -> None:
        _add(self, other)


async def device_totals(sim: Simulation, *, cpu_s: float) -> DeviceTotals:
    fleet = sim.fleet
    stats = [await store.stats() for store in fleet.stores]
    telemetry = [c for c in (s.by_class.get("telemetry") for s in stats) if c is not None]
    apps = [c for c in (s.by_class.get(app_kind(APP_CLASS)) for s in stats) if c is not None]
    load = sim.apps
    workers = fleet.all_workers()
    newest: dict[str, int] = {}
    for w in fleet.workers.values():  # the newest incarnation of each device
        hb = w.heartbeat_actor
        if hb is not None and hb.sent > 0:
            newest[w.device_id] = hb.last_seq
    broker = fleet.broker.stats() if fleet.broker is not None else None
    relays = [relay.metrics() for relay in fleet.relays]
    peak = peak_rss_mb()
    return DeviceTotals(
        stores={name: sum(int(getattr(s, name)) for s in stats) for name in STORE_FIELDS},
        stores_conserve=all(s.conservation_ok for s in stats), files=len(stats),
        telemetry_dead=sum(c.dead for c in telemetry), telemetry_pending=sum(c.pending for c in telemetry),
        telemetry_delivered=sum(c.delivered for c in telemetry),
        heartbeats_sent=sum(w.heartbeat_actor.sent for w in workers if w.heartbeat_actor),
        heartbeats_coalesced=sum(w.heartbeat_actor.coalesced for w in workers if w.heartbeat_actor),
        telemetry_direct=sum(w.telemetry_actor.direct for w in workers if w.telemetry_actor),
        telemetry_stored=sum(w.telemetry_actor.stored for w in workers if w.telemetry_actor),
        telemetry_refused=sim.telemetry_refused,
        app_sent=load.sent, app_direct=load.direct, app_stored=load.stored, app_refused=load.refused,
        app_refused_at_source=load.refused_at_source, app_pending=sum(c.pending for c in apps),
        app_dead=sum(c.dead for c in apps), newest_seq=newest, holding=fleet.held_heartbeats(),
        relay={name: sum(int(getattr(r, name)) for r in relays) for name in RELAY_FIELDS},
        redeliveries_suppressed=fleet.redeliveries_suppressed,
        broker=None if broker is None else {name: int(getattr(broker, name)) for name in BROKER_FIELDS},
        air_bytes=sum(c.on_air for c in (w.link_bytes() for w in workers) if c is not None),
        devices=len(fleet.workers), timers_fired=int(getattr(sim.clock, "fired", 0) or 0), cpu_s=cpu_s,
        peak_rss_mb=peak,
        by_process=[{"devices": len(fleet.workers), "cpu_seconds": round(cpu_s, 3), "peak_rss_mb": peak}])


__all__ = ["BROKER_FIELDS", "RELAY_FIELDS", "STORE_FIELDS", "DeviceTotals", "DevicesNow", "device_totals",
           "devices_now", "telemetry_sending"]
