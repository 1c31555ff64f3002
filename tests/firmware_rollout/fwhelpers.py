"""Shared helpers of the firmware tests (imported by name: the test dirs are not packages)."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.core.clock import Clock, SystemClock
from firmware_rollout.artifact.files import build_artifact
from firmware_rollout.artifact.manifest import SignedManifest
from firmware_rollout.device.health import HealthCheck, HealthResult
from firmware_rollout.device.slots import DirectoryInstaller, Installer, SlotView
from firmware_rollout.device.sources import ArtifactChunkSource
from firmware_rollout.device.updater import Updater, UpdaterSettings
from rollout_engine.keys import SigningKey, VerifyKey, generate_keypair, load_signing_key, load_verify_key
from rollout_engine.messages import RolloutReport

CHUNK = 1024


@dataclass
class Keys:
    dir: Path
    private_path: Path
    public_path: Path
    signing: SigningKey
    verify: VerifyKey


def make_keys(tmp_path: Path) -> Keys:
    paths = generate_keypair(tmp_path / "keys")
    return Keys(
        tmp_path / "keys", paths.private, paths.public, load_signing_key(paths.private), load_verify_key(paths.public)
    )


def make_image(path: Path, size: int, seed: int = 1) -> Path:
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def make_artifact(
    tmp_path: Path,
    key: SigningKey | None,
    *,
    version: str = "1.1.0",
    size: int = 5 * CHUNK + 100,
    seed: int = 1,
    name: str = "fw",
    **kwargs: object,
) -> tuple[Path, SignedManifest]:
    image = make_image(tmp_path / f"image-{version}-{seed}.bin", size, seed)
    out = tmp_path / f"fw-{version}-{seed}.eafw"
    signed = build_artifact(
        image, out, name=name, version=version, key=key, created_ts=1_700_000_000_000, chunk_size=CHUNK, **kwargs
    )  # type: ignore[arg-type]
    return out, signed


# -- device harness for the updater tests ------------------------------------------------------
class PowerLoss(BaseException):
    """Raised by the crash injector: the process dies here, nothing after it runs."""


class Injector:
    """Counts side-effect calls (fetch, slot writes, boot flags, health, reboot) and raises
    `PowerLoss` at call number `crash_at` (never when None)."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.crash_at = crash_at
        self.calls = 0
        self.log: list[str] = []

    def tick(self, what: str) -> None:
        self.calls += 1
        self.log.append(what)
        if self.crash_at is not None and self.calls == self.crash_at:
            raise PowerLoss(what)


class CrashingInstaller:
    """A DirectoryInstaller whose every durable call may be cut short by a power loss, before
    or after the call takes effect."""

    def __init__(self, inner: Installer, injector: Injector) -> None:
        self.inner = inner
        self.injector = injector

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def slots(self) -> tuple[str, str]:
        return self.inner.slots

    def fell_back(self) -> bool:
        return self.inner.fell_back()

    def describe(self) -> SlotView:
        return self.inner.describe()

    def booted_slot(self) -> str:
        return self.inner.booted_slot()

    def default_slot(self) -> str:
        return self.inner.default_slot()

    def trial_slot(self) -> str | None:
        return self.inner.trial_slot()

    async def _call(self, name: str, coro: Awaitable[None]) -> None:
        try:
            self.injector.tick(f"before {name}")
        except PowerLoss:
            coro.close()  # type: ignore[attr-defined]
            raise
        await coro
        self.injector.tick(f"after {name}")

    async def open_slot(self, slot: str, signed_manifest: bytes) -> None:
        await self._call("open_slot", self.inner.open_slot(slot, signed_manifest))

    async def write_chunk(self, slot: str, index: int, data: bytes) -> None:
        await self._call("write_chunk", self.inner.write_chunk(slot, index, data))

    async def check_slot(self, slot: str) -> None:
        await self._call("check_slot", self.inner.check_slot(slot))

    async def read_slot(self, slot: str, offset: int, length: int) -> bytes:
        return await self.inner.read_slot(slot, offset, length)

    async def mark_trial(self, slot: str) -> None:
        await self._call("mark_trial", self.inner.mark_trial(slot))

    async def commit(self, slot: str) -> None:
        await self._call("commit", self.inner.commit(slot))

    async def revert(self, slot: str) -> None:
        await self._call("revert", self.inner.revert(slot))


