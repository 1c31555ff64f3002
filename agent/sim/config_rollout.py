"""The `config-rollout` scenario: a signed config release rolled out in waves to real workers,
some of which it cuts off.

    report = await config_rollout_scenario(devices=200, seed=7, cut_rate=0.1, work_dir=tmp)

Every device is a real `WorkerAgent` declaring `[config_targets.app]` (its documents under its
own folder), with the real config applier: verify, stage, swap, confirm within `confirm_s`
(connected, the leader answering, after `settle_s`), else revert. The leader rolls the release
out as a `kind = "config"` rollout (a canary of 5%, then 30% / 35% / the rest; success gate 95%,
failure threshold 5% after 10 finished, abort). `cut_rate` of the devices (chosen by the seed)
lose their uplink the moment the release is applied to them (the fault "this config cuts the
device off"): each must revert within `confirm_s` by itself, its link comes back with the old
content, and the gates abort the rollout. The report counts the outcomes, each cut device's time
from its apply to its revert, and every device's document (the old or the new, never another);
the same seed gives the same report (but for `wall`).
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

from agent.core.errors import ConfigError
from agent.sim.devices import SimConfigTargets, SimFirmware
from agent.sim.options import SimOptions
from agent.sim.report import Report
from agent.sim.rollout import RolloutSimulation, device_ids, outcome_lines, wave_lines
from config_rollout.device.apply import CONFIRM_RETRY_S
from config_rollout.release import build_release
from rollout_engine.keys import SigningKey
from rollout_engine.spec import spec_from_dict
from rollout_engine.status import describe

RELEASE_VERSION = "1.1.0"
NEW_DOCUMENT = b"mode = 'tuned'\nworkers = 4\n"
CONFIRM_S = 60.0
SETTLE_S = 5.0


def default_config_spec(release: Path, *, seed: int, devices: int) -> dict[str, Any]:
    return {
        "rollout": {"name": f"app config {RELEASE_VERSION}", "kind": "config", "artifact": str(release),
                    "seed": seed},
        "targets": {"select": "all"},
        "waves": {"canary": max(1, devices // 20), "percents": [30.0, 35.0, 35.0]},
        "gates": {"success_threshold_pct": 95.0, "failure_threshold_pct": 5.0, "min_finished": 10,
                  "failure_action": "abort"},
        "device": {"timeout_s": 600.0, "retries": 0},
    }


def pick_cut(ids: list[str], cut_rate: float, seed: int) -> frozenset[str]:
    return frozenset(random.Random(f"cut:{seed}").sample(sorted(ids), round(len(ids) * cut_rate)))


def fleet_key(seed: int, directory: Path) -> tuple[SigningKey, Path]:
    """The fleet's key, made from the seed (the same seed: the same release bytes), and its
    public half as a file the devices and the leader pin."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = SigningKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"fleet key:{seed}".encode()).digest()))
    directory.mkdir(parents=True, exist_ok=True)
    public = directory / "public.pem"
    public.write_bytes(key.public.to_pem())
    return key, public


class ConfigRolloutSimulation(RolloutSimulation):
    """The wave engine's run with a config release instead of an image (see the module docstring)."""

    ROLLOUT_ID = "config-rollout"

    def __init__(self, opts: SimOptions, *, workdir: Path, targets: SimConfigTargets, cut_rate: float,
                 **kwargs: Any) -> None:
        super().__init__(opts, workdir=workdir, failing=len(targets.cuts), fail_rate=cut_rate, **kwargs)
        self.targets = targets
        self.cut_rate = cut_rate
        self.documents: dict[str, int] = {}

    async def _before_stop(self) -> None:
        seen = {"old": 0, "new": 0, "other": 0}
        for device in self.fleet.workers:
            data = (self.fleet.device_dir(device) / "etc" / "app" / "app.toml").read_bytes()
            seen["old" if data == self.targets.factory else "new" if data == NEW_DOCUMENT else "other"] += 1
        self.documents = seen

    async def _report(self, *, wall_s: float, cpu_s: float) -> Report:
        report = await super()._report(wall_s=wall_s, cpu_s=cpu_s)
        service = self.fleet.rollout
        assert service is not None and self.rollout_id is not None
        states = {d.device_id: d.state for d in service.store.devices(self.rollout_id)}
        cuts = sorted(self.targets.cuts)
        offered = [d for d in cuts if states.get(d) not in (None, "queued", "canceled")]
        revert_s = []
        for device in offered:
            steps = dict(self.fleet.config_steps.get(device, []))
            if "applied" in steps and "reverted" in steps:
                revert_s.append(round(steps["reverted"] - steps["applied"], 3))
        status = describe(service.store, self.rollout_id)
        for key in ("downloads", "fleet", "fail_rate", "failing_devices"):
            report.pop(key, None)
        report.update({
            "scenario": "config-rollout",
            "scenario_name": "config-rollout",
            "cut_rate": self.cut_rate,
            "confirm_s": self.targets.confirm_s,
            "settle_s": self.targets.settle_s,
            "cut": {
                "devices": len(cuts),
                "offered": len(offered),
                "rolled_back": sum(1 for d in offered if states[d] == "rolled_back"),
                "other_outcomes": {d: states[d] for d in offered if states[d] != "rolled_back"},
                "revert_s_max": max(revert_s, default=None),
                "reverted_within_confirm_s": all(s <= self.targets.confirm_s + CONFIRM_RETRY_S for s in revert_s),
                "still_cut_off": sum(1 for d in cuts if self.fleet.is_cut(d)),
            },
            "documents": self.documents,
            "from_versions": status["from_versions"],
        })
        return report


