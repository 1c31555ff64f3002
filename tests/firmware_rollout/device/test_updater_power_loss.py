"""Power loss at any point of an update: a new updater on the same state directory always ends
in `committed` or `rolled_back`, with the boot flags, the slots and the reports agreeing."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from fwhelpers import CountingSource, Device, Injector, Keys, PowerLoss, ScriptedHealth, make_artifact, make_keys
from hypothesis import event, given, settings
from hypothesis import strategies as st

from firmware_rollout.device.updater import Updater, UpdaterSettings
from firmware_rollout.messages import TERMINAL_STATES, UpdateOffer

MAX_BOOTS = 3


async def run_with_power_losses(
    root: Path, keys: Keys, artifact: Path, crash_points: list[int | None], health_ok: list[bool],
    device_type: type[Device] = Device,
) -> tuple[Device, str, list[list[str]]]:
    """Offer the update, then keep "booting" until the update ended. The i-th process lifetime
    loses power at its `crash_points[i]`-th side effect (None: runs to its natural end)."""
    device = device_type(root, keys, health=ScriptedHealth(*health_ok), settings=UpdaterSettings(max_boots=MAX_BOOTS))
    offered = False
    final = ""
    logs: list[list[str]] = []
    for lifetime in range(40):
        injector = Injector(crash_points[lifetime] if lifetime < len(crash_points) else None)
        logs.append(injector.log)
        source = CountingSource(artifact, injector)
        reboots = len(device.rebooter.reasons)
        updater: Updater | None = None
        try:
            updater = await device.boot(injector)
            if not offered:
                offered = True
                await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
            else:
                await updater.resume(source)
            state = updater.status().state
        except PowerLoss:
            if updater is not None:
                await updater.close()
            continue
        await updater.close()
        assert state != "idle"
        if len(device.rebooter.reasons) == reboots:  # the process was not restarted: it is at rest
            assert state in TERMINAL_STATES, f"at rest in a half state {state}"
            final = state
            break
    assert final, "the update never came to rest"
    return device, final, logs


def check_outcome(device: Device, final: str, image: bytes) -> None:
    installer = device.installer()
    assert installer.trial_slot() is None
    states = [r.state for r in device.sent]
    if final == "committed":
        assert installer.booted_slot() == installer.default_slot() == "b"
        assert (device.root / "slots" / "b" / "image").read_bytes() == image
        assert states[-1] == "succeeded" and "rolled_back" not in states
    else:
        assert final == "rolled_back"
        assert installer.booted_slot() == installer.default_slot() == "a"
        assert states[-1] == "rolled_back" and "succeeded" not in states
    assert not (device.root / "staging.img").exists()


async def test_power_loss_at_every_single_point(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing, size=3 * 1024)
    image = (tmp_path / "image-1.1.0-1.bin").read_bytes()
    _, final, clean = await run_with_power_losses(tmp_path / "clean", keys, artifact, [], [True])
    assert final == "committed"
    assert clean[0][-1] == "reboot" and clean[1] == ["health", "before commit", "after commit"]
    cut = 0
    for lifetime, log in enumerate(clean):
        for point in range(1, len(log) + 1):  # every side effect of every lifetime of a clean update
            points: list[int | None] = [None] * lifetime + [point]
            device, final, logs = await run_with_power_losses(tmp_path / f"p{cut}", keys, artifact, points, [True])
            assert logs[lifetime][-1] == log[point - 1]  # the power really went at that point
            check_outcome(device, final, image)
            assert final == "committed"  # one power loss never turns a good image into a rollback
            cut += 1
    assert cut == sum(len(log) for log in clean) >= 11


@settings(deadline=None, max_examples=60)
@given(
    crash_points=st.lists(st.one_of(st.none(), st.integers(1, 14)), max_size=8),
    health_ok=st.lists(st.booleans(), min_size=1, max_size=3),
)
def test_property_any_power_losses_end_committed_or_rolled_back(
    crash_points: list[int | None], health_ok: list[bool]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        keys = make_keys(root)
        artifact, _ = make_artifact(root, keys.signing, size=3 * 1024)
        image = (root / "image-1.1.0-1.bin").read_bytes()
        device, final, _ = asyncio.run(run_with_power_losses(root / "dev", keys, artifact, crash_points, health_ok))
        check_outcome(device, final, image)
        event(f"ended {final} after {len(device.rebooter.reasons)} reboots")
        health_checks = device.health.checks  # type: ignore[attr-defined]
        if final == "committed":  # only a passing health check commits
            assert health_ok[min(health_checks - 1, len(health_ok) - 1)]
