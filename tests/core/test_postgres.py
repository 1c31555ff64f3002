"""The stores' PostgreSQL backend on a real server (Debian's PostgreSQL, a cluster of the test's
own): statements written once for both databases, versions, faults and several leaders at once."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from postgres import PostgresCluster

from agent.core.clock import VirtualClock
from agent.core.errors import StoreError, StoreUnavailable
from agent.core.postgres import placeholders
from agent.core.sql import ServerUrl, redacted
from agent.leader.messages import MessageLog
from agent.leader.registry import DeviceRegistry
from agent.protocol import AppMessage, Heartbeat, Telemetry


def test_placeholders_become_psycopgs_outside_literals_and_percent_is_doubled() -> None:
    assert placeholders("SELECT ? WHERE a = '?' AND b LIKE 'x%' AND c = ?") == \
        "SELECT %s WHERE a = '?' AND b LIKE 'x%%' AND c = %s"


def test_a_password_never_shows_in_what_is_said_of_a_url() -> None:
    url = "postgresql://ea:s3cret@db.example:5432/fleet?sslmode=verify-full"
    assert "s3cret" not in redacted(url) and "ea:***@db.example:5432" in redacted(url)
    assert "s3cret" not in str(ServerUrl("postgresql://ea@h/db", password="s3cret"))


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
    newest = len(DeviceRegistry.SERVER_MIGRATIONS["postgresql"])  # the scripts this program has
    with pytest.raises(StoreError, match=rf"registry schema version 99 is newer than this program \({newest}\)"):
        DeviceRegistry.open(pg_url, clock=VirtualClock())


def test_a_leader_of_another_fleet_refuses_the_database(pg_url: str) -> None:
    with DeviceRegistry.open(pg_url, clock=VirtualClock()) as reg:
        reg.claim_fleet("plant-a")
        reg.claim_fleet("plant-a")  # the same fleet again: fine
    with DeviceRegistry.open(pg_url, clock=VirtualClock()) as reg, \
            pytest.raises(StoreError, match="holds the devices of fleet plant-a, not of fleet plant-b"):
        reg.claim_fleet("plant-b")


def test_a_server_lost_and_back_loses_nothing_committed(postgres: PostgresCluster,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.core.postgres

    monkeypatch.setattr(agent.core.postgres, "RECONNECT_PAUSE_S", 0.0)  # see the test after this one
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


def test_a_server_that_refused_is_not_dialled_again_at_once(postgres: PostgresCluster) -> None:
    """After a failed connect, calls fail at once for a moment instead of each dialling (a
    server that does not answer would hold the leader's loop for a connect timeout a call)."""
    reg = DeviceRegistry.open(postgres.url(), clock=VirtualClock())
    try:
        postgres.stop("immediate")
        with pytest.raises(StoreUnavailable):
            reg.device("pi-1")  # the connection lost
        with pytest.raises(StoreUnavailable, match="Connection refused$"):
            reg.device("pi-1")  # dialled: refused
        postgres.start()
        with pytest.raises(StoreUnavailable, match=r"\(trying again shortly\)"):
            reg.device("pi-1")  # not dialled again yet, though the server is back
    finally:
        reg.close()


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 9), st.booleans(),
                                         st.sampled_from(["", "boot-1", "boot-2"])), max_size=6), max_size=6))
def test_heartbeat_batches_apply_alike_on_both_databases(pg_url: str, tmp_path: Path,
                                                         steps: list[list[tuple[str, int, bool, str]]]) -> None:
    """PostgreSQL applies a batch in one statement for full and one for short heartbeats: the
    same batches give the same answers and the same rows as SQLite's one statement a heartbeat."""
    run = uuid.uuid4().hex[:8]  # the examples share the schema: devices of their own
    sqlite = DeviceRegistry.open(tmp_path / f"{run}.db", clock=VirtualClock())
    pg = DeviceRegistry.open(pg_url, clock=VirtualClock())
    try:
        for batch in steps:
            beats = [Heartbeat(device_id=f"{run}-{d}", seq=seq, uptime_s=float(seq), full=full, boot=boot,
                               firmware_version=f"v{seq}" if full else "",
                               outbox_pending=seq if seq % 2 else None) for d, seq, full, boot in batch]
            assert pg.apply_heartbeats(beats) == sqlite.apply_heartbeats(beats)
        for d in "abc":
            mine, theirs = pg.device(f"{run}-{d}"), sqlite.device(f"{run}-{d}")
            assert (mine is None) == (theirs is None)
            if mine is not None and theirs is not None:
                assert (mine.hb_seq, mine.firmware_version, mine.uptime_s, mine.online) == \
                    (theirs.hb_seq, theirs.firmware_version, theirs.uptime_s, theirs.online)
    finally:
        sqlite.close()
        pg.close()


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.one_of(st.none(), st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                                                         blacklist_characters="\x00"))),
                      min_size=1, max_size=8),
       blobs=st.lists(st.one_of(st.none(), st.binary(max_size=64)), min_size=1, max_size=8),
       numbers=st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), min_size=1, max_size=8))
@example(texts=['a"b', "c\\d", "{x,y}", "NULL", "", " sp ", "é🙂"], blobs=[b'\x00\\"{,}', b"", None],
         numbers=[-(2**63), 0, None, 2**63 - 1])
def test_arrays_of_any_text_bytes_and_integers_reach_the_server_unchanged(
        pg_url: str, texts: list[str | None], blobs: list[bytes | None], numbers: list[int | None]) -> None:
    """The heartbeat batch's arrays are literals this module writes itself (quotes, backslashes,
    braces, commas, NULL-looking text, any bytes): the server reads back exactly what was given."""
    from agent.core.postgres import connect

    conn = connect(ServerUrl(pg_url))
    shown = {"TEXT": "encode(convert_to(x, 'UTF8'), 'hex')", "BYTEA": "encode(x, 'hex')", "BIGINT": "x::text"}
    expected = {"TEXT": lambda v: v.encode().hex(), "BYTEA": lambda v: v.hex(), "BIGINT": str}
    try:
        for kind, values in (("TEXT", texts), ("BYTEA", blobs), ("BIGINT", numbers)):
            echoed = conn.column_of_arrays(
                f"echo_{kind.lower()}", f"SELECT COALESCE({shown[kind]}, 'NULL') FROM unnest(CAST(? AS {kind}[]))"
                " WITH ORDINALITY AS u(x, n) ORDER BY n", [values])
            assert echoed == ["NULL" if v is None else expected[kind](v) for v in values]
    finally:
        conn.close()


async def test_a_heartbeat_of_a_known_device_writes_no_index_entry(pg_url: str) -> None:
    """No index covers a column a heartbeat changes (`expires_ms`, `hb_seq`, ...): each update is
    HOT, the new row version on its page with no index entry, which is most of what a heartbeat
    costs the server (scripts/bench_leaders.py)."""
    clock = VirtualClock()
    with DeviceRegistry.open(pg_url, clock=clock) as reg:
        for seq in (1, 2, 3):
            reg.apply_heartbeats([Heartbeat(device_id=f"pi-{n}", seq=10 * seq, uptime_s=1.0,
                                            firmware_version="1.0.0") for n in range(20)])
            await clock.advance(1.0)  # each beat moves the device's deadline
            reg.apply_heartbeats([Heartbeat(device_id=f"pi-{n}", seq=10 * seq + 5, uptime_s=2.0, full=False)
                                  for n in range(20)])
            await clock.advance(1.0)
        reg._conn.execute("SELECT pg_stat_force_next_flush()")
        updated, hot = reg._conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = to_regclass('devices')").fetchone()
    assert updated == 100 and hot == updated
