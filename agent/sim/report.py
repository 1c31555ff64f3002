"""The simulation report: what was sent, what arrived, what was coalesced, and what was lost.

Definitions (all counts over the whole run):

* telemetry `lost` = records generated - records in the leader's state (each applied once, by
  message id) - records dead-lettered or still pending in an outbox. Must be 0.
* jobs `lost` = jobs submitted - jobs confirmed in the leader's queue. Must be 0 after draining.
* heartbeats `stale_devices` = devices whose newest heartbeat (by seq) is neither the one in
  the leader's registry at the end nor still held in their outbox. 0 on the virtual clock, which
  stops everything at once; on the wall clock a beat made just before the stop can still be on
  its way (sent, or in the leader's batch being written) when the report is read. A device
  stopped before its last beat went out holds it (`held_in_outboxes`).
* `lost` = telemetry lost + jobs lost: messages that must each arrive. A heartbeat is not one of
  them (each supersedes the last, by design): a stale one is reported as `stale_devices`.
* `conservation_ok`: every outbox satisfies enqueued = delivered + dead_lettered + expired +
  dropped + overwritten + pending (- replayed), every leader mailbox satisfies enqueued =
  processed + depth + dropped + coalesced + drained, and no telemetry is unaccounted for.

Everything except the `wall` section depends only on the options and the seed.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import TYPE_CHECKING, Any

from agent.actors import MailboxStatistics
from agent.core.sql import redacted
from agent.sim.enrolment import enrolled_count
from agent.sim.options import APP_CLASS

if TYPE_CHECKING:
    from agent.sim.options import SimOptions
    from agent.sim.runner import Simulation
    from agent.sim.totals import DeviceTotals

Report = dict[str, Any]


def _mailbox(s: MailboxStatistics) -> dict[str, int]:
    return {"capacity": s.capacity, "high_water": s.high_water, "enqueued": s.enqueued, "processed": s.processed,
            "rejected": s.rejected, "coalesced": s.coalesced, "dropped": s.dropped, "depth": s.depth}


def _mailbox_ok(s: MailboxStatistics) -> bool:
    return s.enqueued == s.processed + s.depth + s.dropped + s.coalesced + s.drained


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024, 1)


async def collect_report(sim: Simulation, totals: DeviceTotals, *, wall_s: float) -> Report:
    """The report of `sim`, whose devices (in this process or in several) add up to `totals`."""
    opts = sim.opts
    fleet = sim.fleet
    leader = fleet.leader
    if leader is None:
        return shard_report(sim, totals, wall_s=wall_s)
    leader_outbox = await leader.outbox.stats()

    def total(field: str) -> int:
        return totals.stores.get(field, 0) + int(getattr(leader_outbox, field))

    hb_generated = totals.heartbeats_sent
    hb_outbox_coalesced = totals.heartbeats_coalesced
    tel_direct = totals.telemetry_direct
    tel_generated = tel_direct + totals.telemetry_stored
    gateways = {each.device_id for each in fleet.leaders}  # several leaders hear each other's presence
    devices = {d.device_id: d for d in leader.registry.devices() if d.device_id not in gateways}
    # With --shard, the leader also serves the other shards' devices: count this shard's.
    ours = devices if opts.shard is None else {k: v for k, v in devices.items() if k in fleet.workers}
    tel_applied = sum(d.telemetry_count for d in ours.values())
    tel_dead = totals.telemetry_dead
    tel_pending = totals.telemetry_pending
    tel_lost = tel_generated - tel_applied - tel_dead - tel_pending

    stale = held = 0
    for device_id, last_seq in totals.newest_seq.items():
        record = devices.get(device_id)
        if record is None or record.hb_seq != last_seq:
            if device_id in totals.holding:
                held += 1  # not lost: it waits in the outbox (the device stopped before it went out)
            else:
                stale += 1

    queue = job_leader.jobs_queue if (job_leader := fleet.job_leader) is not None else None
    jobs = queue.counts() if queue is not None and queue.held else {}  # (several leaders: the holder's)
    intake = leader.intake_stats
    requeued = queue.stats().requeued if queue is not None else 0
    results: dict[str, int] = {}
    for each in fleet.leaders:  # every leader's, a crashed one's included
        if (actor := each.leader_stats) is not None:
            for outcome, n in actor.stats.results.items():
                results[outcome] = results.get(outcome, 0) + n
    jobs_lost = max(0, sim.jobs_submitted - jobs.get("confirmed", 0))
    mailboxes = {s.name: s for s in leader.mailbox_statistics()}
    hb_box = mailboxes.get("heartbeats")
    intake_applied = intake.stats.applied if intake else 0

    leader_relay = leader.relay.metrics()

    def relayed(field: str) -> int:
        return totals.relay.get(field, 0) + int(getattr(leader_relay, field))

    conservation = (totals.stores_conserve and leader_outbox.conservation_ok
                    and all(_mailbox_ok(m) for m in mailboxes.values()))
    conservation = conservation and tel_lost == 0

    app_accepted = totals.app_direct + totals.app_stored
    # every leader's, a crashed one's included (several leaders share the message store)
    app_applied = sum(each.sinks.stats.snapshot().get(APP_CLASS, {}).get("applied", 0)
                      for each in fleet.leaders if each.sinks is not None)
    # (with --shard the leader stores the whole fleet's messages, this shard's applications sent their own)
    app_lost = 0 if opts.shard else app_accepted - app_applied - totals.app_pending - totals.app_dead
    conservation = conservation and app_lost == 0

    broker = totals.broker
    lost = tel_lost + jobs_lost + app_lost
    report: Report = {
        "scenario": {
            "name": opts.scenario, "devices": opts.devices, "duration_s": opts.duration_s, "seed": opts.seed,
            "heartbeat_s": opts.heartbeat_s, "leader_interval_s": opts.leader_interval_s,
            "telemetry_s": opts.telemetry_s, "app_every_s": opts.app_every_s, "offline_rate": opts.offline_rate,
            "offline_duration_s": opts.offline_duration_s, "crash_rate": opts.crash_rate,
            "crash_downtime_s": opts.crash_downtime_s, "tick_s": opts.tick_s,
            "broker_outage": list(opts.broker_outage) if opts.broker_outage else None,
            "jobs": opts.jobs, "job_window": opts.job_window, "leader_mailbox": opts.leader_mailbox_capacity,
            "files": totals.files, "shard": _shard(opts), "transport": "mqtt" if opts.broker_url else "memory",
            "clock": "virtual" if not (opts.realtime or opts.broker_url) else "realtime",
            "processes": opts.processes, "round_s": opts.round_s if opts.processes > 1 else None,
            **({"leaders": opts.leaders, "database": redacted(opts.database) if opts.database else None,
                "leader_crash_s": opts.leader_crash_s} if opts.leaders > 1 or opts.database else {}),
        },
        **({"leaders": {"served_last": leader.registry.leaders(), "crashed": sorted(fleet.crashed_leaders),
                        "busy_answers": {each.device_id: each.busy_answers for each in fleet.leaders},
                        # who ran the fleet's job queue: the times each took it (its lease)
                        "job_queue_taken": {each.device_id: each.jobs_queue.taken for each in fleet.leaders}}}
           if opts.leaders > 1 else {}),
        **({"enrolment": fleet.enrolment.report(enrolled_count(leader.shared))}
           if fleet.enrolment is not None else {}),
        "fleet_seconds": round(sim.now(), 3),
        "truncated_at_s": sim.truncated_at,  # set only when a benchmark's wall budget ran out
        "drain_seconds": round(sim.drain_fleet_s, 3),
        "drained": sim.drained,
        "lost": lost,
        "conservation_ok": conservation,
        "messages": {
            "sent": total("enqueued") + tel_direct,
            "sent_direct": tel_direct,
            "enqueued_in_outboxes": total("enqueued"),
            "delivered": total("delivered") + tel_direct,
            "coalesced": total("overwritten") + (hb_box.coalesced if hb_box else 0),
            "coalesced_in_outboxes": total("overwritten"),
            "coalesced_in_leader_mailbox": hb_box.coalesced if hb_box else 0,
            "dead_lettered": total("dead_lettered"),
            "expired": total("expired"),
            "dropped": total("dropped"),
            "pending": total("pending"),
            "duplicates_refused": total("duplicates"),
        },
        "heartbeats": {
            "generated": hb_generated,
            "coalesced_in_outboxes": hb_outbox_coalesced,
            "applied_by_leader": intake_applied,
            # (with --shard the leader applies the whole fleet's heartbeats, this shard made its own)
            "coalescing_ratio": round(hb_generated / intake_applied, 3) if intake_applied and not opts.shard else None,
            "stale_devices": stale,
            "held_in_outboxes": held,
        },
        "telemetry": {
            "generated": tel_generated, "direct": tel_direct, "via_outbox": totals.telemetry_stored,
            "applied_by_leader": tel_applied, "duplicates_ignored": actor.stats.telemetry_duplicate if actor else 0,
            "dead_lettered": tel_dead, "pending": tel_pending, "refused_at_source": totals.telemetry_refused,
            "lost": tel_lost,
        },
        "applications": {
            "sent": totals.app_sent, "accepted": app_accepted, "direct": totals.app_direct,
            "via_outbox": totals.app_stored, "refused": totals.app_refused,
            "refused_at_source": totals.app_refused_at_source, "applied_by_leader": app_applied,
            "pending": totals.app_pending, "dead_lettered": totals.app_dead, "lost": app_lost,
        },
        "jobs": {
            "submitted": sim.jobs_submitted, "confirmed": jobs.get("confirmed", 0),
            "pending": jobs.get("pending", 0), "results": results, "requeued": requeued,
            "confirmed_more_than_once": max(0, results.get("confirmed", 0) - jobs.get("confirmed", 0)),
            "lost": jobs_lost,
        },
        "leader_mailbox": {name: _mailbox(s) for name, s in sorted(mailboxes.items())},
        "leader_mailbox_high_water": hb_box.high_water if hb_box else 0,
        "leader": {
            "busy_answers": leader.busy_answers, "rejected": leader.rejects.count,
            "devices_known": len(devices),
            # at the end of the run, before the simulator stops the workers
            "devices_online": sim.at_end.get("leader_sees_online"),
        },
        "at_end": {k: v for k, v in sim.at_end.items() if k != "t"},
        "devices": _outcomes(sim, stale, totals.devices),
        "aimd_limit_over_time": [[p["t"], p["aimd_limit_min"], p["aimd_limit_mean"]] for p in sim.series],
        "timeseries": sim.series,
        "crashes": len(sim.crash_episodes),
        "relay": {
            "delivered": relayed("delivered") - totals.redeliveries_suppressed,
            "retried": relayed("retried"),
            "capacity_rejections": relayed("capacity_rejections"),
            "transient_failures": relayed("transient_failures"),
            "dead_lettered": relayed("dead_lettered"),
        },
        "offline_episodes": len(sim.offline_episodes),
        # what the devices' broker connections would cost over TLS (`agent.transport.linkbytes.AirModel`):
        # per device and day of fleet time, to price a fleet on a metered plan before deploying it
        "air": {"bytes": totals.air_bytes,
                "bytes_per_device_per_day": round(totals.air_bytes * 86_400 / (totals.devices * sim.now()))
                if totals.devices and sim.now() > 0 else None,
                "steady_bytes_per_device_per_day": _steady_air(sim, totals.air_bytes, totals.devices),
                "model": "MQTT v5 over TLS 1.2, TCP/IPv4 headers, keep-alive pings (docs/service.md)"},
        "broker": broker,
        "wall": {
            "seconds": round(wall_s, 3),
            "cpu_seconds": round(totals.cpu_s, 3),  # summed over the processes, as is the peak RSS
            "fleet_seconds_per_wall_second": round(sim.now() / wall_s, 1) if wall_s > 0 else None,
            "peak_rss_mb": round(totals.peak_rss_mb, 1),
            "relay_redeliveries_suppressed": totals.redeliveries_suppressed,
            "timers_fired": totals.timers_fired if hasattr(sim.clock, "fired") else None,
            "processes": totals.by_process,
            "settles": getattr(sim.clock, "settles", None),
        },
    }
    return report


def _shard(opts: SimOptions) -> str | None:
    return f"{opts.shard[0]}/{opts.shard[1]}" if opts.shard is not None else None


def shard_report(sim: Simulation, totals: DeviceTotals, *, wall_s: float) -> Report:
    """The report of a shard without the leader (`--shard K/M`, K > 1): what its devices sent, and
    what the leader (in shard 1) acknowledged, directly or through the outbox. `lost` is what was
    neither acknowledged nor is still held: the leader's shard reports what it applied."""
    opts = sim.opts
    tel_generated = totals.telemetry_direct + totals.telemetry_stored
    tel_delivered = totals.telemetry_delivered
    unacknowledged = (tel_generated - totals.telemetry_direct - tel_delivered - totals.telemetry_dead
                      - totals.telemetry_pending)
    return {
        "scenario": {"devices": opts.devices, "shard": _shard(opts), "devices_here": totals.devices,
                     "duration_s": opts.duration_s, "seed": opts.seed, "heartbeat_s": opts.heartbeat_s,
                     "telemetry_s": opts.telemetry_s, "transport": "mqtt", "clock": "realtime"},
        "fleet_seconds": round(sim.now(), 3),
        "drain_seconds": round(sim.drain_fleet_s, 3),
        "drained": sim.drained,
        "lost": unacknowledged,
        "conservation_ok": totals.stores_conserve and unacknowledged == 0,
        "messages": {name: totals.stores.get(name, 0) for name in ("enqueued", "delivered", "overwritten",
                                                                    "dead_lettered", "expired", "dropped", "pending")},
        "heartbeats": {"generated": totals.heartbeats_sent, "coalesced_in_outboxes": totals.heartbeats_coalesced,
                       "held_in_outboxes": len(totals.holding)},
        "telemetry": {"generated": tel_generated, "direct": totals.telemetry_direct,
                      "via_outbox": totals.telemetry_stored, "delivered_from_outbox": tel_delivered,
                      "dead_lettered": totals.telemetry_dead, "pending": totals.telemetry_pending,
                      "unacknowledged": unacknowledged},
        "at_end": {k: v for k, v in sim.at_end.items() if k != "t"},
        "relay": {name: totals.relay.get(name, 0) for name in ("delivered", "retried", "transient_failures",
                                                                "dead_lettered")},
        "wall": {"seconds": round(wall_s, 3), "cpu_seconds": round(totals.cpu_s, 3),
                 "peak_rss_mb": round(totals.peak_rss_mb, 1)},
    }


