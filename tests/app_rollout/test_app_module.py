"""The application module on a device, over the in-process helper (systemctl's answers recorded):
a signed removal rolled out stops the application and leaves the heartbeat; a device that does
not run it answers at once; a removal of another key is rejected before anything; a trial a
release holds stays on trial across a start until the release settles it."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from apps_support import app_dir, fleet_key
from holds import Word
from test_app_helper import RecordingSystemd

from agent.core.clock import SystemClock
from app_rollout.bundle import AppManifest, build_bundle, build_removal, read_head
from app_rollout.device.client import InProcessHelper
from app_rollout.device.fetch import Fetched, Reuse
from app_rollout.device.helper import AppHelper
from app_rollout.device.module import AppModule
from app_rollout.messages import AppOffer
from rollout_engine.device import Rejected

Said = tuple[str, str, str, str]


def local_fetch(store: Path):  # type: ignore[no-untyped-def]
    async def fetch(mirrors: Sequence[str], digest: str, size: int, directory: Path, *, head: bytes,
                    manifest: AppManifest, reuse: Reuse | None = None, timeout_s: float = 10.0,
                    ca: str = "") -> Fetched:
        directory.mkdir(parents=True, exist_ok=True)
        done = directory / f"{digest}.eaapp"
        shutil.copyfile(store / f"{digest}.eaapp", done)
        return Fetched(done, size - len(head))

    return fetch


async def test_a_signed_removal_stops_the_application_and_it_leaves_the_heartbeat(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    store = tmp_path / "store"
    store.mkdir()
    helper = AppHelper(key=key.public, root=tmp_path / "apps", unit_dir=tmp_path / "units", hidden=(),
                       systemd=RecordingSystemd(), durable=False)
    clock = SystemClock()
    module = AppModule(InProcessHelper(helper, clock=clock), key=key.public, state_dir=tmp_path / "state",
                       clock=clock, fetch=local_fetch(store))
    said: list[Said] = []

    async def report(rollout_id: str, version: str, state: str, phase: str, detail: str, *,
                     until_ms: int = 0) -> None:
        said.append((rollout_id, state, phase, detail))

    def offer(rid: str, path: Path) -> AppOffer:
        digest = f"{len(said):064x}"
        shutil.copyfile(path, store / f"{digest}.eaapp")
        return AppOffer(rollout_id=rid, head=read_head(path), bundle=digest, size=path.stat().st_size)

    built = tmp_path / "hello-1.0.0.eaapp"
    build_bundle(app_dir(tmp_path / "hello", health='check = "active"\nsettle_s = 0\ntimeout_s = 30'), key, built)
    first = offer("r1", built)
    await module.apply(first, module.check(first), report)
    assert said[-1][:3] == ("r1", "succeeded", "running") and module.states() is not None
    assert set(module.states() or {}) == {"hello"}
    removal = build_removal("hello", "2.0.0", key, tmp_path / "hello-removed-2.0.0.eaapp")
    gone = offer("r2", tmp_path / "hello-removed-2.0.0.eaapp")
    await module.apply(gone, module.check(gone), report)
    assert said[-1] == ("r2", "succeeded", "removed", "hello 1.0.0 stopped and removed (its data kept in"
                                                      " /var/lib/edge-apps/hello)")
    assert removal.manifest.runtime == "removed"
    await module.helper.records()
    assert module.states() == {}  # the heartbeat no longer names it
    again = offer("r3", tmp_path / "hello-removed-2.0.0.eaapp")
    await module.apply(again, module.check(again), report)
    assert said[-1] == ("r3", "succeeded", "removed", "hello is removed at 2.0.0 here: nothing to remove")
    build_removal("other", "1.0.0", key, tmp_path / "other-removed.eaapp")
    never = offer("r4", tmp_path / "other-removed.eaapp")
    await module.apply(never, module.check(never), report)
    assert said[-1] == ("r4", "succeeded", "removed", "other is not installed here: nothing to remove")
    build_removal("hello", "9.0.0", fleet_key(tmp_path / "other-keys")[0], tmp_path / "forged.eaapp")
    forged = offer("r5", tmp_path / "forged.eaapp")
    with pytest.raises(Rejected, match="not the fleet's key"):
        module.check(forged)


async def test_a_held_application_stays_on_trial_across_a_start_until_its_release_settles(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    store = tmp_path / "store"
    store.mkdir()
    helper = AppHelper(key=key.public, root=tmp_path / "apps", unit_dir=tmp_path / "units", hidden=(),
                       systemd=RecordingSystemd(), durable=False)
    clock = SystemClock()

    def module() -> AppModule:
        return AppModule(InProcessHelper(helper, clock=clock), key=key.public, state_dir=tmp_path / "state",
                         clock=clock, fetch=local_fetch(store))

    said: list[tuple[str, str, str]] = []

    async def report(rollout_id: str, version: str, state: str, phase: str, detail: str, *,
                     until_ms: int = 0) -> None:
        said.append((state, phase, detail))

    def offer(rid: str, version: str) -> AppOffer:
        built = tmp_path / f"hello-{version}.eaapp"
        build_bundle(app_dir(tmp_path / f"hello-{version}", version=version,
                             health='check = "active"\nsettle_s = 0\ntimeout_s = 30'), key, built, force=True)
        digest = f"{len(said) + 1:064x}"
        shutil.copyfile(built, store / f"{digest}.eaapp")
        return AppOffer(rollout_id=rid, head=read_head(built), bundle=digest, size=built.stat().st_size)

    first, apps = offer("r1", "1.0.0"), module()
    await apps.apply(first, apps.check(first), report)
    assert said[-1][:2] == ("succeeded", "running")
    for commit in (False, True):
        hold = Word()
        held = offer("r2", "2.0.0")
        apps = module()
        applying = asyncio.ensure_future(apps.apply(held, apps.check(held), report, hold=hold))
        await hold.asked.wait()
        assert said[-1][:2] == ("verifying", "held") and apps.held() == {"hello": "2.0.0"}
        started = module()  # the agent's next start: the trial is the release's to settle
        await started.resume(report)
        assert helper.record("hello").trial == "2.0.0" and started.held() == {"hello": "2.0.0"}
        applying.cancel()
        assert await started.settle_held("hello", commit=commit) == ""
        record = helper.record("hello")
        assert (record.current, record.trial) == (("2.0.0", "") if commit else ("1.0.0", ""))
        assert started.held() == {}
        shutil.rmtree(tmp_path / "hello-2.0.0")
