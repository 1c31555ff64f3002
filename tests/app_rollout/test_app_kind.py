"""The application kind on the leader (a bundle checked whole, kept by its hash, offered with its
head and the mirrors) and a device's fetch of it from the leader's artifact server over HTTP,
resumed from a partial file and checked."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from apps_support import app_dir, fleet_key

from agent.core.errors import RolloutError
from app_rollout.bundle import CHUNKED_FROM, build_bundle, read_bundle, verify_head
from app_rollout.device.fetch import Reuse, fetch_bundle
from app_rollout.errors import AppInstallError
from app_rollout.kind import APP, AppKind
from app_rollout.messages import KIND_APP_OFFER, AppOffer
from firmware_rollout.orchestration.artifact_server import ArtifactServer


def test_the_leader_keeps_a_checked_bundle_by_its_hash_and_refuses_a_bad_one(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    build_bundle(app_dir(tmp_path / "hello", version="1.2.0"), key, tmp_path / "hello.eaapp")
    kind = AppKind(keys=key.public, directory=tmp_path / "artifacts")
    admitted = kind.admit(str(tmp_path / "hello.eaapp"), undone=None)
    kept = Path(admitted.artifact)
    assert admitted.version == "1.2.0" and kept.parent == tmp_path / "artifacts" and kept.suffix == ".eaapp"
    assert kept.read_bytes() == (tmp_path / "hello.eaapp").read_bytes()
    assert verify_head(admitted.release, key.public, source="x").name == "hello"
    described = APP.describe(tmp_path / "hello.eaapp")
    assert described.installs == "application hello 1.2.0" and "2 files" in described.what
    other = AppKind(keys=fleet_key(tmp_path / "k2")[0].public, directory=tmp_path / "artifacts2")
    with pytest.raises(RolloutError, match=r"hello.eaapp: signed by key .*, not the fleet's key"):
        other.admit(str(tmp_path / "hello.eaapp"), undone=None)
    assert not list((tmp_path / "artifacts2").glob("*"))  # nothing kept of it
    assert KIND_APP_OFFER == "app.offer"


async def test_a_device_fetches_the_bundle_from_the_artifact_server_and_resumes(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    big = {"bin/server": ("#!/bin/sh\nexec sleep infinity\n", 0o755), "data/blob": ("x" * 300_000, 0o644)}
    app = build_bundle(app_dir(tmp_path / "hello", files=big), key, tmp_path / "hello.eaapp")
    kept = Path(AppKind(keys=key.public, directory=tmp_path / "artifacts").admit(str(tmp_path / "hello.eaapp"),
                                                                                   undone=None).artifact)
    server = ArtifactServer(lambda name: kept if name == kept.name else None, host="127.0.0.1", port=0)
    await server.start()
    try:
        mirror = f"http://127.0.0.1:{server.port}/artifacts"
        digest, size = kept.stem, kept.stat().st_size
        downloads = tmp_path / "downloads"
        downloads.mkdir()
        (downloads / f"{digest}.eaapp.partial").write_bytes(kept.read_bytes()[:100_000])  # cut by a power loss
        fetched = await fetch_bundle([f"http://127.0.0.1:{server.port}/nothing-here", mirror], digest, size,
                                     downloads, head=app.head, manifest=app.manifest)
        assert fetched.path.read_bytes() == kept.read_bytes()
        assert fetched.bytes_fetched == size - 100_000  # only the rest
        again = await fetch_bundle([mirror], digest, size, downloads, head=app.head, manifest=app.manifest)
        assert again.bytes_fetched == 0
        with pytest.raises(AppInstallError, match="no mirror served the bundle: .*HTTP 404"):
            await fetch_bundle([mirror], "0" * 64, size, tmp_path / "d2", head=app.head, manifest=app.manifest)
    finally:
        await server.stop()


async def test_a_new_version_fetches_only_the_files_that_changed(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    files = {"bin/server": ("#!/bin/sh\nexec sleep infinity\n", 0o755), "assets/a": ("a" * 200_000, 0o644),
             "assets/b": ("b" * 200_000, 0o644), "assets/c": ("c" * 200_000, 0o644)}
    build_bundle(app_dir(tmp_path / "v1", files=files), key, tmp_path / "v1.eaapp")
    running = tmp_path / "running"  # the version the device runs, as its helper keeps it
    for path, (content, _mode) in files.items():
        (running / path).parent.mkdir(parents=True, exist_ok=True)
        (running / path).write_text(content)
    files["bin/server"] = ("#!/bin/sh\necho v2\nexec sleep infinity\n", 0o755)
    files["assets/b"] = ("B" * 200_000, 0o644)
    app = build_bundle(app_dir(tmp_path / "v2", version="2.0.0", files=files), key, tmp_path / "v2.eaapp")
    kept = Path(AppKind(keys=key.public, directory=tmp_path / "artifacts").admit(str(tmp_path / "v2.eaapp"),
                                                                                   undone=None).artifact)
    reuse = Reuse.of(read_bundle(tmp_path / "v1.eaapp", key.public).manifest, running)
    (running / "assets" / "c").write_text("tampered on the device")  # a kept file that changed: fetched
    server = ArtifactServer(lambda name: kept if name == kept.name else None, host="127.0.0.1", port=0)
    await server.start()
    try:
        fetched = await fetch_bundle([f"http://127.0.0.1:{server.port}/artifacts"], kept.stem, kept.stat().st_size,
                                     tmp_path / "downloads", head=app.head, manifest=app.manifest, reuse=reuse)
    finally:
        await server.stop()
    assert fetched.path.read_bytes() == kept.read_bytes()
    assert fetched.bytes_reused == 200_000  # assets/a
    changed = sum(f.size for f in app.manifest.files if f.path != "assets/a")
    assert fetched.bytes_fetched == changed  # the server, assets/b, and assets/c (not as kept)


async def test_a_large_file_changed_in_one_place_fetches_the_chunks_around_the_change(tmp_path: Path) -> None:
    """A file of CHUNKED_FROM bytes or more is listed by its content-defined chunks: 100 bytes
    inserted into 3 MB cost the chunks around them, the rest is copied from the running version
    (each copy checked against its chunk's hash: one changed on the device is fetched)."""
    import random

    key, _, _ = fleet_key(tmp_path / "keys")
    model = random.Random(7).randbytes(3 * 1024 * 1024)
    running = tmp_path / "running"
    (running / "data").mkdir(parents=True)
    (running / "data" / "model").write_bytes(model)

    def version(name: str, content: bytes) -> Path:
        src = app_dir(tmp_path / name, version=name, files={"bin/server": ("#!/bin/sh\nsleep 9\n", 0o755)})
        (src / "files" / "data" / "model").parent.mkdir(parents=True)
        (src / "files" / "data" / "model").write_bytes(content)
        build_bundle(src, key, tmp_path / f"{name}.eaapp")
        return tmp_path / f"{name}.eaapp"

    v1 = read_bundle(version("1.0.0", model), key.public)
    entry = next(f for f in v1.manifest.files if f.path == "data/model")
    assert len(entry.chunks) > 20 and sum(n for n, _ in entry.chunks) == len(model)
    assert not next(f for f in v1.manifest.files if f.path == "bin/server").chunks  # under CHUNKED_FROM
    changed = model[:1_500_000] + b"inserted" * 12 + model[1_500_000:]
    v2_path = version("2.0.0", changed)
    v2 = read_bundle(v2_path, key.public)
    kept = Path(AppKind(keys=key.public, directory=tmp_path / "artifacts").admit(str(v2_path), undone=None).artifact)
    server = ArtifactServer(lambda name: kept if name == kept.name else None, host="127.0.0.1", port=0)
    await server.start()
    try:
        mirror = [f"http://127.0.0.1:{server.port}/artifacts"]
        fetched = await fetch_bundle(mirror, kept.stem, kept.stat().st_size, tmp_path / "downloads", head=v2.head,
                                     manifest=v2.manifest, reuse=Reuse.of(v1.manifest, running))
        assert fetched.path.read_bytes() == kept.read_bytes()
        server_file = next(f for f in v2.manifest.files if f.path == "bin/server").size
        assert fetched.bytes_fetched + fetched.bytes_reused == v2.manifest.payload_size
        assert fetched.bytes_fetched - server_file <= 2 * 256 * 1024  # the chunks around the change
        assert fetched.bytes_reused >= len(changed) - 2 * 256 * 1024
        # a chunk the device holds changed under it: that chunk is fetched, the bundle still right
        damaged = bytearray(model)
        damaged[10] ^= 1
        (running / "data" / "model").write_bytes(bytes(damaged))
        again = await fetch_bundle(mirror, kept.stem, kept.stat().st_size, tmp_path / "downloads2", head=v2.head,
                                   manifest=v2.manifest, reuse=Reuse.of(v1.manifest, running))
        assert again.path.read_bytes() == kept.read_bytes()
        assert again.bytes_fetched == fetched.bytes_fetched + entry.chunks[0][0]
    finally:
        await server.stop()
    assert CHUNKED_FROM == 128 * 1024


def test_an_offer_is_bounded_in_every_field() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"rollout_id": "r", "head": b"x", "bundle": "../etc/passwd", "size": 1}, type=AppOffer)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"rollout_id": "r", "head": b"x", "bundle": "0" * 64, "size": 1,
                         "mirrors": ["http://m"] * 9}, type=AppOffer)


