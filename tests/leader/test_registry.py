import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.clock import VirtualClock
from agent.core.errors import StoreError
from agent.leader.registry import DeviceRegistry
from agent.protocol import DeviceHealth, Heartbeat, SystemSample, Telemetry

ROOT = Path(__file__).parents[2]


def hb(device: str, seq: int, version: str = "1.0.0", **kw: object) -> Heartbeat:
    return Heartbeat(device_id=device, seq=seq, uptime_s=float(seq), firmware_version=version,
                     **kw)  # type: ignore[arg-type]


def tm(device: str, seq: int, name: str = "temp", value: float = 1.0) -> Telemetry:
    return Telemetry(device_id=device, seq=seq, name=name, ts_ms=1_000 + seq, value=value)


@pytest.fixture
def registry(leader_store: Path | str, clock: VirtualClock):
    reg = DeviceRegistry.open(leader_store, clock=clock, heartbeat_deadline_s=30)
    yield reg
    reg.close()


def test_newer_heartbeat_wins_and_older_never_overwrites(registry: DeviceRegistry) -> None:
    sample = SystemSample(cpu_percent=5.0, temperature_c=50.0)
    assert registry.apply_heartbeat(hb("pi-1", 5, "2.0.0", tags=("a",), sample=sample))
    assert not registry.apply_heartbeat(hb("pi-1", 4, "1.0.0"))
    assert not registry.apply_heartbeat(hb("pi-1", 5, "1.0.0"))  # redelivered / same seq
    dev = registry.device("pi-1")
    assert dev is not None
    assert (dev.hb_seq, dev.firmware_version, dev.tags, dev.sample) == (5, "2.0.0", ("a",), sample)
    assert dev.online and dev.uptime_s == 5.0
    assert registry.apply_heartbeat(hb("pi-1", 6, "2.1.0"))
    assert registry.device("pi-1").firmware_version == "2.1.0"  # type: ignore[union-attr]


@settings(deadline=None, max_examples=40)
@given(order=st.permutations(list(range(12))), split=st.integers(min_value=0, max_value=12))
def test_out_of_order_arrival_keeps_the_highest_seq(tmp_path_factory: pytest.TempPathFactory,
                                                    order: list[int], split: int) -> None:
    path = tmp_path_factory.mktemp("reg") / "leader.db"
    with DeviceRegistry.open(path, clock=VirtualClock()) as reg:
        beats = [hb("pi-1", s, f"v{s}") for s in order]
        applied = reg.apply_heartbeats(beats[:split]) + reg.apply_heartbeats(beats[split:])
        best = -1
        for s, was_applied in zip(order, applied, strict=True):
            assert was_applied == (s > best)
            best = max(best, s)
        dev = reg.device("pi-1")
        assert dev is not None and (dev.hb_seq, dev.firmware_version) == (11, "v11")


def test_telemetry_dedup_by_message_id_survives_reopen(leader_store: Path | str, clock: VirtualClock) -> None:
    path = leader_store
    with DeviceRegistry.open(path, clock=clock) as reg:
        assert reg.apply_telemetry_batch([("m1", tm("pi-1", 1)), ("m2", tm("pi-1", 2, value=2.0)),
                                          ("m1", tm("pi-1", 1))]) == [True, True, False]
    with DeviceRegistry.open(path, clock=clock) as reg:
        assert reg.apply_telemetry("m2", tm("pi-1", 2, value=2.0)) is False
        assert reg.apply_telemetry("m1", tm("pi-1", 1)) is False
        assert reg.device("pi-1").telemetry_count == 2  # type: ignore[union-attr]
        assert reg.last_telemetry("pi-1")["temp"].value == 2.0


def test_older_telemetry_does_not_replace_the_last_value(registry: DeviceRegistry) -> None:
    registry.apply_telemetry("b", tm("pi-1", 9, value=9.0))
    registry.apply_telemetry("a", tm("pi-1", 3, value=3.0))
    assert registry.last_telemetry("pi-1")["temp"].seq == 9
    assert registry.device("pi-1").telemetry_count == 2  # type: ignore[union-attr]


