"""The stores' PostgreSQL backend on a real server (Debian's PostgreSQL, a cluster of the test's
own): statements written once for both databases, versions, faults and several leaders at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from postgres import PostgresCluster

from agent.core.clock import VirtualClock
from agent.core.errors import StoreError, StoreUnavailable
from agent.core.postgres import placeholders
from agent.core.sql import PostgresUrl, redacted
from agent.leader.messages import MessageLog
from agent.leader.registry import DeviceRegistry
from agent.protocol import AppMessage, Heartbeat, Telemetry


def test_placeholders_become_psycopgs_outside_literals_and_percent_is_doubled() -> None:
    assert placeholders("SELECT ? WHERE a = '?' AND b LIKE 'x%' AND c = ?") == \
        "SELECT %s WHERE a = '?' AND b LIKE 'x%%' AND c = %s"


def test_a_password_never_shows_in_what_is_said_of_a_url() -> None:
    url = "postgresql://ea:s3cret@db.example:5432/fleet?sslmode=verify-full"
    assert "s3cret" not in redacted(url) and "ea:***@db.example:5432" in redacted(url)
    assert "s3cret" not in str(PostgresUrl("postgresql://ea@h/db", password="s3cret"))


def test_an_unreachable_server_is_one_line_naming_the_url_without_its_password(tmp_path: Path) -> None:
    from mosquitto import free_port

    url = f"postgresql://ea:hunter2@127.0.0.1:{free_port()}/ea?connect_timeout=2"
    with pytest.raises(StoreUnavailable) as caught:
        DeviceRegistry.open(url, clock=VirtualClock())
    text = str(caught.value)
    assert "hunter2" not in text and f"{redacted(url)}" in text and "\n" not in text


def test_a_database_of_a_newer_program_is_refused_in_one_line(pg_url: str, postgres_shared: PostgresCluster) -> None:
    DeviceRegistry.open(pg_url, clock=VirtualClock()).close()
    schema = pg_url.rsplit("search_path%3D", 1)[1]
    postgres_shared.psql(f"UPDATE {schema}.schema_versions SET version = 99 WHERE component = 'registry'")
    with pytest.raises(StoreError, match=r"registry schema version 99 is newer than this program \(1\)"):
        DeviceRegistry.open(pg_url, clock=VirtualClock())


def test_a_leader_of_another_fleet_refuses_the_database(pg_url: str) -> None:
    with DeviceRegistry.open(pg_url, clock=VirtualClock()) as reg:
        reg.claim_fleet("plant-a")
        reg.claim_fleet("plant-a")  # the same fleet again: fine
    with DeviceRegistry.open(pg_url, clock=VirtualClock()) as reg, \
            pytest.raises(StoreError, match="holds the devices of fleet plant-a, not of fleet plant-b"):
        reg.claim_fleet("plant-b")


def test_a_server_lost_and_back_loses_nothing_committed(postgres: PostgresCluster) -> None:
    clock = VirtualClock()
    reg = DeviceRegistry.open(postgres.url(), clock=clock)
    try:
        assert reg.apply_telemetry("m1", Telemetry(device_id="pi-1", seq=1, name="t", ts_ms=1, value=1.0))
        postgres.stop("immediate")
        with pytest.raises(StoreUnavailable, match="127.0.0.1"):
            reg.apply_telemetry("m2", Telemetry(device_id="pi-1", seq=2, name="t", ts_ms=2, value=2.0))
        with pytest.raises(StoreUnavailable):  # still down: the next call says so too, it does not hang
            reg.apply_heartbeats([Heartbeat(device_id="pi-1", seq=1, uptime_s=1.0)])
        postgres.start()
        # back: the next call connects again; what was committed is there, the refused one was not
        assert reg.apply_telemetry("m1", Telemetry(device_id="pi-1", seq=1, name="t", ts_ms=1, value=1.0)) is False
        assert reg.apply_telemetry("m2", Telemetry(device_id="pi-1", seq=2, name="t", ts_ms=2, value=2.0))
        assert reg.device("pi-1").telemetry_count == 2  # type: ignore[union-attr]
    finally:
        reg.close()


def test_two_leaders_applying_one_fleet_at_once_keep_newest_seq_and_each_message_once(pg_url: str) -> None:
    """Two registries (two leaders) on one database, each in its own thread, take interleaved
    heartbeats of the same devices (a shared subscription spreads a device's messages over the
    group) and both take every telemetry and application message (a redelivery after a leader
    died mid-batch): the newest seq wins per device, each message id is applied once."""
    devices = [f"pi-{i:03d}" for i in range(40)]
    leaders = [DeviceRegistry.open(pg_url, clock=VirtualClock()) for _ in range(2)]
    logs = [MessageLog.open(pg_url, clock=VirtualClock()) for _ in range(2)]
    applied = [[0, 0], [0, 0]]
    failures: list[BaseException] = []

    def run(n: int) -> None:
        reg, log = leaders[n], logs[n]
        try:
            for seq in range(1, 31):
                batch = [Heartbeat(device_id=d, seq=seq * 2 + n, uptime_s=float(seq)) for d in reversed(devices)] \
                    if n else [Heartbeat(device_id=d, seq=seq * 2 + n, uptime_s=float(seq)) for d in devices]
                reg.apply_heartbeats(batch)
                records = [(f"t-{d}-{seq}", Telemetry(device_id=d, seq=seq, name="temp", ts_ms=seq, value=float(seq)))
                           for d in (devices if n == 0 else reversed(devices))]
                applied[n][0] += sum(1 for new in reg.apply_telemetry_batch(records) if new is True)
                messages = [(f"a-{d}-{seq}", AppMessage(device_id=d, cls="state", seq=seq, ts_ms=seq, key="k",
                                                        overwrite=True, payload=b"%d" % seq))
                            for d in (devices if n == 0 else reversed(devices))]
                applied[n][1] += sum(log.apply_batch(messages))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert failures == []
        for d in devices:
            record = leaders[0].device(d)
            assert record is not None and record.hb_seq == 61  # the newest of both leaders' seqs
            assert record.telemetry_count == 30  # each record once, whichever leader had it
        assert applied[0][0] + applied[1][0] == 30 * len(devices)
        assert applied[0][1] + applied[1][1] <= 30 * len(devices)  # a stale OVERWRITE value is not stored
        from agent.leader.messages import read_messages

        total, rows = read_messages(pg_url, cls="state", limit=1000)
        assert total == len(devices) and {r.payload for r in rows} == {b"30"}  # the newest value of each key
    finally:
        for store in (*leaders, *logs):
            store.close()
