"""What `edge-agent outbox stats` and `edge-agent dlq list|show|replay|purge` do.

Each function prints human text (or JSON) to stdout and returns the exit status. They never
create a database and never move a file aside: inspection opens the file read-only; replay and
purge open an existing, valid outbox read-write. A missing, non-SQLite or damaged file prints
one line to stderr, `edge-agent: <path>: not an outbox database (<why>)`, and returns 2.

While an agent runs on the same file, replay and purge take the write lock for a moment
(busy_timeout); the agent notices the change (PRAGMA data_version) at its next operation.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent.core.clock import SystemClock
from agent.core.durations import format_age
from agent.core.errors import StoreError
from agent.outbox.engine import Engine
from agent.outbox.schema import (
    APPLICATION_ID,
    CLASS_FIELDS,
    COUNTER_NAMES,
    SCHEMA_VERSION,
    configure,
    describe,
    is_corruption,
    migrate,
)
from agent.outbox.types import ClassStats

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NOT_OUTBOX = 2

_BUSY_TIMEOUT_MS = 5_000


class _NotOutbox(Exception):
    pass


def _err(db: str, text: str) -> None:
    print(f"edge-agent: {db}: {text}", file=sys.stderr)


def _connect(db: str, *, write: bool) -> sqlite3.Connection:
    """Open an existing outbox file, never creating one. Raises _NotOutbox."""
    path = Path(db)
    if not path.exists():
        raise _NotOutbox("no such file")
    if not path.is_file():
        raise _NotOutbox("not a regular file")
    uri = f"{path.resolve().as_uri()}?mode={'rw' if write else 'ro'}"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        raise _NotOutbox(describe(exc)) from exc
    try:
        conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if app_id != APPLICATION_ID or version < 1:
            raise _NotOutbox("a SQLite file of another kind")
        if version > SCHEMA_VERSION:
            raise _NotOutbox(f"schema version {version} is newer than this program")
        conn.execute("SELECT 1 FROM outbox LIMIT 1").fetchall()
        if write:
            configure(conn, synchronous="FULL", busy_timeout_ms=_BUSY_TIMEOUT_MS)
            if version < SCHEMA_VERSION:  # an older outbox: bring it up to date (kept whole)
                migrate(conn)
    except sqlite3.Error as exc:
        conn.close()
        if is_corruption(exc) or "no such table" in str(exc):
            raise _NotOutbox(describe(exc)) from exc
        raise
    except BaseException:
        conn.close()
        raise
    return conn


def _run(db: str, write: bool, body: Callable[[sqlite3.Connection], int]) -> int:
    try:
        conn = _connect(db, write=write)
    except _NotOutbox as exc:
        _err(db, f"not an outbox database ({exc})")
        return EXIT_NOT_OUTBOX
    except sqlite3.Error as exc:
        _err(db, f"cannot open the outbox: {describe(exc)}")
        return EXIT_FAILED
    try:
        return body(conn)
    except sqlite3.Error as exc:
        if is_corruption(exc):
            _err(db, f"not an outbox database ({describe(exc)})")
            return EXIT_NOT_OUTBOX
        _err(db, f"outbox database error: {describe(exc)}")
        return EXIT_FAILED
    except StoreError as exc:
        _err(db, f"outbox database error: {exc}")
        return EXIT_FAILED
    finally:
        conn.close()


# -- stats -------------------------------------------------------------------------------------
_FLOWS = CLASS_FIELDS[3:]  # what entered and left a class (the depths are counted from the rows)


def _class_flows(conn: sqlite3.Connection) -> dict[str, dict[str, int]]:
    """Per-class flow counters from the tally (a version 1 file, read before it migrates, has
    none)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'outbox_tally'").fetchone() is None:
        return {}
    flows: dict[str, dict[str, int]] = {}
    for name, value in conn.execute("SELECT name, value FROM outbox_tally WHERE instr(name, ':') > 0"):
        field, _, kind = str(name).partition(":")
        if field in _FLOWS:
            flows.setdefault(kind, dict.fromkeys(_FLOWS, 0))[field] = int(value)
    return flows


