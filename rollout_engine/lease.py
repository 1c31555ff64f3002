"""One orchestrator for a fleet of several leaders: a lease in the shared database, with a
fencing token.

The leaders of a fleet that share a PostgreSQL database all open the rollout tables, and each
calls `hold()` every few seconds; the one whose `hold()` says True runs the orchestrator. The
lease row (`rollout_lease`, name "orchestrator") names its holder, its token and when it expires,
in the database server's time (the leaders' clocks never decide who holds it):

* free, expired, or held by this leader's own name under another token (the leader restarted):
  taken, with `token + 1`;
* held by this holder under its token: renewed;
* otherwise: not ours (`token` is None).

Fencing: `fence()` runs first in every write transaction of the orchestrator's store. It reads
the row `FOR SHARE` and raises `LeaseLost` unless it still carries this holder's token. A taker
updates the row, so it waits for every transaction that read it under the old token to end; after
that, every transaction of the old holder fails its fence. A leader frozen (SIGSTOP) while
holding the lease and woken after another took it therefore writes nothing: not a device's
state, not an offer (the orchestrator stores an offer before it sends it). Its lease expiring
without a taker changes nothing: the token alone decides.
"""

from __future__ import annotations

from typing import Final

from agent.core.errors import StoreError
from rollout_engine.store import LeaseRow, RolloutStore

LEASE_NAME: Final = "orchestrator"


class LeaseLost(StoreError):
    """Another leader holds the orchestrator lease now: this one must stop writing rollouts."""


class OrchestratorLease:
    """This leader's side of the lease, on the orchestrator's store (PostgreSQL); `fence` is
    what that store runs first in each of its write transactions."""

    def __init__(self, store: RolloutStore, holder: str, *, ttl_s: float) -> None:
        """`ttl_s` (`[leader] rollout_lease_s`): a standby takes over at most this long after the
        holder's last renewal."""
        if not store.on_server:
            raise ValueError("the orchestrator lease is for a fleet's PostgreSQL database (leader.db has one leader)")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.store = store
        self.holder = holder
        self.ttl_ms = int(ttl_s * 1000)
        self.token: int | None = None  # ours while not None

    @property
    def held(self) -> bool:
        return self.token is not None

    def hold(self) -> bool:
        """Take or renew the lease; True while this leader holds it. A database error (the
        server lost, a lock wait over `lock_timeout`) raises `StoreError` and changes nothing."""
        self.token = self.store.take_lease(LEASE_NAME, self.holder, self.token, self.ttl_ms)
        return self.token is not None

    def fence(self) -> None:
        """Inside a write transaction: raise `LeaseLost` unless this holder's token is the lease's."""
        found = self.store.lease_holder(LEASE_NAME)
        if self.token is None or found is None or found[1] != self.token:
            self.token = None
            held_by = f"leader {found[0]!r} (token {found[1]})" if found is not None and found[0] else "no leader"
            raise LeaseLost(f"this leader ({self.holder!r}) does not hold the orchestrator lease: {held_by} does")

    def ticked(self) -> None:
        """Stamp the lease with the time of the orchestrator's newest finished tick (the views
        and the fail-over benchmark read it), in a fenced transaction."""
        with self.store.atomic():
            self.store.lease_ticked(LEASE_NAME)

    def release(self) -> None:
        """Give the lease up at once (a leader that stops): a standby takes it at its next
        `hold()`, not a TTL later. Nothing if it is not ours any more."""
        if self.token is None:
            return
        token, self.token = self.token, None
        self.store.release_lease(LEASE_NAME, token)


def lease_of(store: RolloutStore) -> LeaseRow | None:
    """Who holds the orchestrator lease (None: no leader took it yet, or `leader.db`, whose one
    leader runs the orchestrator)."""
    return store.lease(LEASE_NAME)


__all__ = ["LEASE_NAME", "LeaseLost", "OrchestratorLease", "lease_of"]