def test_failure_mid_batch_commits_nothing(leader_store: Path | str, clock: VirtualClock,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = leader_store
    reg = DeviceRegistry.open(path, clock=clock)
    real = DeviceRegistry._apply_one_telemetry
    calls = 0

    def failing(self: DeviceRegistry, msg_id: str, record: Telemetry, now: int) -> bool:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt  # a BaseException in the middle of the transaction
        return real(self, msg_id, record, now)

    monkeypatch.setattr(DeviceRegistry, "_apply_one_telemetry", failing)
    with pytest.raises(KeyboardInterrupt):
        reg.apply_telemetry_batch([("m1", tm("pi-1", 1)), ("m2", tm("pi-1", 2))])
    monkeypatch.setattr(DeviceRegistry, "_apply_one_telemetry", real)
    reg.close()
    with DeviceRegistry.open(path, clock=clock) as reg:
        assert not reg.is_processed("m1")
        assert reg.apply_telemetry_batch([("m1", tm("pi-1", 1)), ("m2", tm("pi-1", 2))]) == [
            True, True]
        assert reg.device("pi-1").telemetry_count == 2  # type: ignore[union-attr]


def test_process_killed_inside_a_transaction_commits_nothing(tmp_path: Path) -> None:
    """A real crash: the process dies (os._exit) after writing half a batch, without commit."""
    path = tmp_path / "leader.db"
    script = textwrap.dedent(f"""
        import os
        from agent.core.clock import VirtualClock
        from agent.leader.registry import DeviceRegistry
        from agent.protocol import Telemetry
        reg = DeviceRegistry.open({str(path)!r}, clock=VirtualClock())
        reg.apply_telemetry("m0", Telemetry(device_id="pi-1", seq=0, name="t", ts_ms=0))
        real = DeviceRegistry._apply_one_telemetry
        n = 0
        def dying(self, msg_id, record, now):
            global n
            n += 1
            if n == 3:
                os._exit(0)
            return real(self, msg_id, record, now)
        DeviceRegistry._apply_one_telemetry = dying
        reg.apply_telemetry_batch([(f"m{{i}}", Telemetry(device_id="pi-1", seq=i, name="t",
                                    ts_ms=i)) for i in range(1, 5)])
        raise SystemExit("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    with DeviceRegistry.open(path, clock=VirtualClock()) as reg:
        assert reg.is_processed("m0")
        assert not reg.is_processed("m1") and not reg.is_processed("m2")
        assert reg.device("pi-1").telemetry_count == 1  # type: ignore[union-attr]
        assert reg.apply_telemetry_batch(
            [(f"m{i}", Telemetry(device_id="pi-1", seq=i, name="t", ts_ms=i)) for i in range(5)]
        ) == [False, True, True, True, True]
        assert reg.device("pi-1").telemetry_count == 5  # type: ignore[union-attr]


def test_presence_online_and_offline(registry: DeviceRegistry, clock: VirtualClock) -> None:
    registry.apply_heartbeat(hb("pi-1", 1))
    assert registry.apply_presence("pi-1", False, msg_id="p1")
    assert not registry.apply_presence("pi-1", True, msg_id="p1")  # redelivered: ignored
    dev = registry.device("pi-1")
    assert dev is not None and not dev.online and dev.offline_reason == "presence"
    assert registry.apply_presence("pi-1", True)
    dev = registry.device("pi-1")
    assert dev is not None and dev.online and dev.offline_reason is None
    assert registry.apply_presence("pi-9", True)  # presence before any heartbeat
    assert registry.device("pi-9").hb_seq is None  # type: ignore[union-attr]
    assert registry.counts() == (2, 0)


def test_a_late_will_of_an_earlier_session_leaves_the_device_online(registry: DeviceRegistry) -> None:
    assert registry.apply_presence("pi-1", True, session="aa01")
    assert registry.apply_presence("pi-1", True, session="bb02")  # the device started again
    assert not registry.apply_presence("pi-1", False, session="aa01")  # the first start's will, late
    dev = registry.device("pi-1")
    assert dev is not None and dev.online and dev.offline_reason is None
    assert registry.apply_presence("pi-1", False, session="bb02")  # the current session's will
    dev = registry.device("pi-1")
    assert dev is not None and not dev.online and dev.offline_reason == "presence"


def test_presence_without_a_session_always_applies(registry: DeviceRegistry) -> None:
    """An agent from before sessions sends a bare online/offline; a first will may precede any birth."""
    assert registry.apply_presence("pi-1", True, session="aa01")
    assert registry.apply_presence("pi-1", False)
    assert registry.apply_presence("pi-2", False, session="cc03")  # no birth seen yet
    assert registry.counts() == (0, 2)


def test_a_leader_db_of_the_previous_schema_gains_presence_sessions(tmp_path: Path, clock: VirtualClock) -> None:
    import sqlite3

    db = tmp_path / "old.db"
    reg = DeviceRegistry.open(db, clock=clock, heartbeat_deadline_s=30)
    reg.apply_heartbeat(hb("pi-1", 3))
    reg.close()
    with sqlite3.connect(db) as conn:  # back to schema 2: as a leader before sessions left it
        conn.execute("DROP INDEX devices_online_expires")
        conn.execute("ALTER TABLE devices DROP COLUMN expires_ms")
        conn.execute("ALTER TABLE devices DROP COLUMN interval_ms")
        conn.execute("CREATE INDEX devices_online_seen ON devices(last_seen_ms) WHERE online = 1")
        conn.execute("ALTER TABLE devices DROP COLUMN presence_session")
        conn.execute("ALTER TABLE devices DROP COLUMN outbox_pending")
        conn.execute("DROP TABLE fleet_online")
        conn.execute("DROP TABLE registry_fleet")
        conn.execute("ALTER TABLE devices DROP COLUMN served_by")
        conn.execute("DROP TABLE registry_leaders")
        conn.execute("ALTER TABLE devices DROP COLUMN slots")
        conn.execute("ALTER TABLE devices DROP COLUMN configs")
        conn.execute("ALTER TABLE devices DROP COLUMN apps")
        conn.execute("ALTER TABLE devices DROP COLUMN facts")
        for column in ("health_firmware", "health_s", "health_restarts"):
            conn.execute(f"ALTER TABLE devices DROP COLUMN {column}")
        conn.execute("UPDATE schema_versions SET version = 2 WHERE component = 'registry'")
    reg = DeviceRegistry.open(db, clock=clock, heartbeat_deadline_s=30)
    try:
        assert reg.apply_presence("pi-1", True, session="aa01")
        assert not reg.apply_presence("pi-1", False, session="ffff")
        assert reg.device("pi-1").hb_seq == 3  # type: ignore[union-attr]
        assert reg.apply_heartbeat(Heartbeat(device_id="pi-1", seq=4, uptime_s=1.0, outbox_pending=5))
    finally:
        reg.close()


async def test_heartbeat_deadline_marks_offline_on_virtual_clock(registry: DeviceRegistry,
                                                                 clock: VirtualClock) -> None:
    lost: list[list[str]] = []

    async def on_offline(ids: list[str]) -> None:
        lost.append(ids)

    registry.apply_heartbeats([hb("pi-1", 1), hb("pi-2", 1)])
    watcher = asyncio.create_task(registry.watch_deadlines(on_offline))
    try:
        await clock.advance(20)
        registry.apply_heartbeat(hb("pi-2", 2))  # pi-2 stays alive
        await clock.advance(9.9)
        assert registry.device("pi-1").online  # type: ignore[union-attr]
        await clock.advance(0.2)
        assert lost == [["pi-1"]]
        dev = registry.device("pi-1")
        assert dev is not None and not dev.online and dev.offline_reason == "deadline"
        assert registry.device("pi-2").online  # type: ignore[union-attr]
        await clock.advance(20)
        assert lost == [["pi-1"], ["pi-2"]]
        registry.apply_heartbeat(hb("pi-1", 2))  # back again
        assert registry.device("pi-1").online  # type: ignore[union-attr]
        assert registry.counts() == (1, 1)
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


async def test_expire_overdue_without_watcher(registry: DeviceRegistry,
                                             clock: VirtualClock) -> None:
    registry.apply_heartbeat(hb("pi-1", 1))
    assert registry.next_deadline_ms() == clock.now_ms() + 30_000
    assert registry.expire_overdue() == []
    await clock.advance(30.0)
    assert registry.expire_overdue() == ["pi-1"]
    assert registry.next_deadline_ms() is None


async def test_prune_processed_by_age(registry: DeviceRegistry, clock: VirtualClock) -> None:
    registry.apply_telemetry("old", tm("pi-1", 1))
    await clock.advance(3600.0)
    registry.apply_telemetry("new", tm("pi-1", 2))
    assert registry.prune_processed(older_than_s=600) == 1
    assert not registry.is_processed("old") and registry.is_processed("new")
    assert registry.processed_count() == 1


def test_sqlite_failures_are_store_errors(tmp_path: Path, clock: VirtualClock) -> None:
    with pytest.raises(StoreError):
        DeviceRegistry.open(tmp_path, clock=clock)  # a directory
    bad = tmp_path / "junk.db"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError):
        DeviceRegistry.open(bad, clock=clock)
    reg = DeviceRegistry.open(tmp_path / "ok.db", clock=clock)
    reg.close()
    with pytest.raises(StoreError):
        reg.apply_heartbeat(hb("pi-1", 1))


def test_batch_apply_of_100k_heartbeats(registry: DeviceRegistry) -> None:
    devices = 10_000
    total = 0
    for round_ in range(10):
        batch = [hb(f"pi-{d:05d}", round_ * 2 + (d % 2), f"v{round_}") for d in range(devices)]
        applied = registry.apply_heartbeats(batch)
        assert all(applied)
        total += len(batch)
    # a late batch of older heartbeats for every device changes nothing
    assert not any(registry.apply_heartbeats([hb(f"pi-{d:05d}", 1) for d in range(devices)]))
    assert total == 100_000
    assert registry.counts() == (devices, 0)
    assert registry.device("pi-00001").hb_seq == 19  # type: ignore[union-attr]
    assert registry.device("pi-00002").firmware_version == "v9"  # type: ignore[union-attr]


async def test_deadline_watch_survives_a_store_error_and_ends_on_close(
        registry: DeviceRegistry, clock: VirtualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    real = DeviceRegistry.expire_overdue
    failures = 0

    def flaky(self: DeviceRegistry) -> list[str]:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise StoreError("disk I/O error")
        return real(self)

    monkeypatch.setattr(DeviceRegistry, "expire_overdue", flaky)
    lost: list[str] = []
    registry.apply_heartbeat(hb("pi-1", 1))
    watcher = asyncio.create_task(registry.watch_deadlines(lambda ids: lost.extend(ids)))
    await clock.advance(29.0)
    assert lost == []  # not overdue yet (its first scan failed on PostgreSQL, which scans every few s)
    await clock.advance(2.5)
    assert failures == 1 and lost == ["pi-1"]  # the failed scan was tried again
    registry.close()
    await clock.advance(60)
    assert watcher.done() and watcher.exception() is None


# A heartbeat as the property test draws it: (seq, full, firmware, cpu or None, outbox depth or None).
_beats = st.lists(
    st.tuples(st.booleans(), st.sampled_from(["1.0.0", "1.1.0", "2.0.0"]),
              st.none() | st.floats(min_value=0, max_value=100), st.none() | st.integers(min_value=0, max_value=50)),
    min_size=1, max_size=12)


@settings(deadline=None, max_examples=60)
@given(drawn=_beats, order=st.randoms(use_true_random=False))
def test_short_heartbeats_leave_what_they_do_not_carry_in_any_arrival_order(
        tmp_path_factory: pytest.TempPathFactory, drawn: list[tuple[bool, str, float | None, int | None]],
        order: object) -> None:
    """Whatever order full and short heartbeats arrive in, the record is the newest full one's
    state with every newer short one's sample and outbox depth over it (an older beat changes
    nothing), and the first beat to arrive may be short only once a full one is known."""
    import random

    assert isinstance(order, random.Random)
    beats = []
    for seq, (full, version, cpu, pending) in enumerate(drawn, start=1):
        sample = None if cpu is None else SystemSample(cpu_percent=cpu)
        if full or seq == 1:  # a device's first heartbeat is full
            beats.append(Heartbeat(device_id="pi-1", seq=seq, uptime_s=float(seq), firmware_version=version,
                                   tags=(version,), sample=sample, outbox_pending=pending, wire=3, interval_s=300.0))
        else:
            beats.append(Heartbeat(device_id="pi-1", seq=seq, uptime_s=float(seq), sample=sample,
                                   outbox_pending=pending, wire=3, interval_s=300.0, full=False))
    arrival = [beats[0], *order.sample(beats[1:], len(beats) - 1)]
    path = tmp_path_factory.mktemp("reg") / "leader.db"
    with DeviceRegistry.open(path, clock=VirtualClock()) as reg:
        reg.apply_heartbeats(arrival)
        expected: dict[str, object] = {}
        newest = 0
        for beat in arrival:  # the model: a beat newer than every one applied is applied
            if beat.seq <= newest:
                continue
            newest = beat.seq
            if beat.full:
                expected = {"version": beat.firmware_version, "tags": beat.tags, "sample": beat.sample,
                            "pending": beat.outbox_pending}
            else:
                if beat.sample is not None:
                    expected["sample"] = beat.sample
                if beat.outbox_pending is not None:
                    expected["pending"] = beat.outbox_pending
        dev = reg.device("pi-1")
        assert dev is not None and dev.hb_seq == newest == len(beats)
        assert (dev.firmware_version, dev.tags, dev.sample) == (expected["version"], expected["tags"],
                                                               expected["sample"])
        (pending,) = reg._conn.execute("SELECT outbox_pending FROM devices WHERE device_id = 'pi-1'").fetchone()
        assert pending == expected["pending"]


async def test_marking_the_leader_alive_samples_the_devices_online_for_a_week(leader_store: Path | str,
                                                                              clock: VirtualClock) -> None:
    from agent.leader.registry import FLEET_HISTORY_S, LEADER_ALIVE_EVERY_S, RegistryReads

    reg = DeviceRegistry.open(leader_store, clock=clock, heartbeat_deadline_s=30)
    try:
        reg.apply_heartbeats([hb("a", 1), hb("b", 1)])
        reg.mark_alive()
        reg.mark_alive()  # within LEADER_ALIVE_EVERY_S: no second sample
        await clock.advance(LEADER_ALIVE_EVERY_S)
        reg.apply_presence("b", False, session="")
        reg.mark_alive()
        reads = RegistryReads(reg._conn)
        start = clock.now_ms() - int(LEADER_ALIVE_EVERY_S * 1000)
        assert [(d, o) for _, d, o in reads.online_history(0)] == [(2, 2), (2, 1)]
        assert reads.online_history(start)[0][0] == start
        await clock.advance(FLEET_HISTORY_S)
        reg.mark_alive()
        assert len(reads.online_history(0)) == 2  # the first sample is a week old: gone
    finally:
        reg.close()


async def test_the_fleets_configuration_compliance_is_counted_from_the_heartbeats(tmp_path: Path,
                                                                                   clock: VirtualClock) -> None:
    """`status` and /metrics count each configuration target's devices by what they hold (in
    sync, drifted, damaged, not applied: a reverted device holds its old version, in sync), and
    beside them those whose last attempt did not commit, from their newest full heartbeats."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
    from e2e.agent_support import leader
    from promparse import parse

    from agent.leader.readonly import open_leader_db
    from agent.leader.status import fleet_status, format_status
    from agent.protocol import ConfigState
    from agent.service.prom import render

    gw = await leader(clock, tmp_path)
    try:
        states = {"d1": ConfigState(version="1.1.0", state="committed"),
                  "d2": ConfigState(version="1.1.0", state="committed", drifted=("app.toml",)),
                  "d3": ConfigState(version="1.0.0", state="rolled_back"),
                  "d4": ConfigState(state="idle")}
        gw.registry.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, configs={"app": c})
                                      for d, c in states.items()] + [hb("d5", 1)])
        want = {"app": {"in_sync": 2, "pending": 0, "drifted": 1, "damaged": 0, "not_applied": 1,
                        "last_attempt_failed": 1}}
        assert gw.registry.config_compliance() == want
        with open_leader_db(gw.registry.path) as db:
            summary = fleet_status(db, clock.now_ms())
        assert summary.config == want
        assert ("config app: 2 in sync, 1 drifted, 1 not applied; the last attempt did not commit on 1 (they hold"
                " what they held)") in format_status(summary)
        families = parse(render(gw.collectors()["config"]()))  # type: ignore[arg-type]
        samples = dict((tuple(sorted(labels.items())), v) for labels, v in families["ea_config_devices"]["samples"])
        assert samples[(("compliance", "drifted"), ("target", "app"))] == 1.0
        assert samples[(("compliance", "in_sync"), ("target", "app"))] == 2.0
        assert families["ea_config_last_attempt_failed"]["samples"] == [({"target": "app"}, 1.0)]
        # a layer value set for d1 since its apply: the leader has more for it
        from config_rollout.layer_store import LayerStore

        with LayerStore.open(gw.registry.path) as layers:
            layers.set_value("app", "device", "d1", "app.toml", "port", 2, set_by="op", now_ms=clock.now_ms())
        with open_leader_db(gw.registry.path) as db:
            assert fleet_status(db, clock.now_ms()).config["app"] == {
                "in_sync": 1, "pending": 1, "drifted": 1, "damaged": 0, "not_applied": 1, "last_attempt_failed": 1}
        families = parse(render(gw.collectors()["config"]()))  # type: ignore[arg-type]
        samples = dict((tuple(sorted(labels.items())), v) for labels, v in families["ea_config_devices"]["samples"])
        assert samples[(("compliance", "pending"), ("target", "app"))] == 1.0
    finally:
        await gw.stop()


