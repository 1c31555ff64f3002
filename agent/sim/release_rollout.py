"""The `release-rollout` scenario: one signed release of a device's whole desired state (firmware,
configuration, an application) rolled out in waves to real workers, on some of which its
application fails its health check.

    report = await release_rollout_scenario(devices=100, seed=7, fail_rate=0.1, work_dir=tmp)

Every device runs release R1: firmware 1.0.0, its `app` target's factory document, and `hello`
1.0.0 (installed, started and committed before the rollout through its own application helper).
The leader rolls release R2 out as a `kind = "release"` rollout: firmware 1.1.0, config `app`
1.1.0 and `hello` 2.0.0, in that order (a canary of 5%, then 30% / 35% / the rest; success gate
95%, failure threshold 5% after 10 finished, abort). Each device installs the firmware and boots
it on trial; the config and the application converge on that trial boot and are held; all
healthy, the firmware is committed and then the others. On `fail_rate` of the devices (chosen by
the seed) hello 2.0.0's process exits at once: every part returns to R1, the firmware included
(its trial boot is not committed), and the gates abort the rollout. The report counts the
outcomes and what every device runs at the end, by release: R1 or R2 whole, never a mix, nothing
held. The same seed gives the same report (but for `wall`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.core.errors import ConfigError
from agent.sim.app_rollout import APP, hello_bundle, pick_failing
from agent.sim.apps import SimApps, preinstall
from agent.sim.config_rollout import NEW_DOCUMENT, fleet_key
from agent.sim.devices import SimConfigTargets, SimFirmware, default_updater_settings
from agent.sim.options import SimOptions
from agent.sim.report import Report
from agent.sim.rollout import STEP_S, RolloutSimulation, device_ids, outcome_lines, wave_lines
from app_rollout.bundle import peek_head, read_head
from config_rollout.release import build_release
from firmware_rollout.artifact.files import read_signed_manifest
from firmware_rollout.artifact.fixture import make_artifact
from release_rollout.build import file_digest
from release_rollout.document import SUFFIX, Part, build_document
from rollout_engine.keys import SigningKey
from rollout_engine.spec import spec_from_dict
from rollout_engine.status import describe

FIRMWARE_NEW = "1.1.0"
CONFIG_NEW = "1.1.0"
APP_OLD, APP_NEW = "1.0.0", "2.0.0"
RELEASE_NAME, RELEASE_VERSION = "gateway", "2.0.0"
HEALTH_TIMEOUT_S = 180.0  # the trial boot's: the config's confirm and the application's settle fit in it


def default_release_spec(document: Path, *, seed: int, devices: int) -> dict[str, Any]:
    return {
        "rollout": {"name": f"release {RELEASE_NAME} {RELEASE_VERSION}", "kind": "release",
                    "artifact": str(document), "seed": seed},
        "targets": {"select": "all"},
        "waves": {"canary": max(1, devices // 20), "percents": [30.0, 35.0, 35.0]},
        "gates": {"success_threshold_pct": 95.0, "failure_threshold_pct": 5.0, "min_finished": 10,
                  "failure_action": "abort"},
        "device": {"timeout_s": 900.0, "retries": 0},
    }


def release_files(workdir: Path, key: SigningKey, *, seed: int) -> tuple[Path, Path]:
    """R2 as a release folder: the firmware, the config release, the bundle and the signed
    document naming them (its path), and the bundle R1 runs."""
    folder = workdir / "release"
    (workdir / "firmware" / "keys").mkdir(parents=True, exist_ok=True)
    (workdir / "firmware" / "keys" / "private.pem").write_bytes(key.to_pem())  # (the fleet's key signs it)
    built, _ = make_artifact(workdir / "firmware", version=FIRMWARE_NEW, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    firmware = folder / built.name
    built.replace(firmware)
    (workdir / "config").mkdir(exist_ok=True)
    (workdir / "config" / "app.toml").write_bytes(NEW_DOCUMENT)
    config = folder / f"app-{CONFIG_NEW}.eacfg"
    config.write_bytes(build_release("app", CONFIG_NEW, [workdir / "config" / "app.toml"], key, created_ms=0))
    old = hello_bundle(workdir, APP_OLD, key)
    bundle = folder / f"{APP}-{APP_NEW}.eaapp"
    hello_bundle(workdir, APP_NEW, key).replace(bundle)
    fw = read_signed_manifest(firmware).manifest
    parts = [Part(kind="firmware", name=fw.name, version=fw.version, file=firmware.name,
                  sha256=file_digest(firmware), size=firmware.stat().st_size),
             Part(kind="config", name="app", version=CONFIG_NEW, file=config.name, sha256=file_digest(config),
                  size=config.stat().st_size),
             Part(kind="app", name=APP, version=peek_head(read_head(bundle)).version, file=bundle.name,
                  sha256=file_digest(bundle), size=bundle.stat().st_size)]
    document = folder / f"{RELEASE_NAME}-{RELEASE_VERSION}{SUFFIX}"
    document.write_bytes(build_document(RELEASE_NAME, RELEASE_VERSION, parts, key, created_ms=0))
    return document, old


class ReleaseRolloutSimulation(RolloutSimulation):
    """The wave engine's run with a release instead of an image (see the module docstring)."""

    ROLLOUT_ID = "release-rollout"

    def __init__(self, opts: SimOptions, *, workdir: Path, apps: SimApps, fail_rate: float, **kwargs: Any) -> None:
        super().__init__(opts, workdir=workdir, failing=len(apps.failing), fail_rate=fail_rate, **kwargs)
        self.sim_apps = apps
        self.releases: dict[str, int] = {}
        self.held = 0
        self.mixed: dict[str, str] = {}

    async def _open(self) -> None:
        firmware = self.fleet.firmware
        assert firmware is not None
        for device in device_ids(self.opts.devices):  # each device runs hello 1.0.0 before the rollout
            await preinstall(self.sim_apps, firmware.verify_key, self.fleet.device_dir(device), device, self.clock)
        await super()._open()

    async def _mission(self) -> None:
        await super()._mission()
        await self._run_until(self.now() + 2 * STEP_S, stop_when=lambda: False, step_s=STEP_S)

    def _runs(self, device: str) -> tuple[str, str, str, bool]:
        """(firmware, config, application) a device runs, and whether anything is held or on trial."""
        directory = self.fleet.device_dir(device)
        record = json.loads((directory / "apps" / APP / "record.json").read_bytes())
        document = (directory / "etc" / "app" / "app.toml").read_bytes()
        journal_path = directory / "config" / "app" / "journal.json"
        journal = json.loads(journal_path.read_bytes()) if journal_path.exists() else {}
        config = "1.1.0" if document == NEW_DOCUMENT else "factory" if journal.get("version", "") == "" else "other"
        held = bool(record.get("trial")) or bool(journal.get("held"))
        return self.fleet.active_version(device), config, record.get("current", ""), held

    async def _before_stop(self) -> None:
        await super()._before_stop()
        firmware = self.fleet.firmware
        assert firmware is not None
        r1 = (firmware.base_version, "factory", APP_OLD)
        r2 = (FIRMWARE_NEW, CONFIG_NEW, APP_NEW)
        releases: dict[str, int] = {}
        for device in self.fleet.workers:
            fw, config, app, held = self._runs(device)
            runs = (fw, config, app)
            name = "R1" if runs == r1 else "R2" if runs == r2 else "mixed"
            if name == "mixed":
                self.mixed[device] = f"firmware {fw}, config {config}, {APP} {app}"
            releases[name] = releases.get(name, 0) + 1
            self.held += held
        self.releases = dict(sorted(releases.items()))

    async def _report(self, *, wall_s: float, cpu_s: float) -> Report:
        report = await super()._report(wall_s=wall_s, cpu_s=cpu_s)
        service = self.fleet.rollout
        assert service is not None and self.rollout_id is not None
        rows = {d.device_id: d for d in service.store.devices(self.rollout_id)}
        failing = sorted(self.sim_apps.failing)
        offered = [d for d in failing if d in rows and rows[d].state not in ("queued", "canceled")]
        named = [d for d in offered if f"app:{APP} failed" in rows[d].detail]
        status = describe(service.store, self.rollout_id)
        for key in ("downloads", "fail_rate", "failing_devices"):
            report.pop(key, None)
        report.update({
            "scenario": "release-rollout",
            "scenario_name": "release-rollout",
            "fail_rate": self.fail_rate,
            "unhealthy": {
                "devices": len(failing),
                "offered": len(offered),
                "rolled_back": sum(1 for d in offered if rows[d].state == "rolled_back"),
                "named_the_part": len(named),  # their report says app:hello failed
                "other_outcomes": {d: rows[d].state for d in offered if rows[d].state != "rolled_back"},
            },
            "releases": self.releases,  # what each device runs at the end: R1 or R2, whole
            "mixed": self.mixed,
            "held": self.held,  # parts left held or on trial (must be 0)
            "from_versions": status["from_versions"],
        })
        return report


