"""The heartbeat's cadence on virtual time: rare and short while idle, full when something
changed or the leader lacks it, fast while it matters, and the leader's deadline following the
interval each heartbeat announces."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import FLEET, leader, stop_all, until, worker

from agent.core.clock import VirtualClock
from agent.core.codec import decode, decode_envelope
from agent.leader.agent import LeaderAgent
from agent.protocol import KIND_HEARTBEAT, Heartbeat, SystemSample
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker, MemoryTransport
from agent.worker.agent import WorkerAgent

IDLE = {"heartbeat": {"interval_s": 300.0, "fast_interval_s": 5.0, "system_interval_s": 900.0}}


class Uplink:
    """Every heartbeat a device sends, with the virtual time it was sent at."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.beats: list[tuple[float, Heartbeat]] = []

    async def handler(self, message: InboundMessage) -> None:
        envelope = decode_envelope(message.payload)
        if envelope.kind == KIND_HEARTBEAT:
            self.beats.append((self.clock.monotonic(), decode(envelope.payload, Heartbeat)))

    def gaps(self, since: float = 0.0) -> list[float]:
        times = [t for t, _ in self.beats if t >= since]
        return [round(b - a, 1) for a, b in zip(times, times[1:], strict=False)]


async def listen(broker: MemoryBroker, clock: VirtualClock, device: str) -> tuple[Uplink, MemoryTransport]:
    uplink = Uplink(clock)
    spy = MemoryTransport(broker, "spy")
    await spy.subscribe(topics.up(FLEET, device), uplink.handler)
    await spy.start()
    return uplink, spy


