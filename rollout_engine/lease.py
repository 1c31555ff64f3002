"""One orchestrator for a fleet of several leaders: the fleet's fenced lease (`agent.core.lease`)
named "orchestrator", fencing the rollout tables.

The leaders of a fleet that share a database server all open the rollout tables, and each calls
`hold()` every third of `[leader] rollout_lease_s`; the one whose `hold()` says True runs the
orchestrator. The rollout store runs the lease's `fence` first in each of its write
transactions: a leader frozen (SIGSTOP) while holding the lease and woken after another took it
writes nothing, not a device's state, not an offer (the orchestrator stores an offer before it
sends it). Its lease expiring without a taker changes nothing: the token alone decides.
"""

from __future__ import annotations

from typing import Final

from agent.core.lease import FencedLease, LeaseLost, LeaseRow
from rollout_engine.store import RolloutStore

LEASE_NAME: Final = "orchestrator"


class OrchestratorLease(FencedLease):
    """This leader's side of the orchestrator lease, on the rollout store it fences."""

    def __init__(self, store: RolloutStore, holder: str, *, ttl_s: float) -> None:
        """`ttl_s` (`[leader] rollout_lease_s`): a standby takes over at most this long after the
        holder's last renewal."""
        super().__init__(store, LEASE_NAME, holder, ttl_s=ttl_s)


def lease_of(store: RolloutStore) -> LeaseRow | None:
    """Who holds the orchestrator lease (None: no leader took it yet, or `leader.db`, whose one
    leader runs the orchestrator)."""
    return store.lease(LEASE_NAME)


__all__ = ["LEASE_NAME", "LeaseLost", "LeaseRow", "OrchestratorLease", "lease_of"]
