"""Which devices' configuration targets the leader has more for ("pending"), from three stores'
reads: the registry (what each target holds, and the layer digest it applied, as the heartbeats
say), the rollouts (a config rollout that has not finished with the device), and the layers (what
they give the device now, which may differ from what it applied: a layer value set since).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agent.leader.readonly import LeaderDb
from agent.leader.registry import compliance_counts
from agent.protocol import ConfigState

#: device -> (its tags, what each of its configuration targets holds)
States = Mapping[str, tuple[Sequence[str], Mapping[str, ConfigState]]]


def config_pending(db: LeaderDb, states: States, now_ms: int) -> set[tuple[str, str]]:
    """The (device, target)s on their way to what the leader wants."""
    from config_rollout.errors import ConfigReleaseError
    from config_rollout.kind import CONFIG
    from config_rollout.release import peek_release

    pending: set[tuple[str, str]] = set()
    for rollout_id, _state, _version, release in db.rollouts.of_kind(CONFIG.name, active=True):
        try:
            target = peek_release(release).name  # (verified when the rollout started)
        except ConfigReleaseError:
            continue
        pending.update((device, target) for device in db.rollouts.unfinished_in(rollout_id))
    layers = db.layers
    targets = {t for _, held in states.values() for t in held}
    for target in sorted(targets):
        holders = {device: tags for device, (tags, held) in states.items() if target in held}
        wanted = layers.digests(target, holders, now_ms=now_ms)
        pending.update((device, target) for device, digest in wanted.items()
                       if states[device][1][target].layers != digest)
    return pending


def fleet_compliance(db: LeaderDb, now_ms: int) -> dict[str, dict[str, int]]:
    """target -> in_sync / pending / drifted / damaged / not_applied -> devices, and
    last_attempt_failed beside them: attempts no operator acknowledged (`compliance_counts`; the
    registry read once)."""
    states = db.registry.config_states()
    return compliance_counts(states, config_pending(db, states, now_ms), db.attempt_acks.newest())


__all__ = ["config_pending", "fleet_compliance"]
