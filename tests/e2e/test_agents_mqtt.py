"""Worker and leader agents against a real mosquitto (started by the fixtures on a free port).

Agents run in this process on `MqttTransport` and the system clock, except where a test needs
to kill one with SIGKILL: that one runs `python -m agent.cli run` in a child process.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiomqtt
import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import (
    db_query,
    kill,
    leader,
    pending,
    spawn_agent,
    stop_all,
    submit_through_outbox,
    telemetry_counts,
    until,
    worker,
)

from agent.core.clock import SystemClock
from agent.core.codec import Envelope, decode_reply, encode
from agent.core.errors import StoreError
from agent.leader.agent import LEADER_DB
from agent.leader.readonly import open_leader_db
from agent.protocol import Heartbeat, JobSubmit
from agent.transport import topics
from agent.transport.mqtt import MqttTransport
from agent.transport.presence import decode_presence, encode_presence
from agent.worker.actors import SEQ_PER_INCARNATION

pytestmark = pytest.mark.mqtt

FAST = {"heartbeat": {"interval_s": 0.5}}
LEADER = {"leader": {"heartbeat_deadline_s": 3.0}}


def _telemetry_total(db: Path) -> int:
    try:
        return sum(telemetry_counts(db).values())
    except StoreError:
        return 0


def _online(db: Path) -> int:
    try:
        with open_leader_db(db) as leader:
            return leader.registry.online_count()[1]
    except StoreError:  # not there, or not a leader database yet
        return 0


def _known(db: Path) -> int:
    try:
        with open_leader_db(db) as leader:
            return leader.registry.count()
    except StoreError:
        return 0


async def test_broker_outage_mid_stream(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    clock = SystemClock()
    gw = await leader(clock, tmp_path, url=mosquitto.url, **LEADER)
    workers = [await worker(clock, tmp_path, f"w{i}", url=mosquitto.url, sections=FAST) for i in range(3)]
    try:
        await until(clock, lambda: gw.registry.counts()[0] == 3, limit_s=20, step_s=0.1, what="online")
        sent = 0
        for w in workers:
            await w.send_telemetry("t", 0.0)
            sent += 1
        mosquitto.stop()
        await until(clock, lambda: not any(w.transport.connected.is_open for w in workers), limit_s=10,
                    step_s=0.05, what="workers see the outage")
        for n in range(10):
            for w in workers:
                assert await w.send_telemetry("t", float(n)) == "outbox"
                sent += 1
        beats = {w.device_id: w.heartbeat_actor.sent for w in workers if w.heartbeat_actor is not None}
        # five more heartbeats each while the broker is away
        def beat_on() -> bool:
            return all(w.heartbeat_actor is not None and w.heartbeat_actor.sent >= beats[w.device_id] + 5
                       for w in workers)

        await until(clock, beat_on, limit_s=60, step_s=0.05, what="heartbeats while away")
        for w in workers:
            assert await pending(w, "heartbeat") <= 1
            assert await pending(w, "telemetry") == 10
            assert w.heartbeat_actor is not None and w.heartbeat_actor.sent >= 5
        mosquitto.start()
        await until(clock, lambda: sum(d.telemetry_count for d in gw.registry.devices()) >= sent, limit_s=40,
                    step_s=0.1, what="telemetry after the outage")
        for w in workers:
            await until(clock, lambda w=w: _empty(w), limit_s=20, step_s=0.1, what="outbox drained")
            stats = await w.outbox.stats()
            assert stats.conservation_ok and stats.dead_lettered == 0
        # every outbox is empty: nothing is left to arrive, so nothing arrived twice
        assert sum(d.telemetry_count for d in gw.registry.devices()) == sent
    finally:
        await stop_all(*workers, gw)


async def _empty(w) -> bool:  # type: ignore[no-untyped-def]
    return await pending(w) == 0


async def test_leader_sigkill_and_restart(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    clock = SystemClock()
    # w0 submits the jobs: an operator identity of this leader (a device may not submit jobs)
    leader_sections = {"leader": {**LEADER["leader"], "operators": ["w0"]}}
    proc = spawn_agent(tmp_path, "leader", "gw", mosquitto.url, **leader_sections)
    db = tmp_path / "gw" / LEADER_DB
    jobs = {"jobs": {"demand_window": 2}}
    workers = [await worker(clock, tmp_path, f"w{i}", url=mosquitto.url, sections={**FAST, **jobs})
               for i in range(3)]
    try:
        await until(clock, lambda: _online(db) == 3, limit_s=30,
                    step_s=0.1, what="leader sees 3 workers")
        await submit_through_outbox(workers[0], [JobSubmit(job_id=f"job-{n:02d}", kind="sleep", payload=b"0.1")
                                                 for n in range(50)])
        sent = 0
        for n in range(10):
            for w in workers:
                await w.send_telemetry("t", float(n))
                sent += 1
            await asyncio.sleep(0.05)
        await until(clock, lambda: len(db_query(db, "SELECT 1 FROM jobs WHERE state = 'confirmed'")) >= 10,
                    limit_s=30, step_s=0.05, what="some jobs confirmed")
        assert kill(proc) != 0  # SIGKILL mid-stream
        for n in range(10):
            await asyncio.gather(*[w.send_telemetry("t", float(n)) for w in workers])
            sent += len(workers)
        proc = spawn_agent(tmp_path, "leader", "gw", mosquitto.url, **leader_sections)
        await until(clock, lambda: len(db_query(db, "SELECT 1 FROM jobs WHERE state = 'confirmed'")) == 50,
                    limit_s=60, step_s=0.1, what="all jobs confirmed after the restart")
        await until(clock, lambda: _telemetry_total(db) >= sent, limit_s=60, step_s=0.1, what="all telemetry")
        for w in workers:  # nothing left to arrive: a record applied twice would show now
            await until(clock, lambda w=w: _empty(w), limit_s=60, step_s=0.1, what="outbox drained")
        assert _telemetry_total(db) == sent  # no record applied twice
        rows = db_query(db, "SELECT job_id, state FROM jobs")
        assert len(rows) == 50 and {s for _, s in rows} == {"confirmed"}
        epoch = db_query(db, "SELECT value FROM jobqueue_meta WHERE key = 'epoch'")
        assert epoch == [(2,)]
    finally:
        await stop_all(*workers)
        kill(proc, 15)


@pytest.mark.slow
async def test_200_workers_reconnecting_at_once(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    clock = SystemClock()
    gw = await leader(clock, tmp_path, url=mosquitto.url, mailbox={"capacity": 32},
                      leader={"process_interval_s": 0.2, "heartbeat_deadline_s": 60.0})
    sections = {"heartbeat": {"interval_s": 2.0}, "relay": {"reconnect_jitter_s": 0.2}}
    workers = list(await asyncio.gather(*[
        worker(clock, tmp_path, f"w{i:03d}", url=mosquitto.url, sections=sections) for i in range(200)]))
    try:
        await until(clock, lambda: all(w.transport.connected.is_open for w in workers), limit_s=60, step_s=0.2,
                    what="200 workers connected")
        mosquitto.stop()
        await until(clock, lambda: not any(w.transport.connected.is_open for w in workers), limit_s=20,
                    step_s=0.1, what="all disconnected")
        for w in workers:
            for n in range(3):
                assert await w.send_telemetry("t", float(n)) == "outbox"
        await asyncio.sleep(2.5)
        mosquitto.start()  # all 200 come back at the same moment
        await until(clock, lambda: sum(d.telemetry_count for d in gw.registry.devices()) == 600, limit_s=90,
                    step_s=0.2, what="every telemetry record arrived")
        for box in gw.mailbox_statistics():
            assert box.high_water <= box.capacity == 32
        assert gw.busy_answers > 0
        rejections = sum(w.relay.metrics().capacity_rejections for w in workers if w.relay is not None)
        assert rejections > 0  # busy answers slowed the relays down
    finally:
        await asyncio.gather(*[w.stop() for w in workers])
        await stop_all(gw)


async def test_work_pulling_with_a_worker_killed(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    clock = SystemClock()
    gw = await leader(clock, tmp_path, url=mosquitto.url, **LEADER)
    jobs = {"jobs": {"demand_window": 2}}
    local = [await worker(clock, tmp_path, f"w{i}", url=mosquitto.url, sections={**FAST, **jobs}) for i in range(2)]
    victim = spawn_agent(tmp_path, "worker", "victim", mosquitto.url, **FAST, **jobs)
    try:
        await until(clock, lambda: len(gw.jobs_queue.workers()) == 3, limit_s=30, step_s=0.1, what="3 workers")
        await gw.submit_jobs([JobSubmit(job_id=f"job-{n:02d}", kind="sleep", payload=b"0.3") for n in range(50)])
        await until(clock, lambda: len(gw.jobs_queue.held_by("victim")) == 2
                    and gw.jobs_queue.stats().confirmed >= 6, limit_s=30, step_s=0.02, what="victim holds jobs")
        held = [o.job_id for o in gw.jobs_queue.held_by("victim")]
        kill(victim)  # its last will tells the leader; its jobs go back to the pool
        await until(clock, lambda: gw.jobs_queue.counts()["confirmed"] == 50, limit_s=60, step_s=0.1,
                    what="all 50 confirmed")
        assert gw.leader_stats is not None
        assert gw.leader_stats.stats.results.get("confirmed") == 50  # each exactly once
        assert gw.jobs_queue.stats().requeued >= len(held) > 0
    finally:
        kill(victim)
        await stop_all(*local, gw)


async def test_two_leaders_on_a_shared_subscription(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    clock = SystemClock()
    shared = {"leader": {**LEADER["leader"], "shared_group": "leaders"}}
    other = spawn_agent(tmp_path, "leader", "gw2", mosquitto.url, **shared)
    gw = await leader(clock, tmp_path, url=mosquitto.url, name="gw1", **shared)
    other_db = tmp_path / "gw2" / LEADER_DB
    workers = [await worker(clock, tmp_path, f"w{i}", url=mosquitto.url, sections=FAST) for i in range(4)]
    try:
        await until(clock, lambda: _known(other_db) > 0,
                    limit_s=30, step_s=0.1, what="second leader receiving")
        sent = 0
        for n in range(30):
            for w in workers:
                await w.send_telemetry("t", float(n))
                sent += 1
            if n == 12:
                kill(other)  # SIGKILL one leader mid-stream
            await asyncio.sleep(0.02)
        mine = lambda: sum(d.telemetry_count for d in gw.registry.devices())  # noqa: E731
        await until(clock, lambda: mine() + _telemetry_total(other_db) >= sent, limit_s=60, step_s=0.1,
                    what="every record in one leader or the other")
        assert _telemetry_total(other_db) > 0 and mine() > 0  # the subscription split the stream
        assert mine() < sent  # what gw2 confirmed before its kill is not sent again
        for w in workers:
            await until(clock, lambda w=w: _empty(w), limit_s=30, step_s=0.1, what="outboxes drained")
    finally:
        kill(other)
        await stop_all(*workers, gw)


async def test_forged_malformed_and_oversized_on_mosquitto(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    clock = SystemClock()
    gw = await leader(clock, tmp_path, url=mosquitto.url, mqtt={"max_payload_bytes": 2048})
    try:
        await until(clock, lambda: gw.transport.connected.is_open, limit_s=10, step_s=0.05, what="leader up")
        hb = msgspec.msgpack.encode(Heartbeat(device_id="w2", seq=1, uptime_s=1.0))
        bad = [
            # oversized: the leader announced its Maximum Packet Size, so the broker never sends it
            encode(Envelope(id="e0", kind="telemetry", sender="w1", receiver="leader", payload=b"x" * 8192)),
            encode(Envelope(id="e1", kind="heartbeat", sender="w2", receiver="leader", payload=hb)),  # forged
            b"\xc1 not msgpack",  # malformed
            encode(Envelope(id="e3", kind="heartbeat", sender="w3", receiver="leader", payload=hb)),  # forged
        ]
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="rogue",
                                  protocol=aiomqtt.ProtocolVersion.V5) as client:
            await client.subscribe(topics.reply("t", "w1", "rogue"), qos=1)
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            for n, payload in enumerate(bad):
                props = Properties(PacketTypes.PUBLISH)
                props.ResponseTopic = topics.reply("t", "w1", "rogue")
                props.CorrelationData = str(n).encode()
                await client.publish(topics.up("t", "w1"), payload, qos=1, properties=props)
            answered: dict[bytes, str] = {}
            async with asyncio.timeout(30):
                async for message in client.messages:
                    correlation = message.properties.CorrelationData  # type: ignore[union-attr]
                    answered[correlation] = decode_reply(message.payload).status  # type: ignore[arg-type]
                    if {b"1", b"2", b"3"} <= set(answered):
                        break
        # the broker delivers one publisher's messages in order: the oversized one came first
        assert answered == {b"1": "rejected", b"2": "rejected", b"3": "rejected"}
        reasons = [r.reason for r in reversed(gw.rejects.list())]
        assert len(reasons) == 3
        assert "does not match" in reasons[0]
        w = await worker(clock, tmp_path, "w1", url=mosquitto.url, sections=FAST)
        try:  # and the leader keeps working
            await until(clock, lambda: gw.registry.device("w1") is not None, limit_s=10, step_s=0.05,
                        what="good heartbeat")
        finally:
            await stop_all(w)
    finally:
        await stop_all(gw)


async def test_a_late_will_of_an_earlier_session_leaves_a_live_worker_online(  # type: ignore[no-untyped-def]
        mosquitto, tmp_path: Path) -> None:
    """A will that arrives after the device came back (a clustered broker, a second process with
    the same identity) names an earlier session: the worker stays online."""
    clock = SystemClock()
    gw = await leader(clock, tmp_path, url=mosquitto.url, **LEADER)
    w = await worker(clock, tmp_path, "w0", url=mosquitto.url, sections=FAST)
    try:
        await until(clock, lambda: gw.registry.counts()[0] == 1, limit_s=20, step_s=0.05, what="online")
        stats = gw.leader_stats
        assert stats is not None
        assert isinstance(w.transport, MqttTransport) and w.transport.birth is not None
        session = decode_presence(w.transport.birth.payload).session
        stale = encode_presence(False, "0" * 16 if session != "0" * 16 else "1" * 16, 1)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="late-will",
                                  protocol=aiomqtt.ProtocolVersion.V5) as client:
            seen = stats.stats.presence
            await client.publish(topics.presence("t", "w0"), stale, qos=1, retain=True)
            await until(clock, lambda: stats.stats.presence > seen, limit_s=20, step_s=0.05, what="will applied")
            device = gw.registry.device("w0")
            assert device is not None and device.online
            seen = stats.stats.presence
            await client.publish(topics.presence("t", "w0"), encode_presence(False, session, 1), qos=1, retain=True)
            await until(clock, lambda: stats.stats.presence > seen, limit_s=20, step_s=0.05, what="will applied")
            device = gw.registry.device("w0")
            assert device is not None and not device.online and device.offline_reason == "presence"
    finally:
        await stop_all(w, gw)


async def test_the_worker_reports_what_its_broker_connection_moved(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The kernel's counters of the real connection, on /metrics and in the /healthz line doctor prints."""
    from agent.service.prom import collect, render

    clock = SystemClock()
    gw = await leader(clock, tmp_path, url=mosquitto.url, **LEADER)
    w = await worker(clock, tmp_path, "w1", url=mosquitto.url, sections=FAST)
    try:
        await until(clock, lambda: gw.registry.counts()[0] == 1, limit_s=20, step_s=0.1, what="online")
        before = w.link_bytes()
        assert before is not None and before.bytes_sent > 0 and before.bytes_received > 0
        await w.send_telemetry("t", 1.0)
        await until(clock, lambda: (w.link_bytes() or before).bytes_sent > before.bytes_sent, limit_s=20,
                    step_s=0.1, what="the telemetry counted")
        ok, detail = await w.checks()["transport"]()
        assert ok and detail.startswith("connected; ") and "KB an hour on the air" in detail
        text = render([family for c in w.collectors().values() for family in await collect(c)])
        assert "ea_worker_broker_bytes_sent_total " in text and "ea_worker_broker_segments_total " in text
        assert "ea_worker_broker_bytes_per_hour " in text
    finally:
        await stop_all(w, gw)