async def test_rollouts_of_two_applications_hold_a_device_together_two_of_one_do_not(tmp_path: Path) -> None:
    """A rollout holds the application it installs on its devices (its lane): another
    application's rollout starts on the same devices, a second one of the same application is
    refused naming them, and the dry run says only the latter."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout_engine"))
    from rollout_support import FakePort, spec_data

    from agent.core.clock import VirtualClock
    from rollout_engine.orchestrator import Orchestrator
    from rollout_engine.spec import spec_from_dict
    from rollout_engine.store import RolloutStore

    key, _, _ = fleet_key(tmp_path / "keys")
    bundles = {}
    for name, version in (("hello", "1.0.0"), ("metrics", "1.0.0"), ("hello", "1.1.0")):
        bundles[f"{name}-{version}"] = tmp_path / f"{name}-{version}.eaapp"
        build_bundle(app_dir(tmp_path / f"{name}-{version}", name=name, version=version), key,
                     bundles[f"{name}-{version}"])
    clock = VirtualClock()
    devices = [f"d{i}" for i in range(4)]
    store = RolloutStore.open(tmp_path / "leader.db", clock=clock)
    orchestrator = Orchestrator(store, clock=clock, port=FakePort(clock, devices),
                                kinds={"app": AppKind(keys=key.public, directory=tmp_path / "artifacts")})

    def spec(bundle: str):  # type: ignore[no-untyped-def]
        return spec_from_dict(spec_data(bundles[bundle], rollout={"kind": "app"}, waves={"canary": 1, "counts": [3]}))

    try:
        await orchestrator.start_rollout(spec("hello-1.0.0"), rollout_id="hello-1")
        await orchestrator.start_rollout(spec("metrics-1.0.0"), rollout_id="metrics-1")  # beside it: allowed
        assert {r.id for r in store.rollouts(active_only=True)} == {"hello-1", "metrics-1"}
        refused = r"4 of its devices belong to an unfinished rollout: d0 \(.* in hello-1\)"
        with pytest.raises(RolloutError, match=refused):
            await orchestrator.start_rollout(spec("hello-1.1.0"), rollout_id="hello-2")
        described = APP.describe(bundles["hello-1.1.0"])
        assert described.lane == "hello"
        held = store.holders(devices, among=APP.holds_with(described.lane))
        assert {owner for owner, _ in held.values()} == {"hello-1"}  # what the dry run lists: not metrics-1
    finally:
        store.close()


async def test_a_bundle_that_would_fill_the_agents_disk_is_not_fetched_nor_installed(tmp_path: Path) -> None:
    """The download and the helper's install each keep room free on their disk (the agent's
    outbox shares it): a bundle that would leave less is refused in one line naming the room,
    and nothing of it is written."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from disks import Tmpfs

    from agent.core.clock import SystemClock
    from app_rollout.device.helper import AppHelper, AppRequest, encode

    key, _, _ = fleet_key(tmp_path / "keys")
    big = {"bin/server": ("#!/bin/sh\nsleep 9\n", 0o755)}
    src = app_dir(tmp_path / "hello", files=big)
    (src / "files" / "data").mkdir()
    (src / "files" / "data" / "blob").write_bytes(os.urandom(6 * 1024 * 1024))
    app = build_bundle(src, key, tmp_path / "hello.eaapp", chunks=False)
    size = (tmp_path / "hello.eaapp").stat().st_size
    with Tmpfs(tmp_path / "small", 16) as disk:
        with pytest.raises(AppInstallError) as refused:
            await fetch_bundle(["http://127.0.0.1:9/never-asked"], "0" * 64, size, disk.at / "downloads",
                               head=app.head, manifest=app.manifest, keep_free=12 * 1024 * 1024)
        said = str(refused.value)
        assert said.startswith("fetching application hello 1.0.0: 6.0 MiB to write,") and "\n" not in said
        assert f"free on {disk.at / 'downloads'} (of which 12 MiB stays free for the agent)" in said
        assert list((disk.at / "downloads").iterdir()) == []
        helper = AppHelper(key=key.public, root=disk.at / "apps", unit_dir=tmp_path / "units", hidden=(),
                           keep_free=8 * 1024 * 1024, clock=SystemClock())
        reply = await helper.handle(encode(AppRequest(op="install", path=str(tmp_path / "hello.eaapp"))), 0)
        assert not reply.ok and reply.error.startswith(f"install {tmp_path / 'hello.eaapp'}: 12.0 MiB to write")
        assert not [p for p in (disk.at / "apps").rglob("*") if not p.is_dir()]  # nothing written
        helper.keep_free = 1024 * 1024
        reply = await helper.handle(encode(AppRequest(op="install", path=str(tmp_path / "hello.eaapp"))), 0)
        assert reply.ok and reply.installed == "hello 1.0.0"  # with room, the same bundle goes in


