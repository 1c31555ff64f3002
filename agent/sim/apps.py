"""What a simulated device swaps for its applications' hardware: the service manager and the mirror.

Each simulated device runs the real application module and the real application helper
(`app_rollout.device`) on its own files (`apps/` under the device's folder): the signature and
every file checked, each version unpacked beside the running one, the trial, the commit or the
revert and their records. Two seams are swapped:

* the service manager (`SimServiceManager`): the unit the helper writes is "started" at once; a
  version named `unhealthy` fails (its process exits, systemd gives up) on the devices of
  `failing`, and runs on every other;
* the mirror (`sim_fetch`): the bundle is copied from the leader's artifact store, the files the
  device runs already counted as reused, as `fetch_bundle` would.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.core.clock import Clock
from agent.worker.agent import WorkerAgent
from app_rollout.bundle import AppManifest, read_bundle
from app_rollout.device.client import InProcessHelper
from app_rollout.device.fetch import Fetched, Reuse
from app_rollout.device.helper import AppHelper
from app_rollout.device.module import AppHelperPort, Fetch
from app_rollout.device.systemd import Systemd, UnitState
from app_rollout.errors import AppInstallError
from rollout_engine.keys import Verifier


@dataclass(frozen=True)
class SimApps:
    """A fleet whose devices run applications: the version `unhealthy` fails its health check on
    the devices of `failing`; every device runs `preinstalled` (a bundle) before the rollout."""

    failing: frozenset[str] = frozenset()
    unhealthy: str = ""
    preinstalled: Path | None = None


class SimServiceManager(Systemd):
    """systemd as the helper asks it, for one simulated device: the unit's version is read from
    the unit file the helper wrote (its first line names it)."""

    def __init__(self, unit_dir: Path, *, fails: Callable[[str], bool]) -> None:
        self.unit_dir = unit_dir
        self.fails = fails  # version -> whether its process exits at once on this device
        self.running: dict[str, str] = {}  # unit -> the version started (a restarted agent: what its units say)
        for unit in unit_dir.glob("edge-app-*.service"):
            self.running[unit.name] = self._version(unit.name)

    def _version(self, unit: str) -> str:
        head = (self.unit_dir / unit).read_text().split("\n", 1)[0]  # "# edge-app-N.service: application N V, ..."
        return head.split(",", 1)[0].rsplit(" ", 1)[-1]

    async def reload(self) -> None:
        """(Nothing to reload: the unit is read when it is started.)"""

    async def restart(self, unit: str) -> None:
        self.running[unit] = self._version(unit)

    async def stop(self, unit: str) -> None:
        self.running.pop(unit, None)

    async def state(self, unit: str) -> UnitState:
        version = self.running.get(unit)
        if version is None:
            return UnitState("inactive", "dead", 0, 0, "success")
        if self.fails(version):
            return UnitState("failed", "failed", 5, 0, "exit-code", 1)
        return UnitState("active", "running", 0, 1, "success")

    async def run_as(self, name: str, argv: list[str], *, directory: str, timeout_s: float,
                     hidden: tuple[str, ...] = ()) -> tuple[int, str]:
        version = self.running.get(f"edge-app-{name}.service", "")
        return (1, "simulated failure") if self.fails(version) else (0, "")


def sim_fetch(artifacts: Callable[[], Path]) -> Fetch:
    """A device's fetch from the leader's artifact store (`artifacts()`: the directory of the
    leader running the rollouts)."""

    async def fetch(mirrors: Sequence[str], digest: str, size: int, directory: Path, *, head: bytes,
                    manifest: AppManifest, reuse: Reuse | None = None, timeout_s: float = 10.0,
                    ca: str = "") -> Fetched:
        source = artifacts() / f"{digest}.eaapp"
        if not source.is_file() or source.stat().st_size != size:
            raise AppInstallError(f"no mirror served the bundle: {source.name} is not in the leader's store")
        directory.mkdir(parents=True, exist_ok=True)
        done = directory / source.name
        shutil.copyfile(source, done)
        reused = sum(end - start for start, end, held in (reuse or Reuse.none()).segments(manifest, 0) if held)
        return Fetched(done, size - len(head) - reused, reused)

    return fetch


def device_helper(apps: SimApps, key: Verifier, base: Path, device: str, clock: Clock) -> InProcessHelper:
    """The application helper of the simulated device `device` whose folder is `base`."""
    manager = SimServiceManager(base / "units", fails=lambda v: device in apps.failing and v == apps.unhealthy)
    helper = AppHelper(key=key, root=base / "apps", unit_dir=base / "units", hidden=(), systemd=manager,
                       durable=False, clock=clock)
    return InProcessHelper(helper, clock=clock)


async def preinstall(apps: SimApps, key: Verifier, base: Path, device: str, clock: Clock) -> None:
    """`apps.preinstalled` installed, started and committed on the device, as before a rollout."""
    if apps.preinstalled is None:
        return
    (base / "units").mkdir(parents=True, exist_ok=True)
    helper = device_helper(apps, key, base, device, clock)
    app = read_bundle(apps.preinstalled, key)
    await helper.ask("install", path=str(apps.preinstalled))
    await helper.ask("start", app.name, version=app.version)
    await helper.ask("commit", app.name)


def sim_app_hardware(apps: SimApps, key: Verifier, artifacts: Callable[[], Path]
                     ) -> Callable[[WorkerAgent], tuple[AppHelperPort, Fetch]]:
    """`DeviceEnv.apps_hardware` of a simulated fleet: each device's own helper on its own files."""

    def hardware(worker: WorkerAgent) -> tuple[AppHelperPort, Fetch]:
        (Path(worker.data_dir) / "units").mkdir(parents=True, exist_ok=True)
        return (device_helper(apps, key, Path(worker.data_dir), worker.device_id, worker.clock),
                sim_fetch(artifacts))

    return hardware


__all__ = ["SimApps", "SimServiceManager", "device_helper", "preinstall", "sim_app_hardware", "sim_fetch"]
