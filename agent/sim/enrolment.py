"""The simulator's rehearsal of enrolment (`simulate --enrol`): every device enrols at its first
boot, as a device with `[identity]` does under `edge-agent run`.

Each device runs the worker's stages before its assembly (`agent.app.prepare`): it makes its own
P-256 key, sends its certificate request on the fleet's enrolment topic over the in-memory broker
(a connection of its own, `ea-enrol-{fleet}-{device}`, as the broker's enrolment listener would
take it) and waits for the answer. The leaders' real identity part checks the request and
approves it by the batch token the run issues for the whole fleet, signing a certificate with
the fleet's CA; the device stores it and only then is assembled and started. Several leaders
share one CA (the first leader's, copied to the others before they start), as an operator sets
them up. What the in-memory broker cannot rehearse is the TLS itself: the device's connection
after enrolment carries no certificate.
"""

from __future__ import annotations

import secrets
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.core.clock import Clock
from agent.core.config import AgentConfig, IdentitySection, convert
from agent.core.files import write_private_file
from agent.core.sql import StoreTarget
from agent.identity.files import authority_files
from agent.leader.agent import LeaderAgent
from agent.leader.identities import IdentityStore
from agent.transport.base import Transport
from agent.transport.memory import MemoryBroker, MemoryTransport

CLAIM = "sim-claim"  # the fleet's claim credential in a run
TOKEN_FILE = "enrol-token"  # in the run's folder: the batch token every device reads
TOKEN_TTL_S = 7 * 86_400


def leader_identity(devices: int) -> dict[str, Any]:
    """A leader's `[identity]` for a run: the run's claim heard, and request rates that let the
    whole fleet ask within its boot window (the shipped ones pace a real fleet's provisioning)."""
    rate = max(600, 4 * devices)
    return {"claims": [CLAIM], "claim_rate_per_min": rate, "total_rate_per_min": rate,
            "max_pending": max(1000, devices)}


def worker_identity(workdir: Path) -> IdentitySection:
    """Every device's `[identity]` in a run: the claim over the in-memory broker and the run's token."""
    return convert({"claim_url": "memory://", "claim_username": CLAIM, "token_file": str(workdir / TOKEN_FILE),
                    "ask_interval_s": 10.0}, IdentitySection, source="simulate")


def share_authority(first: Path, others: list[Path], section: IdentitySection) -> None:
    """Copy the first leader's CA (made when its identity part was built) to the other leaders'
    data directories: one fleet, one CA."""
    sources = authority_files(section, first)
    for base in others:
        for source, target in zip(sources, authority_files(section, base), strict=True):
            if source.exists() and source != target:
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                shutil.copy2(source, target)


def issue_token(leader: LeaderAgent, workdir: Path, devices: int, clock: Clock) -> None:
    """A batch token for every device of the run, as `edge-agent devices token --uses N` issues
    it, written where the devices' `token_file` says."""
    token = secrets.token_urlsafe(24)
    now = clock.now_ms()
    with IdentityStore.open(leader.shared) as store:
        store.add_token(token, uses=devices, expires_ms=now + TOKEN_TTL_S * 1000, by="simulate", now_ms=now)
    write_private_file(workdir / TOKEN_FILE, token.encode() + b"\n", 0o600)


def claim_connection(broker: MemoryBroker) -> Callable[[AgentConfig, str], Transport]:
    """The enrolment's connection factory of `agent.worker.env.DeviceEnv`: a client of the
    in-memory broker under the enrolment's client id."""

    def connect(config: AgentConfig, client_id: str) -> Transport:
        return MemoryTransport(broker, client_id, clean_start=True, max_payload_bytes=config.mqtt.max_payload_bytes)

    return connect


class EnrolmentTimes:
    """Each device's fleet time from its boot to its assembly (its enrolment, when it had no
    certificate), for the report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.devices = 0

    def report(self, enrolled: int) -> dict[str, Any]:
        values = sorted(self.seconds.values())
        return {"devices": self.devices, "enrolled": enrolled, "not_enrolled": self.devices - enrolled,
                "boot_to_enrolled_s": {"median": round(statistics.median(values), 3),
                                       "max": round(values[-1], 3)} if values else None}


def enrolled_count(where: StoreTarget) -> int:
    """Devices the fleet's identity store (`where`: a leader's `shared`) holds a certificate for."""
    with IdentityStore.open(where) as store:
        return store.count("approved")


__all__ = ["CLAIM", "EnrolmentTimes", "claim_connection", "enrolled_count", "issue_token", "leader_identity",
           "share_authority", "worker_identity"]