class CountingSource:
    """Serves an artifact's chunks; counts fetches; can tamper with or fail chosen chunks."""

    def __init__(
        self,
        artifact: Path,
        injector: Injector | None = None,
        *,
        tamper: int | None = None,
        failures: dict[int, list[BaseException]] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.inner = ArtifactChunkSource(artifact, clock=clock)  # the clock must see its thread work
        self.injector = injector
        self.tamper = tamper
        self.failures = failures or {}
        self.fetched: list[int] = []

    @property
    def signed_manifest(self) -> bytes:
        return self.inner.signed_manifest

    def plan(self, indices: Sequence[int]) -> None:
        self.planned = list(indices)

    async def fetch(self, index: int) -> bytes:
        if self.injector is not None:
            self.injector.tick(f"fetch {index}")
        self.fetched.append(index)
        pending = self.failures.get(index)
        if pending:
            raise pending.pop(0)
        data = await self.inner.fetch(index)
        if index == self.tamper:
            data = bytes([data[0] ^ 1]) + data[1:]
        return data


class ScriptedHealth:
    """Health results in order (the last repeats); ticks the injector before each check."""

    def __init__(self, *results: bool, injector: Injector | None = None) -> None:
        self.results = list(results) or [True]
        self.injector = injector
        self.checks = 0

    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        if self.injector is not None:
            self.injector.tick("health")
        ok = self.results[min(self.checks, len(self.results) - 1)]
        self.checks += 1
        return HealthResult(ok, "all good" if ok else "leader not reached")


class RecordingRebooter:
    def __init__(self, injector: Injector | None = None) -> None:
        self.reasons: list[str] = []
        self.trials: list[bool] = []  # whether each reboot asked for the trial slot
        self.injector = injector

    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        if self.injector is not None:
            self.injector.tick("reboot")
        self.reasons.append(reason)
        self.trials.append(trial)


class Device:
    """One simulated device: a state directory that survives "boots" (new Updater objects)."""

    def __init__(
        self,
        root: Path,
        keys: Keys,
        *,
        clock: Clock | None = None,
        initial_version: str = "1.0.0",
        hardware: str | None = "rpi4",
        settings: UpdaterSettings | None = None,
        health: HealthCheck | None = None,
        image: str | None = None,
    ) -> None:
        self.root = root
        self.image = image
        self.keys = keys
        self.clock = clock or SystemClock()
        self.initial_version = initial_version
        self.hardware = hardware
        self.settings = settings
        self.health: HealthCheck = health or ScriptedHealth(True)
        self.rebooter = RecordingRebooter()
        self.sent: list[RolloutReport] = []
        self.on_sent: Callable[[RolloutReport], None] | None = None

    async def sink(self, report: RolloutReport) -> None:
        if self.on_sent is not None:
            self.on_sent(report)
        self.sent.append(report)

    def installer(self) -> Installer:
        """The installer of this boot (a real bootloader runs before it: see the U-Boot tests)."""
        return DirectoryInstaller(self.root / "slots", clock=self.clock)

    async def boot(self, injector: Injector | None = None) -> Updater:
        installer: Installer = self.installer()
        if injector is not None:
            installer = CrashingInstaller(installer, injector)
            self.rebooter.injector = injector
            if isinstance(self.health, ScriptedHealth):
                self.health.injector = injector
        return await Updater.open(
            self.root,
            device_id="dev-1",
            verify_key=self.keys.verify,
            clock=self.clock,
            health=self.health,
            rebooter=self.rebooter,
            installer=installer,
            hardware=self.hardware,
            initial_version=self.initial_version,
            settings=self.settings,
            on_report=self.sink,
            image=self.image,
        )

    def states(self) -> list[str]:
        """The phases the device reported, each once per run of it (the progress reports of a
        download repeat `downloading`)."""
        out: list[str] = []
        for r in self.sent:
            if r.progress is not None and out and out[-1] == r.phase:
                continue
            out.append(r.phase)
        return out

    def progress(self) -> list[tuple[int, int]]:
        """(chunks done, chunks in all) of each progress report sent."""
        return [(r.progress.chunks_done, r.progress.chunks_total) for r in self.sent if r.progress is not None]


async def stream_into(installer: Installer, slot: str, artifact: Path) -> None:
    """Write an artifact's image into `slot` the way the updater does: open, every chunk, check."""
    from firmware_rollout.artifact.files import read_image_chunk, read_signed_manifest

    signed = read_signed_manifest(artifact)
    await installer.open_slot(slot, signed.raw)
    for index in range(signed.manifest.chunk_count):
        await installer.write_chunk(slot, index, read_image_chunk(artifact, signed, index))
    await installer.check_slot(slot)


def sigkill_after(argv: list[str], log: Path, lines: int, *, cwd: Path) -> None:
    """Run `argv` (a child that appends a line to `log` per chunk it fetches) and SIGKILL it once
    `log` holds `lines` lines: the power goes mid-download."""
    import os
    import signal
    import subprocess
    import time

    child = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(cwd)})
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and len(log.read_text().split()) >= lines):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never got going"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
