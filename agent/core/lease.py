"""One fenced lease for every singleton a fleet's leaders share: the rollout orchestrator, the
job queue, whatever comes next.

The leaders of a fleet on one database server each call `hold()` every third of the lease's
time; the one whose `hold()` says True runs the singleton. A lease is a row of `leases` (by the
singleton's name) with its holder, a fencing token and its expiry, in the database server's time
(the leaders' clocks never decide who holds it):

* free, expired, or held by this leader's own name under another token (the leader restarted):
  taken, with `token + 1`;
* held by this holder under its token: renewed;
* otherwise: not ours (`token` is None).

Fencing: `fence()` runs first in every write transaction of the singleton's store. It reads the
row `FOR SHARE` and raises `LeaseLost` unless it still carries this holder's token. A taker
updates the row, so it waits for every transaction that read it under the old token to end;
after that, every transaction of the old holder fails its fence. A leader frozen (SIGSTOP)
while holding a lease and woken after another took it writes nothing.

A lease given up (`release()`) is said on the server's channel `CHANNEL` with the lease's name,
so standbys listening there (`Store.listener`) take it at once rather than at their next try.

The table lives with the store that fences on it (component "leases", migrated on that store's
own connection): `agent/core/sql/<backend>/leases/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.core.backends import server_migrations
from agent.core.errors import StoreError
from agent.core.sql import SERVER_NOW_MS, dialect_of, has_table
from agent.core.store import Store

COMPONENT = "leases"
CHANNEL = "ea_leases"  # a lease given up: its name is said here (`FencedLease.release`)
_MIGRATIONS = server_migrations("agent.core", COMPONENT)


class LeaseLost(StoreError):
    """Another leader holds the lease now: this one must stop writing as the singleton."""


@dataclass(frozen=True)
class LeaseRow:
    """Who holds a lease: the holder's name, its fencing token, until when (server ms), since
    when, and when its holder last finished a round of its work (None: not yet)."""

    holder: str
    token: int
    expires_ms: int
    acquired_ms: int
    ticked_ms: int | None


class FencedLease:
    """This leader's side of the lease `name`, on the connection of the store it fences (on a
    database server: `leader.db` has one leader, who needs none)."""

    def __init__(self, store: Store, name: str, holder: str, *, ttl_s: float) -> None:
        """`ttl_s`: a standby takes over at most this long after the holder's last renewal."""
        if not store.on_server:
            raise ValueError(f"the {name} lease is for a fleet's database server (leader.db has one leader)")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.store = store
        self.name = name
        self.holder = holder
        self.ttl_ms = int(ttl_s * 1000)
        self.token: int | None = None  # ours while not None
        store.migrate_also(COMPONENT, _MIGRATIONS)

    @property
    def held(self) -> bool:
        return self.token is not None

    def hold(self) -> bool:
        """Take or renew the lease; True while this leader holds it. A database error (the
        server lost, a lock wait over `lock_timeout`) raises `StoreError` and changes nothing."""
        execute = self.store.connection.execute
        with Store.atomic(self.store):  # (the store's own transaction, without its fence)
            now = int(execute(f"SELECT {SERVER_NOW_MS}").fetchone()[0])
            # another's lease running: no row lock (a standby asks every second, and a lock would
            # make the holder's fenced writes wait for it)
            found = execute("SELECT holder, expires_ms FROM leases WHERE name = ?", (self.name,)).fetchone()
            if found is not None and found[0] != self.holder and int(found[1]) > now:
                self.token = None
                return False
            execute("INSERT INTO leases (name, holder, token, expires_ms, acquired_ms) VALUES (?, '', 0, 0, 0)"
                    " ON CONFLICT (name) DO NOTHING", (self.name,))
            held_by, token, expires_ms = execute(
                "SELECT holder, token, expires_ms FROM leases WHERE name = ? FOR UPDATE", (self.name,)).fetchone()
            if held_by == self.holder and token == self.token:
                execute("UPDATE leases SET expires_ms = ? WHERE name = ?", (now + self.ttl_ms, self.name))
                return True
            if held_by != self.holder and int(expires_ms) > now:
                self.token = None
                return False
            taken = int(token) + 1
            execute("UPDATE leases SET holder = ?, token = ?, expires_ms = ?, acquired_ms = ?, ticked_ms = NULL"
                    " WHERE name = ?", (self.holder, taken, now + self.ttl_ms, now, self.name))
        self.token = taken
        return True

    def fence(self) -> None:
        """Inside a write transaction of the store: raise `LeaseLost` unless this holder's token
        is the lease's (read `FOR SHARE`: a taker waits until that transaction ends)."""
        found = self.store.connection.execute(
            "SELECT holder, token FROM leases WHERE name = ? FOR SHARE", (self.name,)).fetchone()
        if self.token is None or found is None or int(found[1]) != self.token:
            self.token = None
            held_by = f"leader {found[0]!r} (token {found[1]})" if found is not None and found[0] else "no leader"
            raise LeaseLost(f"this leader ({self.holder!r}) does not hold the {self.name} lease: {held_by} does")

    def ticked(self) -> None:
        """Stamp the lease with the server's time of the holder's newest finished round (the
        views and the fail-over benchmark read it), fenced."""
        with Store.atomic(self.store):
            self.fence()
            self.store.connection.execute(f"UPDATE leases SET ticked_ms = ({SERVER_NOW_MS}) WHERE name = ?",
                                          (self.name,))

    def release(self) -> None:
        """Give the lease up at once (a leader that stops): a standby takes it at its next
        `hold()`, not a lease time later. Nothing if it is not ours any more."""
        if self.token is None:
            return
        token, self.token = self.token, None
        with Store.atomic(self.store):
            self.store.connection.execute("UPDATE leases SET expires_ms = 0 WHERE name = ? AND token = ?",
                                          (self.name, token))
            self.store.notify(CHANNEL, self.name)


def lease_row(conn: Any, name: str) -> LeaseRow | None:
    """Lease `name` as any connection to the fleet's database reads it (None: never taken, or a
    database without leases: `leader.db`)."""
    if not int(conn.execute(has_table(dialect_of(conn), "leases")).fetchone()[0]):
        return None
    row = conn.execute("SELECT holder, token, expires_ms, acquired_ms, ticked_ms FROM leases WHERE name = ?",
                       (name,)).fetchone()
    if not row or not row[0]:
        return None
    holder, token, expires_ms, acquired_ms, ticked_ms = row
    return LeaseRow(str(holder), int(token), int(expires_ms), int(acquired_ms),
                    None if ticked_ms is None else int(ticked_ms))


__all__ = ["CHANNEL", "FencedLease", "LeaseLost", "LeaseRow", "lease_row"]
