from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from fwhelpers import CountingSource, Device, Keys, make_artifact, sigkill_after
from nginx_mirror import NginxMirror

from firmware_rollout.device.http_source import MirrorSource, make_client

CHILD = Path(__file__).with_name("update_child.py")
ROOT = Path(__file__).parents[3]


@pytest.mark.slow
async def test_download_resumes_from_the_last_good_chunk_after_sigkill(tmp_path: Path, keys: Keys) -> None:
    chunks = 200
    artifact, signed = make_artifact(tmp_path, keys.signing, size=chunks * 1024 - 17)
    state_dir, log = tmp_path / "dev", tmp_path / "fetches.log"
    sigkill_after([sys.executable, str(CHILD), str(state_dir), str(artifact), str(keys.public_path), str(log)],
                  log, 25, cwd=ROOT)
    before = [int(i) for i in log.read_text().split()]
    assert before == list(range(len(before))) and len(before) < chunks

    device = Device(state_dir, keys)
    updater = await device.boot()
    status = updater.status()
    assert status.state == "downloading"
    # Every chunk fetched before the one in flight was fsynced and recorded.
    done = status.chunks_done
    assert len(before) - 1 <= done <= len(before)
    source = CountingSource(artifact)
    status = await updater.resume(source)
    assert status.state == "rebooting" and device.rebooter.reasons
    assert source.fetched == list(range(done, chunks))  # resumed at the first chunk not on disk
    assert len(before) + len(source.fetched) <= signed.manifest.chunk_count + 1

    updater = await device.boot()
    assert (await updater.resume()).state == "committed"
    await updater.close()
    image = (tmp_path / "image-1.1.0-1.bin").read_bytes()
    assert (state_dir / "slots" / "b" / "image").read_bytes() == image


@pytest.mark.slow
async def test_a_reboot_mid_download_from_a_mirror_resumes_from_the_last_verified_chunk(
        tmp_path: Path, keys: Keys, nginx: Callable[[], NginxMirror], monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = 200
    artifact, signed = make_artifact(tmp_path, keys.signing, size=chunks * 1024 - 17)
    mirror = nginx()
    (mirror.www / f"{signed.manifest.sha256.hex()}.eafw").write_bytes(artifact.read_bytes())
    monkeypatch.setenv("EA_TEST_MIRROR", mirror.url)
    state_dir, log = tmp_path / "dev", tmp_path / "fetches.log"
    sigkill_after([sys.executable, str(CHILD), str(state_dir), str(artifact), str(keys.public_path), str(log)],
                  log, 25, cwd=ROOT)
    device = Device(state_dir, keys)
    updater = await device.boot()
    status = updater.status()
    assert status.state == "downloading" and status.mirrors == ()  # the child's offer named none
    done = status.chunks_done
    assert 20 <= done < chunks
    served_before = len(mirror.requests())
    manifest = signed.manifest
    async with make_client() as client:
        source = MirrorSource(client, mirror.url, manifest, manifest.layout(), max_run_bytes=64 * 1024)
        status = await updater.resume(source)
        await source.close()
    assert status.state == "rebooting"
    status_code, _, first = mirror.requests()[served_before + 1]  # after the header: the first image range
    assert status_code == 206 and first.startswith(f"bytes={signed.size + done * 1024}-")
    await updater.close()
    assert (state_dir / "slots" / "b" / "image").read_bytes() == (tmp_path / "image-1.1.0-1.bin").read_bytes()
