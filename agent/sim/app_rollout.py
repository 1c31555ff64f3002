"""The `app-rollout` scenario: a signed application bundle rolled out in waves to real workers,
on some of which the new version fails its health check.

    report = await app_rollout_scenario(devices=200, seed=7, fail_rate=0.1, work_dir=tmp)

Every device runs the real application module and the real application helper on its own files
(`agent.sim.apps`: its service manager and its mirror simulated), with `hello` 1.0.0 installed,
started and committed before the rollout. The leader rolls hello 2.0.0 out as a `kind = "app"`
rollout (a canary of 5%, then 30% / 35% / the rest; success gate 95%, failure threshold 5% after
10 finished, abort). On `fail_rate` of the devices (chosen by the seed) 2.0.0's process exits at
once: each takes it back by itself and runs 1.0.0 again, and the gates abort the rollout. The
report counts the outcomes and what every device runs at the end (1.0.0 or 2.0.0, never another,
nothing on trial); the same seed gives the same report (but for `wall`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from agent.core.errors import ConfigError
from agent.sim.apps import SimApps, preinstall
from agent.sim.config_rollout import fleet_key
from agent.sim.devices import SimFirmware
from agent.sim.options import SimOptions
from agent.sim.report import Report
from agent.sim.rollout import STEP_S, RolloutSimulation, device_ids, outcome_lines, wave_lines
from app_rollout.bundle import build_bundle
from rollout_engine.keys import SigningKey
from rollout_engine.spec import spec_from_dict
from rollout_engine.status import describe

APP = "hello"
OLD, NEW = "1.0.0", "2.0.0"
UNIT = ("[Unit]\nDescription=hello, the simulator's application\n\n[Service]\nType=exec\nExecStart=bin/server\n"
        "Restart=on-failure\n\n[Install]\nWantedBy=multi-user.target\n")


def default_app_spec(bundle: Path, *, seed: int, devices: int) -> dict[str, Any]:
    return {
        "rollout": {"name": f"{APP} {NEW}", "kind": "app", "artifact": str(bundle), "seed": seed},
        "targets": {"select": "all"},
        "waves": {"canary": max(1, devices // 20), "percents": [30.0, 35.0, 35.0]},
        "gates": {"success_threshold_pct": 95.0, "failure_threshold_pct": 5.0, "min_finished": 10,
                  "failure_action": "abort"},
        "device": {"timeout_s": 600.0, "retries": 0},
    }


def pick_failing(ids: list[str], fail_rate: float, seed: int) -> frozenset[str]:
    return frozenset(random.Random(f"app-fail:{seed}").sample(sorted(ids), round(len(ids) * fail_rate)))


def hello_bundle(workdir: Path, version: str, key: SigningKey) -> Path:
    """hello-VERSION.eaapp: a server and its assets (2.0.0 changes the server only)."""
    src = workdir / f"{APP}-{version}"
    (src / "files" / "bin").mkdir(parents=True, exist_ok=True)
    (src / "files" / "assets").mkdir(exist_ok=True)
    (src / "files" / "bin" / "server").write_text(f"#!/bin/sh\n# hello {version}\nexec sleep infinity\n")
    (src / "files" / "bin" / "server").chmod(0o755)
    (src / "files" / "assets" / "page.html").write_text("<p>hello</p>\n" * 4096)
    (src / f"{APP}.service").write_text(UNIT)
    (src / "app.toml").write_text(f'[app]\nname = "{APP}"\nversion = "{version}"\nunit = "{APP}.service"\n\n'
                                  '[health]\ncheck = "active"\nsettle_s = 10\ntimeout_s = 60\n')
    out = workdir / f"{APP}-{version}.eaapp"
    build_bundle(src, key, out, force=True)
    return out


class AppRolloutSimulation(RolloutSimulation):
    """The wave engine's run with an application bundle instead of an image (see the module docstring)."""

    ROLLOUT_ID = "app-rollout"

    def __init__(self, opts: SimOptions, *, workdir: Path, apps: SimApps, fail_rate: float, **kwargs: Any) -> None:
        super().__init__(opts, workdir=workdir, failing=len(apps.failing), fail_rate=fail_rate, **kwargs)
        self.sim_apps = apps
        self.running: dict[str, int] = {}
        self.trials: dict[str, str] = {}
        self.on_trial = 0
        self.leader_knows = False

    async def _open(self) -> None:
        firmware = self.fleet.firmware
        assert firmware is not None
        for device in device_ids(self.opts.devices):  # each device runs 1.0.0 before the rollout
            await preinstall(self.sim_apps, firmware.verify_key, self.fleet.device_dir(device), device, self.clock)
        await super()._open()

    async def _mission(self) -> None:
        await super()._mission()
        # what each device runs reaches the leader with its next full heartbeat
        leader = self.fleet.leader
        assert leader is not None

        def known() -> bool:
            return {d: s[APP].version for d, s in leader.registry.app_states().items() if APP in s} == self._running()

        self.leader_knows = await self._run_until(self.now() + 4 * self.opts.heartbeat_s, stop_when=known,
                                                  step_s=STEP_S)

    def _running(self) -> dict[str, str]:
        """device -> the version of hello its helper has committed."""
        firmware = self.fleet.firmware
        assert firmware is not None
        found = {}
        for device in self.fleet.workers:
            record = json.loads((self.fleet.device_dir(device) / "apps" / APP / "record.json").read_bytes())
            found[device] = record.get("current", "")
            self.trials[device] = record.get("trial", "")
        return found

    async def _before_stop(self) -> None:
        running: dict[str, int] = {}
        for version in self._running().values():
            running[version] = running.get(version, 0) + 1
        self.running = dict(sorted(running.items()))
        self.on_trial = sum(1 for t in self.trials.values() if t)

    async def _report(self, *, wall_s: float, cpu_s: float) -> Report:
        report = await super()._report(wall_s=wall_s, cpu_s=cpu_s)
        service = self.fleet.rollout
        assert service is not None and self.rollout_id is not None
        states = {d.device_id: d.state for d in service.store.devices(self.rollout_id)}
        failing = sorted(self.sim_apps.failing)
        offered = [d for d in failing if states.get(d) not in (None, "queued", "canceled")]
        status = describe(service.store, self.rollout_id)
        for key in ("downloads", "fleet", "fail_rate", "failing_devices"):
            report.pop(key, None)
        report.update({
            "scenario": "app-rollout",
            "scenario_name": "app-rollout",
            "fail_rate": self.fail_rate,
            "unhealthy": {
                "devices": len(failing),
                "offered": len(offered),
                "failed": sum(1 for d in offered if states[d] == "failed"),
                "other_outcomes": {d: states[d] for d in offered if states[d] != "failed"},
            },
            "running": self.running,
            "on_trial": self.on_trial,
            "leader_knows": self.leader_knows,  # its registry says what every device runs
            "from_versions": status["from_versions"],
        })
        return report