class IdleFleet:
    """A leader, a worker at the idle cadence and a spy on the worker's uplink."""

    def __init__(self, clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
        self.clock, self.broker, self.tmp_path = clock, broker, tmp_path

    async def __aenter__(self) -> tuple[LeaderAgent, WorkerAgent, Uplink]:
        self.gw = await leader(self.clock, self.tmp_path, broker=self.broker)
        self.uplink, self.spy = await listen(self.broker, self.clock, "w1")
        self.w = await worker(self.clock, self.tmp_path, "w1", broker=self.broker, sections=IDLE)
        return self.gw, self.w, self.uplink

    async def __aexit__(self, *exc: object) -> None:
        await stop_all(self.w, self.gw, clock=self.clock)
        await self.spy.stop()


class Samples:
    """A sampler whose cpu reading a test sets."""

    def __init__(self) -> None:
        self.cpu = 5.0

    def __call__(self) -> SystemSample:
        return SystemSample(cpu_percent=self.cpu, mem_percent=20.0, disk_percent=30.0)


async def test_an_idle_device_beats_rarely_and_short_and_the_leader_keeps_what_it_left_out(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    gw = await leader(clock, tmp_path, broker=broker)
    uplink, spy = await listen(broker, clock, "w1")
    samples = Samples()
    w = await worker(clock, tmp_path, "w1", broker=broker, sections=IDLE, sampler=samples)
    try:
        await until(clock, lambda: len(uplink.beats) >= 4, limit_s=1200, step_s=5, what="four heartbeats")
        first, *rest = [hb for _, hb in uplink.beats]
        assert first.full and first.firmware_version and first.demand is not None and first.sample is not None
        assert first.interval_s == 300.0
        assert all(not hb.full and hb.firmware_version == "" and hb.demand is None for hb in rest)
        assert all(hb.sample is None for hb in rest[:2])  # not due: 900 s, and nothing moved
        assert uplink.gaps() == [300.0, 300.0, 300.0]
        record = gw.registry.device("w1")
        assert record is not None and record.online and record.firmware_version == first.firmware_version
        assert record.hb_seq == rest[-1].seq and record.sample is not None  # kept from the full one

        samples.cpu = 60.0  # moved more than sample_change_pct: the next beat carries the sample
        count = len(uplink.beats)
        await until(clock, lambda: len(uplink.beats) > count, limit_s=400, step_s=5, what="the next beat")
        assert uplink.beats[-1][1].sample == samples()
    finally:
        await stop_all(w, gw, clock=clock)
        await spy.stop()


async def test_a_leader_without_the_full_heartbeat_asks_for_it_and_gets_it_at_once(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    async with IdleFleet(clock, broker, tmp_path) as (gw, _w, uplink):
        await until(clock, lambda: len(uplink.beats) >= 2, limit_s=700, step_s=5, what="a short heartbeat")
        assert not uplink.beats[-1][1].full
        gw._full_heard.clear()  # as after a restart of the leader
        count = len(uplink.beats)
        await until(clock, lambda: len(uplink.beats) >= count + 2, limit_s=400, step_s=1, what="two more")
        (t_short, short), (t_full, full) = uplink.beats[count:count + 2]
        assert not short.full and full.full and full.demand is not None
        assert t_full - t_short < 5.0  # at once, not an interval later


async def test_fast_while_the_leader_asks_or_an_update_runs_then_idle_again(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    from agent.leader.rollout import LeaderPort

    async with IdleFleet(clock, broker, tmp_path) as (gw, w, uplink):
        await until(clock, lambda: len(uplink.beats) >= 2, limit_s=700, step_s=5, what="idle beats")
        before = len(uplink.beats)
        asked = clock.monotonic()
        await LeaderPort(gw).ask_fast_heartbeats(["w1"], for_s=60.0)  # what a soak does, through the outbox
        await clock.advance(1.0)
        assert len(uplink.beats) == before + 1 and uplink.beats[-1][0] - asked < 1.0  # one at once
        assert uplink.beats[-1][1].interval_s == 5.0  # never faster than fast_interval_s (the ask: 5 s)
        await clock.advance(360.0)
        paced = uplink.beats[before:]
        gaps = [round(b[0] - a[0], 1) for a, b in zip(paced, paced[1:], strict=False)]
        assert gaps[:11] == [5.0] * 11 and gaps[-1] == 300.0  # fast for the minute asked, then idle
        assert paced[-2][1].interval_s == 300.0  # the last fast one announced the idle wait

        before = len(uplink.beats)
        w.beat_fast(30.0)  # what the updater does at each report
        await clock.advance(40.0)
        fast = uplink.beats[before:]
        assert [round(b[0] - a[0], 1) for a, b in zip(fast, fast[1:], strict=False)][:5] == [5.0] * 5


async def test_the_leader_deadline_follows_the_announced_interval(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    gw = await leader(clock, tmp_path, broker=broker, leader={"heartbeat_deadline_s": 30.0})
    w = await worker(clock, tmp_path, "w1", broker=broker, sections=IDLE)
    try:
        await until(clock, lambda: (d := gw.registry.device("w1")) is not None and d.online, what="online")
        await clock.advance(600.0)  # twenty leader deadlines, two device intervals: still online
        record = gw.registry.device("w1")
        assert record is not None and record.online
        assert gw.registry.next_deadline_ms() is not None
        assert gw.registry.next_deadline_ms() - clock.now_ms() > 30_000  # type: ignore[operator]
    finally:
        await stop_all(w, clock=clock)
    # a device that falls silent without a last will is overdue after 2.5 of its announced intervals
    hb = Heartbeat(device_id="w9", seq=1, uptime_s=1.0, interval_s=100.0, wire=3)
    assert gw.registry.apply_heartbeat(hb)
    await clock.advance(200.0)
    assert gw.registry.device("w9").online  # type: ignore[union-attr]
    await clock.advance(60.0)  # the leader's deadline watcher
    silent = gw.registry.device("w9")
    assert silent is not None and not silent.online and silent.offline_reason == "deadline"
    await stop_all(gw, clock=clock)


async def test_the_slots_ride_a_full_heartbeat_when_they_change_and_the_device_page_shows_them(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    from agent.leader.readonly import open_leader_db
    from agent.protocol import SlotState

    async with IdleFleet(clock, broker, tmp_path) as (gw, w, uplink):
        state = {"now": SlotState(backend="uboot", booted="A", default="A", attempts={"A": 3, "B": 3},
                                  versions={"A": "1.0.0"})}
        w.slot_state = lambda: state["now"]
        await until(clock, lambda: len(uplink.beats) >= 2, limit_s=1200, step_s=5, what="two heartbeats")
        beats = [hb for _, hb in uplink.beats]
        assert beats[0].full and beats[0].slots == state["now"]
        assert not beats[1].full and beats[1].slots is None  # unchanged: left out
        state["now"] = SlotState(backend="uboot", booted="A", default="B", trial="B", attempts={"A": 3, "B": 3},
                                 versions={"A": "1.0.0", "B": "1.1.0"})
        count = len(uplink.beats)
        await until(clock, lambda: len(uplink.beats) > count, limit_s=400, step_s=5, what="the next beat")
        assert uplink.beats[-1][1].full and uplink.beats[-1][1].slots == state["now"]
        await until(clock, lambda: gw.registry.device("w1") is not None and gw.registry.device("w1").hb_seq
                    == uplink.beats[-1][1].seq, limit_s=60, step_s=1, what="the leader applied it")
        with open_leader_db(gw.registry.path) as db:
            found = db.registry.device("w1")
        assert found is not None and found[1].slots == state["now"]


def test_a_slot_state_beyond_its_bounds_is_refused_on_the_wire() -> None:
    import msgspec
    import pytest

    from agent.protocol import SlotState

    encode = msgspec.json.encode
    too_many = encode({"device_id": "w1", "seq": 1, "uptime_s": 1.0,
                       "slots": {"versions": {f"S{i}": "1.0" for i in range(5)}}})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(too_many, type=Heartbeat)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(encode({"booted": "x" * 17}), type=SlotState)


async def test_the_configuration_targets_ride_a_full_heartbeat_and_a_local_edit_shows_as_drift(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    from agent.commands.status import format_device
    from agent.leader.fleet_view import device_detail
    from agent.leader.readonly import open_leader_db
    from agent.protocol import ConfigState
    from config_rollout.device.apply import ConfigApplier
    from config_rollout.release import build_release, parse_release
    from rollout_engine.keys import SigningKey

    key = SigningKey.generate()
    etc = tmp_path / "etc" / "app"
    sections = {**IDLE, "config_targets": {"app": {"directory": str(etc), "settle_s": 0}}}
    gw = await leader(clock, tmp_path, broker=broker)
    uplink, spy = await listen(broker, clock, "w1")
    w = await worker(clock, tmp_path, "w1", broker=broker, sections=sections)
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "app.toml").write_text("port = 1\n")
        release = parse_release(build_release("app", "1.0.0", [src / "app.toml"], key, created_ms=1), key.public)
        applier = ConfigApplier("app", w.config.config_targets["app"], w.data_dir)
        await until(clock, lambda: len(uplink.beats) >= 1, limit_s=60, step_s=1, what="the first heartbeat")
        assert uplink.beats[0][1].configs == {"app": ConfigState(state="idle")}  # declared, nothing applied yet
        assert (await applier.apply(release)).state == "committed"
        (etc / "app.toml").write_text("port = 9\n")  # edited on the device
        count = len(uplink.beats)
        await until(clock, lambda: len(uplink.beats) > count, limit_s=400, step_s=5, what="the next beat")
        beat = uplink.beats[-1][1]
        assert beat.full and beat.configs == {"app": ConfigState(version="1.0.0", state="committed",
                                                                 drifted=("app.toml",), attempt=1)}
        await until(clock, lambda: gw.registry.device("w1") is not None and gw.registry.device("w1").hb_seq
                    == beat.seq, limit_s=60, step_s=1, what="the leader applied it")
        with open_leader_db(gw.registry.path) as db:
            detail = device_detail(db, "w1")
        assert detail is not None
        assert "    app: holds 1.0.0; DRIFTED: app.toml changed on the device" in format_device(detail, 0)
    finally:
        await stop_all(w, gw, clock=clock)
        await spy.stop()


async def test_the_health_count_rides_the_full_heartbeat_and_a_short_one_each_operating_hour(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    """The device's own count of how its agent runs on its firmware (`Heartbeat.health`): in
    every full heartbeat, in a short one once per operating hour, and the leader's healthy hours
    per release add the devices' counts up."""
    async with IdleFleet(clock, broker, tmp_path) as (gw, w, uplink):
        await until(clock, lambda: len(uplink.beats) >= 14, limit_s=5000, step_s=10, what="an hour of heartbeats")
        first, *rest = [hb for _, hb in uplink.beats]
        assert first.full and first.health is not None
        assert (first.health.firmware, first.health.unexpected_restarts) == (w.firmware_version(), 0)
        counted = [hb for hb in rest if hb.health is not None]
        assert len(counted) == 1 and not counted[0].full  # the hour: one short heartbeat says it
        assert counted[0].health is not None and counted[0].health.operating_s >= 3600
        [release] = gw.registry.release_health()
        assert (release.firmware, release.devices, release.unexpected_restarts) == (w.firmware_version(), 1, 0)
        assert release.hours >= 1.0 and release.healthy_ratio == 1.0
