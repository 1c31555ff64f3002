"""A device that pins only the fleet's root takes the trust document riding on an offer before
the release is checked, keeps it across a restart, and refuses a forged document and a release
signed by a key the newest document removed, each with its reason in the rollout's report; the
leader hands its document out with every offer and never an older one than it held."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import config, leader, stop_all, worker

from agent.core.clock import VirtualClock
from agent.leader.env import GatewayEnv
from agent.leader.rollout import fleet_keys as leader_fleet_keys
from agent.leader.rollout import rollout_part
from agent.transport.memory import MemoryBroker
from agent.worker.config_targets import ConfigTargetsPart
from agent.worker.fleet_keys import fleet_keys
from config_rollout.messages import ConfigOffer
from config_rollout.release import build_release
from firmware_rollout.errors import TrustError
from rollout_engine.keys import SigningKey
from rollout_engine.trust import TrustedKeys, make_trust_document

ROOT, STRANGER, K1, K2 = (SigningKey.generate() for _ in range(4))
YEAR_MS = 365 * 86_400_000


def trust(version: int, *keys: SigningKey, signer: SigningKey = ROOT, now_ms: int) -> bytes:
    return make_trust_document(version=version, roots=[ROOT.public], keys=[(k.public, now_ms + YEAR_MS) for k in keys],
                               signers=[signer], issued_ms=now_ms)


def release(tmp: Path, version: str, text: str, key: SigningKey) -> bytes:
    src = tmp / f"src-{version}"
    src.mkdir()
    (src / "app.toml").write_text(text)
    return build_release("app", version, [src / "app.toml"], key, created_ms=1)


async def test_a_device_takes_the_trust_document_from_its_offers(tmp_path: Path, clock: VirtualClock,
                                                                broker: MemoryBroker) -> None:
    etc = tmp_path / "etc" / "app"
    etc.mkdir(parents=True)
    (etc / "app.toml").write_text("port = 1\n")
    (tmp_path / "root.pem").write_bytes(ROOT.public.to_pem())
    sections = {"firmware": {"trust_root": str(tmp_path / "root.pem")},
                "config_targets": {"app": {"directory": str(etc), "settle_s": 0, "confirm_s": 5}}}
    device = await worker(clock, tmp_path, "pi-1", broker=broker, sections=sections)
    keys = fleet_keys(device)
    assert isinstance(keys, TrustedKeys) and keys.version == 0
    part = ConfigTargetsPart(device, keys)
    await part.start()
    runner, ref = part.runner, part.ref
    assert ref is not None
    reports: list[tuple[str, str, str]] = []

    async def report(rollout_id: str, version: str, state: str, phase: str, detail: str, *, until_ms: int = 0) -> None:
        reports.append((rollout_id, state, detail))

    async def fine() -> str:
        return ""

    runner.report = report  # type: ignore[method-assign]
    part.module._host_check = lambda *args: fine  # type: ignore[method-assign]  # (no leader on this broker)
    now = clock.now_ms()
    try:
        ref.tell(ConfigOffer(rollout_id="r1", release=release(tmp_path, "1.1.0", "port = 2\n", K1)))
        await clock.advance(1)
        assert reports[-1][:2] == ("r1", "rejected") and "no trust document is held yet" in reports[-1][2]
        ref.tell(ConfigOffer(rollout_id="r2", release=release(tmp_path, "1.2.0", "port = 3\n", K1),
                             trust=trust(1, K1, now_ms=now)))
        await clock.advance(10)
        assert reports[-1][:2] == ("r2", "succeeded") and (etc / "app.toml").read_text() == "port = 3\n"
        ref.tell(ConfigOffer(rollout_id="r3", release=release(tmp_path, "1.3.0", "port = 4\n", K1),
                             trust=trust(2, K1, K2, signer=STRANGER, now_ms=now)))
        await clock.advance(1)
        assert reports[-1][:2] == ("r3", "rejected") and "trust document refused" in reports[-1][2]
        assert "not signed by a trusted root" in reports[-1][2]
        ref.tell(ConfigOffer(rollout_id="r4", release=release(tmp_path, "1.4.0", "port = 5\n", K1),
                             trust=trust(3, K2, now_ms=now)))  # K1 removed
        await clock.advance(1)
        assert reports[-1][:2] == ("r4", "rejected") and "trust document v3 does not list" in reports[-1][2]
        assert (etc / "app.toml").read_text() == "port = 3\n"
    finally:
        await part.stop()
        await stop_all(device, clock=clock)
    again = await worker(clock, tmp_path, "pi-1", broker=broker, sections=sections, start=False)
    assert fleet_keys(again).version == 3  # type: ignore[union-attr]  # kept in DATA_DIR/trust
    await stop_all(again, clock=clock)


async def test_the_leader_hands_its_trust_document_out_and_never_an_older_one(
        tmp_path: Path, clock: VirtualClock, broker: MemoryBroker) -> None:
    (tmp_path / "root.pem").write_bytes(ROOT.public.to_pem())
    (tmp_path / "trust.json").write_bytes(trust(2, K1, now_ms=clock.now_ms()))
    firmware = {"trust_root": str(tmp_path / "root.pem"), "trust_document": str(tmp_path / "trust.json")}
    gw = await leader(clock, tmp_path, broker=broker, firmware=firmware)
    service = await rollout_part(gw, GatewayEnv())
    try:
        assert service.orchestrator.trust_document == (tmp_path / "trust.json").read_bytes()
    finally:
        await service.stop()
        await stop_all(gw, clock=clock)
    (tmp_path / "trust.json").write_bytes(trust(1, K1, now_ms=clock.now_ms()))
    with pytest.raises(TrustError, match="v1 is older than v2, the one held"):
        leader_fleet_keys(config("leader", "gw", firmware=firmware), tmp_path / "gw", clock)