def test_a_fellow_leaders_presence_makes_no_device_and_a_leader_drops_its_own_row(
        leader_store: Path | str, clock: VirtualClock) -> None:
    """Several leaders hear each other's presence: a leader of the registry is never a device (a
    rollout to every device would offer it an image it never installs)."""
    with DeviceRegistry.open(leader_store, clock=clock) as gw1, DeviceRegistry.open(leader_store, clock=clock) as gw2:
        gw1.leader, gw2.leader = "gw1", "gw2"
        assert gw1.apply_presence("gw2", True)  # gw2 not marked yet: taken for a device, for now
        gw2.mark_alive()  # gw2 starts: marked before it connects, its row as a device gone
        assert gw1.device("gw2") is None
        assert not gw1.apply_presence("gw2", True) and not gw1.apply_presence("gw2", False)
        assert gw1.apply_presence("pi-1", True)
        assert [d.device_id for d in gw1.devices()] == ["pi-1"]


async def test_a_releases_healthy_hours_add_up_its_devices_counts_and_a_beat_without_one_keeps_it(
        registry: DeviceRegistry, clock: VirtualClock) -> None:
    from agent.leader.registry import RegistryReads

    def counted(firmware: str, seconds: float, restarts: int) -> DeviceHealth:
        return DeviceHealth(firmware=firmware, operating_s=seconds, unexpected_restarts=restarts)

    def short(device: str, seq: int, health: DeviceHealth | None = None) -> Heartbeat:
        return Heartbeat(device_id=device, seq=seq, uptime_s=float(seq), full=False, wire=3, interval_s=300.0,
                         health=health)

    registry.apply_heartbeats([hb("pi-1", 1, health=counted("1.0.0", 3600, 0)),
                               hb("pi-2", 1, health=counted("1.0.0", 3600, 0)),
                               hb("pi-3", 1, "1.1.0", health=counted("1.1.0", 1800, 0)),
                               hb("pi-4", 1, "1.1.0"),  # (a device that counts nothing)
                               hb("pi-5", 1, "1.1.0", health=counted("1.0.0", 3600, 0)),  # another release's
                               hb("pi-6", 1, "1.1.0")])
    await clock.advance(3 * 3600)  # three hours on: the registry has known every one of them that long
    registry.apply_heartbeats([hb("pi-1", 2, health=counted("1.0.0", 7200, 1)), short("pi-1", 3),
                               short("pi-2", 2, counted("1.0.0", 7200, 2)),
                               # a hostile device: a century on 1.1.0 and a billion crashes in it
                               short("pi-6", 2, counted("1.1.0", 100 * 365 * 86_400, 1_000_000_000))])
    registry.apply_heartbeat(hb("pi-3", 2, ""))  # started again, its firmware not read yet: no count
    health = {r.firmware: r for r in registry.release_health()}
    assert set(health) == {"1.0.0", "1.1.0"}
    one, other = health["1.0.0"], health["1.1.0"]
    assert (one.devices, one.hours, one.unexpected_restarts, one.healthy_ratio) == (2, 4.0, 3, 0.25)
    # pi-6 is believed for the hours the registry has known it (3, and 1 in flight), its restarts
    # spoil those hours and no more: it weighs what an honest device whose every hour crashed weighs
    assert (other.devices, other.hours, other.unexpected_restarts) == (2, 4.5, 1_000_000_000)
    assert other.healthy_ratio == round(0.5 / 4.5, 6)
    # `status` reads the same
    assert RegistryReads(registry._conn).release_health(clock.now_ms()) == registry.release_health()