async def run_release_rollout(opts: SimOptions, *, workdir: Path, fail_rate: float = 0.1,
                              max_fleet_s: float = 6 * 3600.0, **kwargs: Any) -> Report:
    """Run the release-rollout scenario with `opts` (devices, seed, faults)."""
    if opts.devices < 2:
        raise ConfigError("simulate", "devices", "the release-rollout scenario needs at least 2 devices")
    if not 0.0 <= fail_rate <= 1.0:
        raise ConfigError("simulate", "fail-rate", "must be between 0 and 1")
    workdir.mkdir(parents=True, exist_ok=True)
    key, public = fleet_key(opts.seed, workdir / "keys")
    document, old = release_files(workdir, key, seed=opts.seed)
    spec = spec_from_dict(default_release_spec(document, seed=opts.seed, devices=opts.devices),
                          source="release-rollout scenario")
    apps = SimApps(failing=pick_failing(device_ids(opts.devices), fail_rate, opts.seed), unhealthy=APP_NEW,
                   preinstalled=old)
    settings = default_updater_settings()
    firmware = SimFirmware(public_key=public, base_version=opts.base_version, apps=apps,
                           config_targets=SimConfigTargets(),
                           settings=type(settings)(**{**settings.__dict__, "health_timeout_s": HEALTH_TIMEOUT_S}))
    sim = ReleaseRolloutSimulation(opts, workdir=workdir, spec=spec, firmware=firmware, apps=apps,
                                   fail_rate=fail_rate, max_fleet_s=max_fleet_s, **kwargs)
    return await sim.run()


