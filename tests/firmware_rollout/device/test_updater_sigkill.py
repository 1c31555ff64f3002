from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fwhelpers import CountingSource, Device, Keys, make_artifact, sigkill_after

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
