"""Helpers for the outbox store tests: a message builder and the conservation check against
the database file itself."""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxMessage, OutboxStats

_ids = itertools.count(1)

OpenStore = Callable[..., Awaitable[OutboxStore]]


def make_msg(
    receiver: str = "leader",
    *,
    owner: str = "dev-1",
    kind: str = "telemetry",
    payload: bytes = b"payload",
    key: str | None = None,
    conflict: str = "append",
    seq: int = 0,
    ttl_ms: int | None = None,
    msg_id: str | None = None,
) -> OutboxMessage:
    return OutboxMessage(
        msg_id=msg_id or f"m{next(_ids)}",
        owner=owner,
        receiver=receiver,
        kind=kind,
        payload=payload,
        key=key,
        conflict=conflict,  # type: ignore[arg-type]
        seq=seq,
        ttl_ms=ttl_ms,
    )


def db_truth(path: Path) -> dict[str, Any]:
    """Counts read straight from the file with a separate connection."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        counters = dict(conn.execute("SELECT name, value FROM outbox_counters").fetchall())
        pending = conn.execute("SELECT count(*) FROM outbox WHERE status = 'pending'").fetchone()
        dead = conn.execute("SELECT count(*) FROM outbox WHERE status = 'dead'").fetchone()
        classes = {
            k: (p, b, d)
            for k, p, b, d in conn.execute(
                "SELECT kind, pending, pending_bytes, dead FROM outbox_classes"
            )
        }
        real = {
            k: (p, b, d)
            for k, p, b, d in conn.execute(
                "SELECT kind, sum(status = 'pending'), sum(CASE WHEN status = 'pending'"
                " THEN size ELSE 0 END), sum(status = 'dead') FROM outbox GROUP BY kind"
            )
        }
    finally:
        conn.close()
    return {
        "counters": counters,
        "pending": pending[0],
        "dead": dead[0],
        "classes": {k: v for k, v in classes.items() if v != (0, 0, 0)},
        "real_classes": real,
    }


async def assert_conserved(store: OutboxStore) -> OutboxStats:
    """The conservation law holds in the store's stats and agrees with the rows on disk."""
    stats = await store.stats()
    assert stats.conservation_ok, stats
    broken = {kind: c for kind, c in stats.by_class.items() if not c.conservation_ok}
    assert not broken, broken  # and class by class
    truth = db_truth(store.path)
    assert truth["pending"] == stats.pending, (truth, stats)
    assert truth["dead"] == stats.dead, (truth, stats)
    assert truth["classes"] == truth["real_classes"], truth
    c = truth["counters"]
    assert c["enqueued"] == stats.enqueued
    assert c["enqueued"] == (
        c["delivered"] + c["dead_lettered"] + c["expired"] + c["dropped"] + c["overwritten"]
        + truth["pending"] - c["replayed"]
    ), truth
    return stats