def _stats(conn: sqlite3.Connection, now_ms: int) -> dict[str, Any]:
    counters = dict.fromkeys(COUNTER_NAMES, 0)
    counters.update(conn.execute("SELECT name, value FROM outbox_counters").fetchall())
    flows = _class_flows(conn)
    by_class: dict[str, dict[str, Any]] = {}
    for kind in flows:
        by_class[kind] = {"pending": 0, "pending_bytes": 0, "dead": 0, **flows[kind]}
    for kind, status, n, nbytes in conn.execute(
        "SELECT kind, status, count(*), coalesce(sum(size), 0) FROM outbox GROUP BY kind, status"
    ):
        entry = by_class.setdefault(kind, {"pending": 0, "pending_bytes": 0, "dead": 0,
                                           **dict.fromkeys(_FLOWS, 0)})
        if status == "pending":
            entry["pending"] = n
            entry["pending_bytes"] = nbytes
        else:
            entry["dead"] = n
    by_class = {kind: e for kind, e in by_class.items() if any(e.values())}
    if flows:
        for entry in by_class.values():
            entry["conservation_ok"] = ClassStats(**entry).conservation_ok  # the store's own law
    pending = sum(c["pending"] for c in by_class.values())
    oldest = conn.execute(
        "SELECT min(created_at) FROM outbox WHERE status = 'pending'"
    ).fetchone()[0]
    accounted = (
        counters["delivered"] + counters["dead_lettered"] + counters["expired"]
        + counters["dropped"] + counters["overwritten"] + pending - counters["replayed"]
    )
    return {
        "pending": pending,
        "pending_bytes": sum(c["pending_bytes"] for c in by_class.values()),
        "dead": sum(c["dead"] for c in by_class.values()),
        "oldest_pending_age_ms": None if oldest is None else max(0, now_ms - oldest),
        "by_class": dict(sorted(by_class.items())),
        "counters": counters,
        "conservation_ok": counters["enqueued"] == accounted,
    }


def _age(ms: int | None) -> str:
    return "-" if ms is None else format_age(ms / 1000)


def outbox_stats(db: str, as_json: bool) -> int:
    """Depth by status and class, age of the oldest pending message, counters, conservation."""

    def body(conn: sqlite3.Connection) -> int:
        st = _stats(conn, SystemClock().now_ms())
        if as_json:
            print(json.dumps({"db": db, **st}, sort_keys=True))
            return EXIT_OK
        c = st["counters"]
        print(f"outbox {db}")
        print(
            f"  pending {st['pending']} ({st['pending_bytes']} bytes, in flight included)"
            f"   dead {st['dead']}   oldest pending {_age(st['oldest_pending_age_ms'])}"
        )
        if st["by_class"]:
            flows = ("enqueued", "delivered", "dead_lettered", "expired", "dropped", "overwritten", "replayed")
            short = ("enqueued", "delivered", "dead-l.", "expired", "dropped", "overwr.", "replayed")
            print(f"  {'class':<20} {'pending':>8} {'bytes':>10} {'dead':>6} "
                  + " ".join(f"{h:>9}" for h in short) + "  law")
            for kind, e in st["by_class"].items():
                law = {True: "holds", False: "VIOLATED", None: "-"}[e.get("conservation_ok")]
                print(f"  {kind:<20} {e['pending']:>8} {e['pending_bytes']:>10} {e['dead']:>6} "
                      + " ".join(f"{e[f]:>9}" for f in flows) + f"  {law}")
        print("  counters: " + "  ".join(f"{k} {c[k]}" for k in COUNTER_NAMES))
        verdict = "holds" if st["conservation_ok"] else "VIOLATED"
        print(
            f"  conservation {verdict}: enqueued {c['enqueued']} = delivered {c['delivered']}"
            f" + dead_lettered {c['dead_lettered']} + expired {c['expired']}"
            f" + dropped {c['dropped']} + overwritten {c['overwritten']}"
            f" + pending {st['pending']} - replayed {c['replayed']}"
        )
        return EXIT_OK

    return _run(db, False, body)


# -- dead letters ------------------------------------------------------------------------------
_DEAD_COLUMNS = (
    "id, msg_id, owner, receiver, kind, key, conflict, seq, created_at, attempts, last_error,"
    " size, status, payload, send_at, expires_at"
)


def _dead_dict(r: Sequence[Any], *, payload: bool) -> dict[str, Any]:
    out = {
        "id": r[0], "msg_id": r[1], "owner": r[2], "receiver": r[3], "kind": r[4],
        "key": r[5], "conflict": r[6], "seq": r[7], "created_at_ms": r[8], "attempts": r[9],
        "last_error": r[10], "size": r[11], "status": r[12],
    }
    if payload:
        out["payload_hex"] = bytes(r[13]).hex()
        out["send_at_ms"] = r[14]
        out["expires_at_ms"] = r[15]
    return out


def _dead_letters(conn: sqlite3.Connection, limit: int) -> tuple[int, list[Any]]:
    rows = conn.execute(
        f"SELECT {_DEAD_COLUMNS} FROM outbox WHERE status = 'dead' ORDER BY id LIMIT ?",
        (max(0, limit),),
    ).fetchall()
    total = conn.execute("SELECT count(*) FROM outbox WHERE status = 'dead'").fetchone()[0]
    return int(total), rows