async def test_junk_a_device_left_retained_on_its_uplink_is_taken_once_not_at_every_start(  # type: ignore[no-untyped-def]
        mosquitto, tmp_path: Path) -> None:
    """The live publish is refused and recorded once; the copy the broker keeps retained is handed
    to every new subscription with the retain flag, and a restarted leader ignores it."""
    clock = SystemClock()
    gw = await leader(clock, tmp_path, url=mosquitto.url)
    try:
        await until(clock, lambda: gw.transport.connected.is_open, limit_s=10, step_s=0.05, what="leader up")
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="w1",
                                  protocol=aiomqtt.ProtocolVersion.V5) as device:
            await device.publish(topics.up("t", "w1"), b"\xc1 junk", qos=1, retain=True)
        await until(clock, lambda: len(gw.rejects.list()) == 1, limit_s=10, step_s=0.05, what="refused once")
    finally:
        await stop_all(gw)
    for _ in range(2):  # two more starts of the leader on the same state
        again = await leader(clock, tmp_path, url=mosquitto.url)
        try:
            inbox = again.inbox
            await until(clock, lambda: inbox.stats.retained_ignored >= 1, limit_s=10, step_s=0.05,  # noqa: B023
                        what="the retained copy handed over")
            assert len(again.rejects.list()) == 1  # not recorded again
        finally:
            await stop_all(again)