async def run_config_rollout(opts: SimOptions, *, workdir: Path, cut_rate: float = 0.1,
                             confirm_s: float = CONFIRM_S, max_fleet_s: float = 6 * 3600.0,
                             **kwargs: Any) -> Report:
    """Run the config-rollout scenario with `opts` (devices, seed, faults)."""
    if opts.devices < 2:
        raise ConfigError("simulate", "devices", "the config-rollout scenario needs at least 2 devices")
    if not 0.0 <= cut_rate <= 1.0:
        raise ConfigError("simulate", "cut-rate", "must be between 0 and 1")
    workdir.mkdir(parents=True, exist_ok=True)
    key, public = fleet_key(opts.seed, workdir / "keys")
    (workdir / "release").mkdir(exist_ok=True)
    document = workdir / "release" / "app.toml"
    document.write_bytes(NEW_DOCUMENT)
    release = workdir / f"app-{RELEASE_VERSION}.eacfg"
    release.write_bytes(build_release("app", RELEASE_VERSION, [document], key, created_ms=0))
    spec = spec_from_dict(default_config_spec(release, seed=opts.seed, devices=opts.devices),
                          source="config-rollout scenario")
    targets = SimConfigTargets(confirm_s=confirm_s, settle_s=SETTLE_S,
                               cuts=pick_cut(device_ids(opts.devices), cut_rate, opts.seed))
    firmware = SimFirmware(public_key=public, base_version=opts.base_version, config_targets=targets)
    sim = ConfigRolloutSimulation(opts, workdir=workdir, spec=spec, firmware=firmware, targets=targets,
                                  cut_rate=cut_rate, max_fleet_s=max_fleet_s, **kwargs)
    return await sim.run()


def config_rollout_options(**overrides: Any) -> SimOptions:
    """The scenario's options: 30 s heartbeats and no telemetry unless given."""
    values: dict[str, Any] = {"heartbeat_s": 30.0, "telemetry_s": 0.0, "scenario": "config-rollout"}
    values.update(overrides)
    return SimOptions(**values)


async def config_rollout_scenario(*, devices: int = 200, seed: int = 7, cut_rate: float = 0.1,
                                  work_dir: str | Path, **kwargs: Any) -> Report:
    """`run_config_rollout` with the scenario's options for `devices` and `seed` (tests, demos)."""
    return await run_config_rollout(config_rollout_options(devices=devices, seed=seed), workdir=Path(work_dir),
                                    cut_rate=cut_rate, **kwargs)


def config_rollout_summary(report: Report) -> str:
    ro = report["rollout"]
    lines = [*wave_lines(report, f"config rollout of app {ro['version']}"), *outcome_lines(report)]
    c = report["cut"]
    lines.append(f"cut off by the config: {c['devices']} of the {report['devices']} devices lose the broker with"
                 f" it; {c['offered']} of them were offered it (the others were not reached), {c['rolled_back']}"
                 f" reverted by themselves (at most {c['revert_s_max']}s of fleet time after the apply; confirm_s"
                 f" {report['confirm_s']:g}), {c['still_cut_off']} still cut off")
    d = report["documents"]
    lines.append(f"documents: {d['new']} hold the release, {d['old']} the old content, {d['other']} anything else")
    return "\n".join(lines)


__all__ = ["config_rollout_options", "config_rollout_scenario", "config_rollout_summary", "run_config_rollout"]