async def run_app_rollout(opts: SimOptions, *, workdir: Path, fail_rate: float = 0.1,
                          max_fleet_s: float = 6 * 3600.0, **kwargs: Any) -> Report:
    """Run the app-rollout scenario with `opts` (devices, seed, faults)."""
    if opts.devices < 2:
        raise ConfigError("simulate", "devices", "the app-rollout scenario needs at least 2 devices")
    if not 0.0 <= fail_rate <= 1.0:
        raise ConfigError("simulate", "fail-rate", "must be between 0 and 1")
    workdir.mkdir(parents=True, exist_ok=True)
    key, public = fleet_key(opts.seed, workdir / "keys")
    old, new = hello_bundle(workdir, OLD, key), hello_bundle(workdir, NEW, key)
    spec = spec_from_dict(default_app_spec(new, seed=opts.seed, devices=opts.devices), source="app-rollout scenario")
    apps = SimApps(failing=pick_failing(device_ids(opts.devices), fail_rate, opts.seed), unhealthy=NEW,
                   preinstalled=old)
    firmware = SimFirmware(public_key=public, base_version=opts.base_version, apps=apps)
    sim = AppRolloutSimulation(opts, workdir=workdir, spec=spec, firmware=firmware, apps=apps, fail_rate=fail_rate,
                               max_fleet_s=max_fleet_s, **kwargs)
    return await sim.run()


def app_rollout_options(**overrides: Any) -> SimOptions:
    """The scenario's options: 30 s heartbeats and no telemetry unless given."""
    values: dict[str, Any] = {"heartbeat_s": 30.0, "telemetry_s": 0.0, "scenario": "app-rollout"}
    values.update(overrides)
    return SimOptions(**values)


async def app_rollout_scenario(*, devices: int = 200, seed: int = 7, fail_rate: float = 0.1,
                               work_dir: str | Path, **kwargs: Any) -> Report:
    """`run_app_rollout` with the scenario's options for `devices` and `seed` (tests, demos)."""
    return await run_app_rollout(app_rollout_options(devices=devices, seed=seed), workdir=Path(work_dir),
                                 fail_rate=fail_rate, **kwargs)


def app_rollout_summary(report: Report) -> str:
    ro = report["rollout"]
    lines = [*wave_lines(report, f"application rollout of {APP} {ro['version']}"), *outcome_lines(report)]
    u = report["unhealthy"]
    lines.append(f"unhealthy {APP} {NEW}: {u['devices']} devices, {u['offered']} offered it, {u['failed']} took it"
                 " back by themselves")
    lines.append("running at the end: " + ", ".join(f"{APP} {v} on {n}" for v, n in report["running"].items())
                 + f"; on trial: {report['on_trial']}; the leader's registry says so: {report['leader_knows']}")
    return "\n".join(lines)


__all__ = ["app_rollout_options", "app_rollout_scenario", "app_rollout_summary", "run_app_rollout"]