async def test_a_worker_killed_counts_an_unexpected_restart_of_its_release_and_a_clean_stop_none(  # type: ignore[no-untyped-def]
        mosquitto, tmp_path: Path) -> None:
    """The fleet's healthy hours per release, from real processes: a worker SIGKILLed counts one
    unexpected restart of the firmware it ran when it starts again; one stopped by SIGTERM (as
    systemd stops it, as an update's reboot does) counts none."""
    clock = SystemClock()
    gw = await leader(clock, tmp_path, url=mosquitto.url, **LEADER)
    victim = spawn_agent(tmp_path, "worker", "victim", mosquitto.url, **FAST)

    def restarts() -> int | None:
        return next((r.unexpected_restarts for r in gw.registry.release_health() if r.devices), None)

    try:
        await until(clock, lambda: restarts() == 0, limit_s=60, step_s=0.1, what="the worker's first count")
        assert kill(victim) != 0  # SIGKILL: the record says it was running
        victim = spawn_agent(tmp_path, "worker", "victim", mosquitto.url, **FAST)
        await until(clock, lambda: restarts() == 1, limit_s=60, step_s=0.1, what="the unexpected restart counted")
        assert kill(victim, signal.SIGTERM) == 0  # a clean stop
        victim = spawn_agent(tmp_path, "worker", "victim", mosquitto.url, **FAST)
        seen = gw.registry.device("victim")
        assert seen is not None
        started = (seen.hb_seq // SEQ_PER_INCARNATION + 1) * SEQ_PER_INCARNATION  # the next start's seqs
        await until(clock, lambda: (gw.registry.device("victim") or seen).hb_seq >= started, limit_s=60,
                    step_s=0.1, what="the next start's first heartbeat")
        [release] = gw.registry.release_health()
        assert (release.firmware, release.devices, release.unexpected_restarts) == ("0.0.0", 1, 1)  # none more
    finally:
        kill(victim)
        await stop_all(gw)
