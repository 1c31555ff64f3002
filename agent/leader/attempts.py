"""An operator acknowledges configuration attempts that did not commit (`edge-agent config
acknowledge`, the console's buttons): the registry says which attempts are open (the devices'
heartbeats), the acknowledgements' store records the ones acknowledged. Each acknowledgement
names the attempt as the registry held it when it was made, so an attempt the device began since
is not acknowledged by it.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.core.errors import ConfigError
from agent.core.sql import StoreTarget
from agent.leader.readonly import open_leader_db
from agent.protocol import ConfigState
from config_rollout.attempt_acks import AttemptAck, AttemptAckStore, open_attempt


def open_attempts(db_target: StoreTarget, target: str) -> dict[str, ConfigState]:
    """device -> what it holds of `target`, for each device whose last attempt there did not
    commit and is not acknowledged."""
    with open_leader_db(db_target) as db:
        states = db.registry.config_states()
        acks = db.attempt_acks.newest()
    return {device: held[target] for device, (_, held) in sorted(states.items())
            if target in held and open_attempt(held[target], acks.get((device, target)))}


def acknowledge_attempts(db_target: StoreTarget, target: str, devices: Sequence[str] | None, *, by: str,
                         now_ms: int, field: str = "--device") -> list[AttemptAck]:
    """Acknowledge the open attempts at `target` of `devices` (None: of every device with one);
    the acknowledgements made. A device named without an open attempt there is a `ConfigError`
    naming `field`, and nothing is written."""
    found = open_attempts(db_target, target)
    if devices is None:
        chosen = sorted(found)
    else:
        missing = [d for d in devices if d not in found]
        if missing:
            raise ConfigError(field, None, f"{missing[0]}: no attempt at target {target} to acknowledge"
                              " (its last one committed, was acknowledged already, or it never stated the target)")
        chosen = sorted(set(devices))
    if not chosen:
        return []
    with AttemptAckStore.open(db_target) as store:
        return [store.acknowledge(device, target, found[device], by=by, now_ms=now_ms) for device in chosen]


__all__ = ["acknowledge_attempts", "open_attempts"]
