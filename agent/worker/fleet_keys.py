"""What a worker checks artifacts and config releases with, built once per worker and shared by
the updater and the configuration targets: the fleet's trust document under `[firmware]
trust_root` (kept in DATA_DIR/trust once accepted), or the one pinned `public_key`.

A newer trust document rides on every offer (`UpdateOffer.trust`, `ConfigOffer.trust`); the
updater and the configuration targets take it (`rollout_engine.trust.take_trust_document`)
before the offer's own signature is checked, so an artifact signed by a key the newest document
removed, or whose expiry passed, is refused at once.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rollout_engine.keys import Verifier
from rollout_engine.trust import load_fleet_keys

if TYPE_CHECKING:
    from agent.core.clock import Clock
    from agent.core.config import AgentConfig


class KeyHolder(Protocol):
    """What the keys are built from (a `WorkerAgent`)."""

    @property
    def config(self) -> AgentConfig: ...
    @property
    def data_dir(self) -> Path: ...
    @property
    def clock(self) -> Clock: ...

log = logging.getLogger(__name__)

TRUST_DIR = "trust"
_built: weakref.WeakKeyDictionary[KeyHolder, Verifier] = weakref.WeakKeyDictionary()


def fleet_keys(worker: KeyHolder) -> Verifier:
    """The worker's verifier (`[firmware]` must name a key or a trust root: `keyed`)."""
    found = _built.get(worker)
    if found is None:
        fw = worker.config.firmware
        found = load_fleet_keys(public_key=fw.public_key, trust_root=fw.trust_root, trust_document=fw.trust_document,
                                state_dir=Path(worker.data_dir) / TRUST_DIR, now_ms=worker.clock.now_ms)
        assert found is not None, "fleet_keys needs [firmware] public_key or trust_root"
        _built[worker] = found
    return found


__all__ = ["TRUST_DIR", "fleet_keys"]