def test_a_plan_refuses_a_version_every_device_would_refuse_and_warns_of_some(tmp_path: Path) -> None:
    """Devices take an application only forward: a bundle (or a removal) not above what every
    targeted device runs is refused at the plan, in one line saying how to go back; not above
    what some run, a warning naming how many."""
    from agent.core.clock import VirtualClock
    from agent.leader.registry import DeviceRegistry
    from agent.leader.rollout_plan import plan_rollout
    from agent.protocol import AppState, Heartbeat
    from app_rollout.bundle import build_removal
    from rollout_engine.spec import spec_from_dict

    key, _, _ = fleet_key(tmp_path / "keys")
    db = tmp_path / "leader.db"
    running = {"a": "2.0.0", "b": "2.0.0", "c": "1.0.0"}
    with DeviceRegistry.open(db, clock=VirtualClock()) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, apps={"hello": AppState(version=v)})
                              for d, v in running.items()])
    build_bundle(app_dir(tmp_path / "old", version="1.5.0"), key, tmp_path / "old.eaapp")
    build_removal("hello", "2.0.0", key, tmp_path / "gone.eaapp")

    def plan(artifact: Path, devices: list[str]):  # type: ignore[no-untyped-def]
        spec = spec_from_dict({"rollout": {"name": "t", "artifact": str(artifact), "kind": "app"},
                               "targets": {"select": "devices", "devices": devices},
                               "waves": {"canary": 0, "percents": [100.0]}})
        return plan_rollout(spec, APP.describe(artifact), db)

    with pytest.raises(RolloutError) as refused:
        plan(tmp_path / "old.eaapp", ["a", "b"])
    assert str(refused.value) == (f"{tmp_path / 'old.eaapp'} is application hello 1.5.0, not above what every"
                                  " targeted device runs (2.0.0): each would refuse it (an application goes"
                                  " forward: build the content again as a version above 2.0.0)")
    assert plan(tmp_path / "old.eaapp", ["a", "b", "c"]).warnings == [
        f"{tmp_path / 'old.eaapp'} is application hello 1.5.0, not above what 2 of the 3 targeted devices run:"
        " they will refuse it (failures that count against the rollout's gates)"]
    with pytest.raises(RolloutError, match="is the removal of application hello at 2.0.0, not above what every"):
        plan(tmp_path / "gone.eaapp", ["a", "b"])  # a removal goes forward too
    assert len(plan(tmp_path / "gone.eaapp", ["c"]).waves[0]) == 1  # 1.0.0 runs there: removed at 2.0.0