def read_dead_letters(db: str | Path, *, limit: int) -> tuple[int, list[dict[str, Any]]]:
    """How many dead letters the outbox at `db` holds, and the oldest `limit` of them as `dlq
    list --json` shows them; read-only. `StoreError` if it is not an outbox or cannot be read."""
    try:
        conn = _connect(str(db), write=False)
    except _NotOutbox as exc:
        raise StoreError(f"{db}: not an outbox database ({exc})") from None
    except sqlite3.Error as exc:
        raise StoreError(f"{db}: cannot open the outbox: {describe(exc)}") from None
    try:
        total, rows = _dead_letters(conn, limit)
    except sqlite3.Error as exc:
        raise StoreError(f"{db}: outbox database error: {describe(exc)}") from None
    finally:
        conn.close()
    return total, [_dead_dict(r, payload=False) for r in rows]


def dlq_list(db: str, limit: int, as_json: bool) -> int:
    """The oldest `limit` dead letters."""

    def body(conn: sqlite3.Connection) -> int:
        total, rows = _dead_letters(conn, limit)
        if as_json:
            print(json.dumps({"db": db, "total": total,
                              "dead": [_dead_dict(r, payload=False) for r in rows]}))
            return EXIT_OK
        if not rows:
            print(f"no dead letters in {db}")
            return EXIT_OK
        print(f"{'id':>8} {'kind':<16} {'owner':<16} {'receiver':<16} {'tries':>5}  last error")
        for r in rows:
            error = (r[10] or "").replace("\n", " ")
            print(f"{r[0]:>8} {r[4]:<16} {r[2]:<16} {r[3]:<16} {r[9]:>5}  {error[:60]}")
        if total > len(rows):
            print(f"({len(rows)} of {total} shown; use --limit)")
        return EXIT_OK

    return _run(db, False, body)


def _preview(payload: bytes) -> str:
    try:
        text = payload.decode("utf-8")
        if text.isprintable():
            return repr(text[:200]) + ("..." if len(text) > 200 else "")
    except UnicodeDecodeError:
        pass
    return payload[:64].hex(" ") + (" ..." if len(payload) > 64 else "")


def dlq_show(db: str, row_id: int) -> int:
    """Every field of one dead letter, with a preview of its payload."""

    def body(conn: sqlite3.Connection) -> int:
        r = conn.execute(
            f"SELECT {_DEAD_COLUMNS} FROM outbox WHERE id = ? AND status = 'dead'", (row_id,)
        ).fetchone()
        if r is None:
            _err(db, f"no dead letter with id {row_id}")
            return EXIT_FAILED
        for name, value in _dead_dict(r, payload=False).items():
            print(f"{name:>14}: {value}")
        print(f"{'send_at_ms':>14}: {r[14]}")
        print(f"{'expires_at_ms':>14}: {r[15]}")
        print(f"{'payload':>14}: {_preview(bytes(r[13]))}")
        return EXIT_OK

    return _run(db, False, body)


def _change(db: str, row_ids: list[int] | None, verb: str,
            act: Callable[[Engine, list[int] | None, int], int]) -> int:
    def body(conn: sqlite3.Connection) -> int:
        missing: list[int] = []
        if row_ids is not None:
            for rid in row_ids:
                found = conn.execute(
                    "SELECT 1 FROM outbox WHERE id = ? AND status = 'dead'", (rid,)
                ).fetchone()
                if found is None:
                    missing.append(rid)
        engine = Engine(conn)
        engine.books.begin()
        try:
            n = act(engine, row_ids, SystemClock().now_ms())
            engine.books.commit()
        except BaseException:
            engine.books.rollback()
            raise
        print(f"{verb} {n} dead letter{'s' if n != 1 else ''}")
        if missing:
            _err(db, "no dead letter with id " + ", ".join(str(m) for m in missing))
            return EXIT_FAILED
        return EXIT_OK

    return _run(db, True, body)


def dlq_replay(db: str, row_ids: list[int] | None) -> int:
    """Send dead letters again (attempts reset, due now); all of them when `row_ids` is None."""
    return _change(db, row_ids, "replayed", lambda e, ids, now: e.settle.replay(ids, now))


def dlq_purge(db: str, row_ids: list[int] | None) -> int:
    """Delete dead letters; all of them when `row_ids` is None."""
    return _change(db, row_ids, "purged", lambda e, ids, now: e.settle.purge(ids))


__all__ = ["dlq_list", "dlq_purge", "dlq_replay", "dlq_show", "outbox_stats", "read_dead_letters"]
