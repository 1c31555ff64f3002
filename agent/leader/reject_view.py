"""The messages the leader refused, read from its database for `edge-agent rejects`: counts by
sender and reason, the newest rows, and one row with the first bytes of its payload."""

from __future__ import annotations

import string

import msgspec

from agent.leader.readonly import LeaderDb
from agent.leader.rejects import Reject


class RejectCount(msgspec.Struct, kw_only=True, frozen=True):
    sender: str | None
    reason: str
    count: int
    last_ms: int


RejectRow = Reject  # one refused message, as RejectLog keeps it

_PRINTABLE = frozenset(string.printable.encode()) - frozenset(b"\t\n\r\x0b\x0c")


def printable(head: bytes, width: int) -> str:
    """The first `width` bytes of a refused payload as text, `.` for what does not print (the
    first bytes of junk from a hostile device must not drive a terminal)."""
    return "".join(chr(b) if b in _PRINTABLE else "." for b in head[:width])


def _device_clause(device: str | None) -> tuple[str, tuple[str, ...]]:
    return (" WHERE sender = ?", (device,)) if device is not None else ("", ())


def reject_counts(db: LeaderDb, *, device: str | None = None) -> list[RejectCount]:
    """Refusals kept, grouped by sender and reason, the most frequent first."""
    if "rejects" not in db.tables:
        return []
    where, params = _device_clause(device)
    return [RejectCount(sender=sender, reason=str(reason), count=int(n), last_ms=int(last))
            for sender, reason, n, last in db.conn.execute(
                f"SELECT sender, reason, COUNT(*), MAX(at_ms) FROM rejects{where}"
                " GROUP BY sender, reason ORDER BY COUNT(*) DESC, MAX(at_ms) DESC", params)]


_COLUMNS = "id, at_ms, topic, sender, msg_id, kind, size, reason, head"


def _row(values: tuple[object, ...]) -> Reject:
    id_, at, topic, sender, msg_id, kind, size, reason, head = values
    return Reject(int(str(id_)), int(str(at)), str(topic), None if sender is None else str(sender),
                  None if msg_id is None else str(msg_id), None if kind is None else str(kind), int(str(size)),
                  str(reason), head if isinstance(head, bytes) else b"")


def reject_rows(db: LeaderDb, *, device: str | None = None, limit: int = 50) -> list[RejectRow]:
    """The newest refusals first; `limit` 0 for all."""
    if "rejects" not in db.tables:
        return []
    where, params = _device_clause(device)
    return [_row(v) for v in db.conn.execute(
        f"SELECT {_COLUMNS} FROM rejects{where} ORDER BY id DESC LIMIT {int(limit) or -1}", params)]


def reject_by_id(db: LeaderDb, reject_id: int) -> RejectRow | None:
    if "rejects" not in db.tables:
        return None
    found = db.conn.execute(f"SELECT {_COLUMNS} FROM rejects WHERE id = ?", (reject_id,)).fetchone()
    return None if found is None else _row(found)


__all__ = ["printable", "RejectCount", "RejectRow", "reject_by_id", "reject_counts", "reject_rows"]
