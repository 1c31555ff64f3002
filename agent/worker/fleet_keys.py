"""What a worker checks artifacts and config releases with, built once per worker and shared by
the updater and the configuration targets: the fleet's trust document under `[firmware]
trust_root` (kept in DATA_DIR/trust once accepted), or the one pinned `public_key`.

A newer trust document rides on every offer (`UpdateOffer.trust`, `ConfigOffer.trust`);
`take_trust_document` takes it before the offer's own signature is checked, so an artifact
signed by a key the newest document removed, or whose expiry passed, is refused at once.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from firmware_rollout.artifact.keys import Verifier
from firmware_rollout.artifact.trust import TrustedKeys, load_fleet_keys
from firmware_rollout.errors import TrustError

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


def take_trust_document(keys: Verifier, data: bytes, *, offer: str) -> str | None:
    """Take the trust document an offer carries; None when taken (or held already), else why it
    was refused (a lower version, a bad signature, ...): the offer is then refused with it."""
    if not data or not isinstance(keys, TrustedKeys):
        return None
    try:
        if keys.accept(data):
            log.info("took trust document v%d with offer %s", keys.version, offer)
    except TrustError as exc:
        log.warning("offer %s: trust document refused: %s", offer, exc)
        return f"trust document refused: {exc}"
    return None


__all__ = ["TRUST_DIR", "fleet_keys", "take_trust_document"]
