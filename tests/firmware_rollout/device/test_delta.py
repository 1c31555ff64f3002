"""Delta updates: a device copies every chunk its active slot already holds and downloads the rest."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from fwhelpers import CountingSource, Device, Keys

from firmware_rollout.artifact.files import ContentDefined, build_artifact
from firmware_rollout.artifact.manifest import SignedManifest
from firmware_rollout.device.slots import DirectoryInstaller, Installer
from firmware_rollout.device.updater import Updater
from firmware_rollout.errors import InstallError
from firmware_rollout.messages import UpdateOffer

SMALL = ContentDefined(min_size=1024, avg_size=4096, max_size=16384)


def _artifact(tmp: Path, keys: Keys, data: bytes, version: str) -> tuple[Path, SignedManifest]:
    image = tmp / f"image-{version}.bin"
    image.write_bytes(data)
    out = tmp / f"fw-{version}.eafw"
    signed = build_artifact(image, out, name="fw", version=version, key=keys.signing, created_ts=0,
                            content_defined=SMALL)
    return out, signed


def _versions() -> tuple[bytes, bytes]:
    rng = random.Random(11)
    v1 = rng.randbytes(300_000)
    # v2: a block rewritten, bytes inserted, a piece removed: most of the image is unchanged
    v2 = v1[:50_000] + rng.randbytes(6_000) + v1[56_000:200_000] + b"inserted" * 100 + v1[200_000:260_000]
    return v1, v2


async def _install(device: Device, updater: Updater, artifact: Path, rollout: str) -> CountingSource:
    source = CountingSource(artifact)
    offer = UpdateOffer(rollout_id=rollout, signed_manifest=source.signed_manifest)
    await updater.offer(offer, source)
    assert updater.status().state == "rebooting", updater.status()
    await updater.close()
    updater = await device.boot()
    assert (await updater.resume()).state == "committed"
    await updater.close()
    return source


async def test_a_device_with_v1_fetches_exactly_the_chunks_v2_does_not_share(tmp_path: Path, keys: Keys) -> None:
    v1, v2 = _versions()
    a1, s1 = _artifact(tmp_path, keys, v1, "1.1.0")
    a2, s2 = _artifact(tmp_path, keys, v2, "1.2.0")
    device = Device(tmp_path / "dev", keys)
    first = await _install(device, await device.boot(), a1, "r1")
    assert sorted(first.fetched) == list(range(s1.manifest.chunk_count))  # nothing to copy from a factory image

    updater = await device.boot()
    assert updater.active_version == "1.1.0"
    second = await _install(device, updater, a2, "r2")
    old = set(s1.manifest.chunks)
    missing = [i for i, digest in enumerate(s2.manifest.chunks) if digest not in old]
    assert 0 < len(missing) < s2.manifest.chunk_count / 4
    assert second.fetched == missing  # counted: only what v1 does not have went over the "network"
    assert second.planned == missing
    slot = device.root / "slots" / "a" / "image"  # v2 went into the slot v1 did not occupy
    assert slot.read_bytes() == v2
    progress = [r.progress for r in device.sent if r.rollout_id == "r2" and r.progress is not None]
    layout = s2.manifest.layout()
    assert progress[-1].bytes_to_fetch == sum(layout.length(i) for i in missing)
    assert progress[-1].bytes_fetched == progress[-1].bytes_to_fetch
    assert progress[-1].bytes_total == len(v2)


async def test_a_chunk_the_active_slot_holds_corrupted_is_downloaded_instead(tmp_path: Path, keys: Keys) -> None:
    v1, v2 = _versions()
    a1, s1 = _artifact(tmp_path, keys, v1, "1.1.0")
    a2, s2 = _artifact(tmp_path, keys, v2, "1.2.0")
    device = Device(tmp_path / "dev", keys)
    await _install(device, await device.boot(), a1, "r1")
    active = device.root / "slots" / "b" / "image"
    # a bad sector in the active slot, inside a chunk v2 shares with v1
    layout1 = s1.manifest.layout()
    shared = [i for i, d in enumerate(s1.manifest.chunks) if d in set(s2.manifest.chunks)]
    victim = shared[len(shared) // 2]
    fd = os.open(active, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x00" * 512, layout1.offset(victim) + 10)
    finally:
        os.close(fd)

    updater = await device.boot()
    second = await _install(device, updater, a2, "r2")
    old = set(s1.manifest.chunks)
    missing = [i for i, digest in enumerate(s2.manifest.chunks) if digest not in old]
    corrupted = [i for i, d in enumerate(s2.manifest.chunks) if d == s1.manifest.chunks[victim]]
    assert corrupted and set(second.fetched) == set(missing) | set(corrupted)  # detected, not copied
    assert (device.root / "slots" / "a" / "image").read_bytes() == v2


class _Unreadable(DirectoryInstaller):
    """A backend (or a helper) that cannot read its slots back, as a RAUC bundle slot."""

    async def read_slot(self, slot: str, offset: int, length: int) -> bytes:
        raise InstallError(f"cannot read slot {slot} here")


class _UnreadableDevice(Device):
    def installer(self) -> Installer:
        return _Unreadable(self.root / "slots", clock=self.clock)


async def test_a_slot_that_cannot_be_read_plans_no_delta(tmp_path: Path, keys: Keys,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The plan a device reports is the download it makes: when the active slot cannot be read
    no chunk is counted as copied (before, the plan said a delta and every chunk came anyway)."""
    v1, v2 = _versions()
    a1, _ = _artifact(tmp_path, keys, v1, "1.1.0")
    a2, s2 = _artifact(tmp_path, keys, v2, "1.2.0")
    device = _UnreadableDevice(tmp_path / "dev", keys)
    await _install(device, await device.boot(), a1, "r1")
    second = await _install(device, await device.boot(), a2, "r2")
    assert sorted(second.fetched) == list(range(s2.manifest.chunk_count))
    progress = [r.progress for r in device.sent if r.rollout_id == "r2" and r.progress is not None]
    assert progress[-1].bytes_to_fetch == progress[-1].bytes_total == len(v2)
    assert "no delta: slot b cannot be read (cannot read slot b here)" in caplog.text
