"""Child process for test_updater_sigkill: takes an update offer and downloads it slowly,
appending each chunk index to a log before fetching it, until the parent SIGKILLs it.

    python update_child.py STATE_DIR ARTIFACT PUBLIC_PEM FETCH_LOG [FW_ENV_CONFIG SLOT_A SLOT_B CMDLINE]

With the last four, the slots are a U-Boot board's (`UBootInstaller`), else directories. With
EA_TEST_MIRROR set to a mirror's URL, the chunks come from that HTTP mirror (range requests).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fwhelpers

from fwhelpers import RecordingRebooter, ScriptedHealth

from agent.core.clock import SystemClock
from firmware_rollout.device.http_source import MirrorSource, make_client
from firmware_rollout.device.sources import ArtifactChunkSource, ChunkSource
from firmware_rollout.device.uboot import UBootInstaller
from firmware_rollout.device.updater import Updater
from firmware_rollout.messages import UpdateOffer
from rollout_engine.keys import load_verify_key


class SlowLoggingSource:
    def __init__(self, artifact: Path, log: Path) -> None:
        self.local = ArtifactChunkSource(artifact)
        self.inner: ChunkSource = self.local
        mirror = os.environ.get("EA_TEST_MIRROR")
        if mirror:
            manifest = self.local.signed.manifest
            self.inner = MirrorSource(make_client(), mirror, manifest, manifest.layout(), max_run_bytes=64 * 1024)
        self.log = log.open("a", buffering=1)

    @property
    def signed_manifest(self) -> bytes:
        return self.local.signed_manifest

    def plan(self, indices: Sequence[int]) -> None:
        self.inner.plan(indices)

    async def fetch(self, index: int) -> bytes:
        self.log.write(f"{index}\n")
        await asyncio.sleep(0.01)
        return await self.inner.fetch(index)


async def main(state_dir: Path, artifact: Path, public_pem: Path, log: Path, *board: Path) -> None:
    source = SlowLoggingSource(artifact, log)
    key = load_verify_key(public_pem)
    installer = None
    if board:
        env, slot_a, slot_b, cmdline = board
        installer = UBootInstaller(fw_env_config=env, slot_a=slot_a, slot_b=slot_b, cmdline_path=cmdline,
                                   verify_key=key)
    updater = await Updater.open(
        state_dir, device_id="child", verify_key=key, clock=SystemClock(), installer=installer,
        health=ScriptedHealth(True), rebooter=RecordingRebooter(), initial_version="1.0.0",
    )  # fmt: skip
    offer = UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest)
    await updater.offer(offer, source)
    await updater.close()


if __name__ == "__main__":
    asyncio.run(main(*map(Path, sys.argv[1:])))
