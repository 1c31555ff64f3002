"""What a leader takes from where it runs: a real gateway's defaults, or the simulator's.

`agent.app.assemble` hands it to the leader and to every feature factory of the leader's parts
(`agent.service.parts.Feature`); a field left at its default is what `edge-agent run` uses.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.transport.base import Transport

if TYPE_CHECKING:
    from agent.leader.rollout_kinds import KindEntry


@dataclass(frozen=True, kw_only=True)
class GatewayEnv:
    rng: random.Random | None = None  # the leader's ids and jitter (the simulator's is seeded)
    recover: bool = False  # move a damaged leader.db aside instead of refusing to start (`run --recover`)
    intake_batch_max: int = 512  # records the intake actors write in one transaction at most
    # the kinds a rollout can install (None: `agent.leader.rollout_kinds.ROLLOUT_KINDS`)
    rollout_kinds: Mapping[str, KindEntry] | None = None
    rollout_poll_s: float = 2.0  # how often the orchestrator reads the controls `rollout ...` writes
    # the northbound broker's connection (default: the MQTT connection `[northbound] url` names)
    northbound_transport: Transport | None = None


__all__ = ["GatewayEnv"]
