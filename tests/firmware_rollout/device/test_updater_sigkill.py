from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fwhelpers import CountingSource, Device, Keys, make_artifact

CHILD = Path(__file__).with_name("update_child.py")
ROOT = Path(__file__).parents[3]


@pytest.mark.slow
async def test_download_resumes_from_the_last_good_chunk_after_sigkill(tmp_path: Path, keys: Keys) -> None:
    chunks = 200
    artifact, signed = make_artifact(tmp_path, keys.signing, size=chunks * 1024 - 17)
    state_dir, log = tmp_path / "dev", tmp_path / "fetches.log"
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(state_dir), str(artifact), str(keys.public_path), str(log)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and len(log.read_text().split()) >= 25):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never got going"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
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
