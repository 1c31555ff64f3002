"""A config rollout on the wave engine, leader side: the release is checked whole against the
fleet's key at the start and kept by its id, offered to the devices as a config offer (the port
hears the kind), and a device may be held by one rollout of each kind and target at once, never
by two of the same kind and target. (End to end over mosquitto: tests/e2e/test_config_rollout_mqtt.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout_engine"))

from rollout_support import FakePort, engine_kinds, spec_data

from agent.core.clock import VirtualClock
from agent.core.errors import ConfigError, RolloutError
from config_rollout.kind import CONFIG, keep_release
from config_rollout.messages import OFFER_RELEASE_MAX
from config_rollout.release import build_release
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.keys import KeyPairPaths, generate_keypair, load_signing_key, load_verify_key
from rollout_engine.orchestrator import Orchestrator
from rollout_engine.spec import spec_from_dict
from rollout_engine.store import RolloutStore


def signed_release(tmp: Path, keys: KeyPairPaths, version: str, text: str) -> Path:
    """A release of target app holding app.toml = `text`, signed with `keys`."""
    src = tmp / f"src-{version}"
    src.mkdir()
    (src / "app.toml").write_text(text)
    out = tmp / f"app-{version}.eacfg"
    out.write_bytes(build_release("app", version, [src / "app.toml"], load_signing_key(keys.private), created_ms=1))
    return out


async def test_a_config_rollout_is_offered_as_config_beside_a_firmware_one(tmp_path: Path) -> None:
    keys = generate_keypair(tmp_path / "keys")
    fleet_key = load_verify_key(keys.public)
    release = signed_release(tmp_path, keys, "1.1.0", "port = 2\n")
    clock = VirtualClock()
    devices = [f"d{i}" for i in range(4)]
    port = FakePort(clock, devices)
    port.config_held = {"app": {"d0": "1.0.0", "d1": "1.0.0", "d2": "0.9.0"}}  # d3 stated none yet
    store = RolloutStore.open(tmp_path / "leader.db", clock=clock)
    orchestrator = Orchestrator(store, clock=clock, port=port,
                                kinds=engine_kinds(port, keys=fleet_key, directory=tmp_path / "artifacts"))
    try:
        artifact, _ = make_artifact(tmp_path, chunk_size=1024, size=4096)
        fw = spec_from_dict(spec_data(artifact, waves={"canary": 1, "counts": [3]}))
        await orchestrator.start_rollout(fw, rollout_id="fw-1")
        cfg = spec_from_dict(spec_data(release, rollout={"kind": "config"}, waves={"canary": 1, "counts": [3]}))
        await orchestrator.start_rollout(cfg, rollout_id="cfg-1")  # the same devices: another kind, allowed
        await orchestrator.tick()
        kinds = {rid: kind for (_, _, rid), kind in zip(port.offers, port.kinds, strict=True)}
        assert kinds == {"fw-1": "firmware", "cfg-1": "config"}
        row = store.get("cfg-1")
        assert row is not None and row.version == "1.1.0" and row.signed_manifest == release.read_bytes()
        assert Path(row.artifact).parent == tmp_path / "artifacts" and Path(row.artifact).read_bytes() == \
            release.read_bytes()  # the leader's copy, by the release's id
        # what each device's target held (its heartbeats said), not its firmware version
        assert store.from_versions("cfg-1") == {"1.0.0": 2, "": 1, "0.9.0": 1}
        with pytest.raises(RolloutError, match="belong to an unfinished rollout"):
            await orchestrator.start_rollout(cfg, rollout_id="cfg-2")  # two of one kind and target: refused
        (tmp_path / "net.conf").write_text("dhcp = true\n")
        net = tmp_path / "net-1.0.0.eacfg"
        net.write_bytes(build_release("net", "1.0.0", [tmp_path / "net.conf"], load_signing_key(keys.private),
                                      created_ms=1))
        other_target = spec_from_dict(spec_data(net, rollout={"kind": "config"}, waves={"canary": 1, "counts": [3]}))
        await orchestrator.start_rollout(other_target, rollout_id="cfg-net")  # another target: beside it
        assert {r.id for r in store.rollouts(active_only=True)} == {"fw-1", "cfg-1", "cfg-net"}
    finally:
        store.close()


def test_a_release_the_leader_cannot_vouch_for_starts_nothing(tmp_path: Path) -> None:
    keys = generate_keypair(tmp_path / "keys")
    fleet_key = load_verify_key(keys.public)
    other = generate_keypair(tmp_path / "other")
    (tmp_path / "app.toml").write_text("port = 2\n")
    foreign = tmp_path / "foreign.eacfg"
    foreign.write_bytes(build_release("app", "1.1.0", [tmp_path / "app.toml"], load_signing_key(other.private),
                                      created_ms=1))
    store_dir = tmp_path / "artifacts"
    with pytest.raises(RolloutError, match="not the fleet's key"):
        keep_release(fleet_key, store_dir, str(foreign))
    big = tmp_path / "big.eacfg"
    big.write_bytes(b"x" * (OFFER_RELEASE_MAX + 1))
    with pytest.raises(RolloutError, match="too large to offer"):
        keep_release(fleet_key, store_dir, str(big))
    with pytest.raises(RolloutError, match="no \\[firmware\\] public_key"):
        keep_release(None, store_dir, str(foreign))
    assert not store_dir.exists() or not list(store_dir.iterdir())  # nothing kept
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the store's folder should be")
    with pytest.raises(RolloutError, match="cannot keep it as"):  # refused in one line, never an OSError
        keep_release(fleet_key, blocked, str(signed_release(tmp_path, keys, "1.1.0", "port = 2\n")))
    with pytest.raises(ConfigError, match="rollout.download_only"):
        CONFIG.check_spec(spec_from_dict(spec_data(foreign, rollout={"kind": "config", "download_only": True})),
                          source="spec.toml")


async def test_a_compliance_gate_waits_for_the_heartbeats_then_passes_or_fails_the_wave(tmp_path: Path) -> None:
    """`min_compliance_pct`: a wave whose devices all reported success passes only once that share
    of it is in sync by their own heartbeats; it waits `compliance_wait_s` for them, then fails."""
    from rollout_engine.messages import RolloutReport

    keys = generate_keypair(tmp_path / "keys")
    fleet_key = load_verify_key(keys.public)
    release = signed_release(tmp_path, keys, "1.1.0", "port = 2\n")
    clock = VirtualClock()
    port = FakePort(clock, [f"d{i}" for i in range(3)])
    port.in_sync = set()
    store = RolloutStore.open(tmp_path / "leader.db", clock=clock)
    orchestrator = Orchestrator(store, clock=clock, port=port,
                                kinds=engine_kinds(port, keys=fleet_key, directory=tmp_path / "artifacts"))
    seq = iter(range(1, 1000))

    async def succeed(rid: str, device: str) -> None:
        await orchestrator.on_report(f"m{next(seq)}", RolloutReport(
            device=device, rollout_id=rid, version="1.1.0", state="succeeded", phase="committed",
            ts_ms=clock.now_ms(), seq=next(seq)))

    try:
        gates = {"min_compliance_pct": 100.0, "compliance_wait_s": 60.0}
        spec = spec_from_dict(spec_data(release, rollout={"kind": "config"}, waves={"canary": 1, "counts": [2]},
                                        gates=gates))
        with pytest.raises(ConfigError, match="gates.min_compliance_pct"):  # a firmware rollout has no such gate
            await orchestrator.start_rollout(spec_from_dict(spec_data(release, gates=gates)), rollout_id="fw-1")
        await orchestrator.start_rollout(spec, rollout_id="cfg-1")
        await orchestrator.tick()
        canary = [d.device_id for d in store.devices("cfg-1", wave=0)]
        await succeed("cfg-1", canary[0])
        await orchestrator.tick()
        wave = store.wave("cfg-1", 0)
        assert wave is not None and wave.state == "running"  # reported, not yet seen in sync
        assert "0 of 1 in sync by their heartbeats" in wave.detail and "waiting up to 60s" in wave.detail
        port.in_sync = {canary[0]}  # its heartbeat says so
        await orchestrator.tick()
        wave = store.wave("cfg-1", 0)
        assert wave is not None and wave.state == "passed"
        await orchestrator.tick()  # wave 2 offered
        for d in store.devices("cfg-1", wave=1):
            await succeed("cfg-1", d.device_id)
        await orchestrator.tick()
        await clock.advance(61)  # one of them never heartbeats in sync
        port.in_sync = {canary[0], store.devices("cfg-1", wave=1)[0].device_id}
        await orchestrator.tick()
        row = store.get("cfg-1")
        assert row is not None and row.state == "aborted"
        assert "compliance: 1 of 2 in sync by their heartbeats (50.0% < 100%)" in row.detail, row.detail
    finally:
        store.close()


async def test_a_config_rollback_rolls_forward_to_the_old_content_under_a_higher_version(tmp_path: Path) -> None:
    from rollout_engine.messages import RolloutReport

    keys = generate_keypair(tmp_path / "keys")
    fleet_key = load_verify_key(keys.public)

    def release(version: str, text: str) -> Path:
        return signed_release(tmp_path, keys, version, text)

    clock = VirtualClock()
    port = FakePort(clock, ["d0", "d1"])
    store = RolloutStore.open(tmp_path / "leader.db", clock=clock)
    orchestrator = Orchestrator(store, clock=clock, port=port,
                                kinds=engine_kinds(port, keys=fleet_key, directory=tmp_path / "artifacts"))
    try:
        spec = spec_from_dict(spec_data(release("1.1.0", "port = 2\n"), rollout={"kind": "config"},
                                        waves={"canary": 0, "counts": [2]}))
        await orchestrator.start_rollout(spec, rollout_id="cfg-1")
        await orchestrator.tick()
        for n, device in enumerate(("d0", "d1")):
            await orchestrator.on_report(f"m{n}", RolloutReport(device=device, rollout_id="cfg-1", version="1.1.0",
                                                               state="succeeded", phase="committed",
                                                               ts_ms=clock.now_ms(), seq=n + 1))
        with pytest.raises(RolloutError, match="must hold the old content under a version above 1.1.0"):
            await orchestrator.control("cfg-1", "rollback", str(release("1.0.0", "port = 1\n")))
        said = await orchestrator.control("cfg-1", "rollback", str(release("1.1.1", "port = 1\n")))
        assert "cfg-1-rollback offers the previous version to 2 devices" in said
        back = store.get("cfg-1-rollback")
        assert back is not None and back.version == "1.1.1" and back.spec.rollout.kind == "config"
        await orchestrator.tick()
        assert {(device, rid) for _, device, rid in port.offers if rid == "cfg-1-rollback"} == {
            ("d0", "cfg-1-rollback"), ("d1", "cfg-1-rollback")}
        assert port.kinds[-1] == "config"
    finally:
        store.close()