def release_rollout_options(**overrides: Any) -> SimOptions:
    """The scenario's options: 30 s heartbeats and no telemetry unless given."""
    values: dict[str, Any] = {"heartbeat_s": 30.0, "telemetry_s": 0.0, "scenario": "release-rollout"}
    values.update(overrides)
    return SimOptions(**values)


async def release_rollout_scenario(*, devices: int = 100, seed: int = 7, fail_rate: float = 0.1,
                                   work_dir: str | Path, **kwargs: Any) -> Report:
    """`run_release_rollout` with the scenario's options for `devices` and `seed` (tests, demos)."""
    return await run_release_rollout(release_rollout_options(devices=devices, seed=seed), workdir=Path(work_dir),
                                     fail_rate=fail_rate, **kwargs)


def release_rollout_summary(report: Report) -> str:
    ro = report["rollout"]
    lines = [*wave_lines(report, f"release {RELEASE_NAME} {ro['version']} (firmware {FIRMWARE_NEW}, config app"
                                 f" {CONFIG_NEW}, {APP} {APP_NEW})"), *outcome_lines(report)]
    u = report["unhealthy"]
    lines.append(f"unhealthy {APP} {APP_NEW}: {u['devices']} devices, {u['offered']} offered the release,"
                 f" {u['rolled_back']} returned whole to R1, firmware included ({u['named_the_part']} named the part)")
    lines.append("running at the end: " + ", ".join(f"{v} on {n}" for v, n in report["releases"].items())
                 + f"; parts left held: {report['held']}")
    return "\n".join(lines)


__all__ = ["release_rollout_options", "release_rollout_scenario", "release_rollout_summary", "run_release_rollout"]
