"""`edge-agent outbox stats` and `edge-agent dlq ...` on real files, missing files and junk."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from store_support import OpenStore, assert_conserved, make_msg

from agent.core.clock import SystemClock
from agent.outbox import commands
from agent.outbox.store import OutboxStore


async def _fill(store: OutboxStore) -> list[int]:
    """Three delivered-later rows of two classes, and three dead letters."""
    for i in range(3):
        await store.enqueue(make_msg(kind="telemetry", payload=b"t" * 10, receiver=f"r{i}"))
    dead = []
    for _ in range(3):
        rid = (await store.enqueue(make_msg(kind="command", payload=b"\x00\x01poison"))).row_id
        assert rid is not None
        dead.append(rid)
    await store.take_ready(limit=10, kinds=["command"])
    for i, rid in enumerate(dead):
        await store.dead_letter(rid, error=f"refused {i}")
    return dead


async def test_stats_on_a_real_file(
    open_store: OpenStore, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = await open_store()
    await _fill(store)
    await store.close()
    assert commands.outbox_stats(str(db_path), False) == 0
    out = capsys.readouterr().out
    assert "pending 3" in out and "dead 3" in out
    assert "telemetry" in out and "command" in out
    assert "conservation holds" in out
    assert commands.outbox_stats(str(db_path), True) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pending"] == 3 and data["dead"] == 3 and data["conservation_ok"] is True
    assert data["by_class"]["command"] == {
        "pending": 0, "pending_bytes": 0, "dead": 3, "enqueued": 3, "delivered": 0, "dead_lettered": 3,
        "expired": 0, "dropped": 0, "overwritten": 0, "replayed": 0, "conservation_ok": True}
    assert all(c["conservation_ok"] for c in data["by_class"].values())
    assert out.count("holds") >= 1
    assert data["counters"]["dead_lettered"] == 3


async def test_stats_while_the_agent_has_the_file_open(
    store: OutboxStore, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await store.enqueue(make_msg())
    assert commands.outbox_stats(str(db_path), True) == 0
    assert json.loads(capsys.readouterr().out)["pending"] == 1


async def test_dlq_list_show_replay_purge(
    open_store: OpenStore, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = await open_store()
    dead = await _fill(store)
    await store.close()
    db = str(db_path)

    assert commands.dlq_list(db, 2, False) == 0
    out = capsys.readouterr().out
    assert str(dead[0]) in out and "refused 0" in out and "2 of 3 shown" in out
    assert commands.dlq_list(db, 10, True) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [d["id"] for d in listed["dead"]] == dead and listed["total"] == 3

    assert commands.dlq_show(db, dead[1]) == 0
    out = capsys.readouterr().out
    assert "refused 1" in out and "00 01 70 6f" in out
    assert commands.dlq_show(db, 99_999) == 1
    assert "no dead letter with id 99999" in capsys.readouterr().err

    assert commands.dlq_replay(db, [dead[0], 424242]) == 1
    captured = capsys.readouterr()
    assert "replayed 1 dead letter" in captured.out and "424242" in captured.err
    assert commands.dlq_purge(db, [dead[1]]) == 0
    assert "purged 1 dead letter" in capsys.readouterr().out
    assert commands.dlq_replay(db, None) == 0
    assert "replayed 1 dead letter" in capsys.readouterr().out
    assert commands.dlq_purge(db, None) == 0
    assert "purged 0 dead letters" in capsys.readouterr().out

    store = await open_store(clock=SystemClock())  # the CLI stamps send_at with system time
    stats = await assert_conserved(store)
    assert (stats.dead, stats.pending, stats.replayed) == (0, 5, 2)
    rows = await store.take_ready(limit=10, kinds=["command"])
    assert sorted(r.row_id for r in rows) == [dead[0], dead[2]]
    assert all(r.attempts == 0 for r in rows)


async def test_replay_from_the_cli_while_the_agent_runs(
    open_store: OpenStore, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = await open_store(clock=SystemClock())  # the CLI stamps send_at with system time
    rid = (await store.enqueue(make_msg())).row_id
    await store.take_ready(limit=1)
    await store.dead_letter(rid, error="bad")  # type: ignore[arg-type]
    assert commands.dlq_replay(str(db_path), None) == 0
    capsys.readouterr()
    stats = await assert_conserved(store)
    assert (stats.dead, stats.pending, stats.replayed) == (0, 1, 1)
    [row] = await store.take_ready(limit=1)
    assert row.row_id == rid
    await store.ack([rid])  # type: ignore[list-item]
    await assert_conserved(store)


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], path: Path, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"edge-agent: {path}: not an outbox database (")
    return lines[0]


@pytest.mark.parametrize(
    "call",
    [
        lambda db: commands.outbox_stats(db, False),
        lambda db: commands.dlq_list(db, 10, False),
        lambda db: commands.dlq_show(db, 1),
        lambda db: commands.dlq_replay(db, None),
        lambda db: commands.dlq_purge(db, [1]),
    ],
    ids=["stats", "list", "show", "replay", "purge"],
)
def test_missing_and_garbage_files_exit_2_with_one_line(
    call, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.db"
    line = _one_line_exit_2(capsys, missing, call(str(missing)))
    assert "no such file" in line
    assert list(tmp_path.iterdir()) == []  # nothing created

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"\x89PNG not sqlite at all" * 200)
    line = _one_line_exit_2(capsys, garbage, call(str(garbage)))
    assert "not a database" in line
    assert garbage.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.db"]  # not moved aside

    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY)")
    conn.commit()
    conn.close()
    _one_line_exit_2(capsys, other, call(str(other)))