def _steady_air(sim: Simulation, air_bytes: int, devices: int) -> int | None:
    """Bytes on the air per device per day over the run's second half: past the boots and the
    first full heartbeats (None for a run too short to have one)."""
    end = sim.now()
    mid = next((p for p in sim.series if p["t"] >= end / 2 and p.get("air_bytes") is not None), None)
    if mid is None or not devices or end - mid["t"] <= 0:
        return None
    return round((air_bytes - int(mid["air_bytes"])) * 86_400 / (devices * (end - mid["t"])))


def _outcomes(sim: Simulation, stale: int, total: int) -> dict[str, int]:
    """Devices by what happened to them (each counted once, the worst first)."""
    crashed = {d for d, _, _ in sim.crash_episodes}
    offline = {d for d, _, _ in sim.offline_episodes} - crashed
    return {"crashed_and_restarted": len(crashed), "offline_and_back": len(offline),
            "steady": total - len(crashed) - len(offline), "stale_at_end": stale}


def _telemetry(scenario: dict[str, Any]) -> str:
    every = scenario.get("telemetry_s") or 0
    return f"telemetry every {every:g}s" if every else "no telemetry"


def summary(report: Report) -> str:
    if "leader" not in report:
        return _shard_summary(report)
    s, m, hb, tel, jobs = (report[k] for k in ("scenario", "messages", "heartbeats", "telemetry", "jobs"))
    box = report["leader_mailbox"].get("heartbeats", {})
    lines = [
        f"simulated {s['devices']} devices for {s['duration_s']:.0f}s of fleet time ({s['clock']} clock,"
        f" {s['transport']} broker, seed {s['seed']}) in {report['wall']['seconds']:.1f}s of wall time",
        f"messages (telemetry, job results, applications' messages; heartbeats on the next line): sent {m['sent']},"
        f" delivered {m['delivered']}, coalesced {m['coalesced']}, dead-lettered {m['dead_lettered']},"
        f" pending {m['pending']}",
        f"heartbeats: {hb['generated']} made, {hb['applied_by_leader']} applied by the leader"
        f" (coalescing ratio {hb['coalescing_ratio']}), {hb['coalesced_in_outboxes']} coalesced in outboxes",
        f"telemetry: {tel['generated']} sent ({tel['direct']} direct, {tel['via_outbox']} via outbox),"
        f" {tel['applied_by_leader']} in the leader's state, {tel['duplicates_ignored']} redeliveries ignored",
        f"leader mailbox: high-water {box.get('high_water', 0)} of {box.get('capacity', 0)},"
        f" {report['leader']['busy_answers']} busy answers, relay capacity rejections"
        f" {report['relay']['capacity_rejections']}",
    ]
    air = report["air"]
    if air["bytes_per_device_per_day"] is not None:
        steady = air.get("steady_bytes_per_device_per_day")
        lines.append(f"on the air over TLS (a model: docs/service.md, \"What an idle device costs\"), per device"
                     f" per day: {air['bytes_per_device_per_day'] / 1e6:.2f} MB over the whole run (its first full"
                     f" heartbeats, {_telemetry(s)}, jobs and reconnections; the first"
                     " connection not counted)"
                     + (f", {steady / 1e6:.2f} MB over its second half (steady state)" if steady is not None else ""))
    apps = report["applications"]
    if apps["sent"] or apps["refused_at_source"]:
        lines.append(f"applications: {apps['sent']} messages through the local API ({apps['direct']} direct,"
                     f" {apps['via_outbox']} via outbox, {apps['refused']} refused), {apps['applied_by_leader']}"
                     " stored by the leader")
    if (enrolment := report.get("enrolment")) is not None:
        took = enrolment["boot_to_enrolled_s"] or {"median": 0.0, "max": 0.0}
        lines.append(f"enrolment: {enrolment['enrolled']}/{enrolment['devices']} devices enrolled at their first"
                     f" boot (boot to certificate: median {took['median']:.1f}s, max {took['max']:.1f}s of fleet"
                     " time)")
    if jobs["submitted"]:
        lines.append(f"jobs: {jobs['confirmed']}/{jobs['submitted']} confirmed, {jobs['requeued']} requeued,"
                     f" confirmed twice: {jobs['confirmed_more_than_once']}")
    if report["offline_episodes"] or s["broker_outage"]:
        lines.append(f"faults: {report['offline_episodes']} devices offline for {s['offline_duration_s']:.0f}s"
                     + (f", broker down {s['broker_outage'][1]:.0f}s at {s['broker_outage'][0]:.0f}s"
                        if s["broker_outage"] else ""))
    if report["crashes"]:
        lines.append(f"crashes: {report['crashes']} devices crashed and restarted on their SQLite state")
    dev = report["devices"]
    lines.append(f"devices: {dev['steady']} steady, {dev['offline_and_back']} offline and back,"
                 f" {dev['crashed_and_restarted']} crashed and restarted; leader sees"
                 f" {report['leader']['devices_online']}/{report['leader']['devices_known']} online at the end")
    if "leaders" in report:
        led = report["leaders"]
        crashed = f", {', '.join(led['crashed'])} crashed at {s['leader_crash_s']:.0f}s" if led["crashed"] else ""
        lines.append(f"leaders: {s['leaders']} on one PostgreSQL registry{crashed}; devices served last by "
                     + ", ".join(f"{k} {v}" for k, v in led["served_last"].items()))
    stale = report["heartbeats"]["stale_devices"]
    lines.append(f"lost: {report['lost']}   conservation_ok: {report['conservation_ok']}"
                 f"   drained in {report['drain_seconds']:.0f}s of fleet time after the run"
                 + (f"   stale heartbeats: {stale} (a newest beat not at the leader yet: not lost)" if stale else ""))
    return "\n".join(lines)


def _shard_summary(report: Report) -> str:
    s, tel, hb = report["scenario"], report["telemetry"], report["heartbeats"]
    return "\n".join([
        f"shard {s['shard']}: {s['devices_here']} of {s['devices']} devices for {s['duration_s']:.0f}s"
        f" against {s['transport']} in {report['wall']['seconds']:.1f}s of wall time (the leader runs in shard 1)",
        f"heartbeats: {hb['generated']} made, {hb['coalesced_in_outboxes']} coalesced in outboxes",
        f"telemetry: {tel['generated']} sent, {tel['direct']} answered directly by the leader,"
        f" {tel['delivered_from_outbox']} delivered from the outbox, {tel['pending']} pending",
        f"lost: {report['lost']} (neither acknowledged by the leader nor held)   drained: {report['drained']}",
    ])


def to_json(report: Report) -> str:
    return json.dumps(report, indent=2, sort_keys=True)


__all__ = ["Report", "collect_report", "peak_rss_mb", "summary", "to_json"]
