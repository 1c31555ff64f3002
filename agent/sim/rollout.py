"""The `wave-rollout` scenario: the fleet simulator with firmware, one signed image, waves behind gates.

    report = await wave_rollout_scenario(devices=200, seed=3, fail_rate=0.2)

A `RolloutSimulation` is a `Simulation` whose fleet has firmware (`agent.sim.devices`): the
leader runs the rollout service (orchestrator, report intake, ConfigServers) and every device is
a real `WorkerAgent` with the real updater attached. The devices register by heartbeat, a
rollout of version 1.1.0 starts (a canary wave of 5%, then 30% / 35% / the rest; success gate
90%, 60 s soak, failure threshold 5% after 10 finished devices, abort), and the mission ends
when the rollout has ended and every device it offered the image to has finished. `fail_rate`
of the devices (chosen by the seed) fail their health check on the new image and roll back.
The simulator's faults (`offline_rate`, `crash_rate`, `broker_outage`) run on the same
timeline while the rollout goes on; afterwards the fleet heals and drains as in every run.

`progress` (optional) is called with a sample of the fleet and the rollout (`kind` "rollout":
fleet time, devices online, deliveries in flight, outbox depth, downloads, and the rollout's
state, its current wave, numbered from 1, and per-state device counts) whenever the rollout's
state, its current wave or that wave's state changes; otherwise at most every
`progress_every_s` of fleet time when something else changed, and every `progress_idle_s`
(default ten times that) when nothing did. Sampling only reads and never awaits, so the report
is the same with or without it.

Reproducible runs: nothing may depend on thread timing. The simulator's clock has `inline_io`:
the outbox stores, updaters, ConfigServers and firmware stores do their file and SQLite work on
the loop, so ConfigServer admissions and busy answers are the same on every run, and the same
seed gives a byte-identical report (but for `wall`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from agent.core.errors import ArtifactError, ConfigError
from agent.sim.devices import DeviceFate, SimFirmware
from agent.sim.fleet import Rollouts, SimFleet, device_name
from agent.sim.options import SimOptions
from agent.sim.report import Report, peak_rss_mb
from agent.sim.runner import Simulation
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.keys import load_verify_key
from rollout_engine.lease import lease_of
from rollout_engine.spec import RolloutSpec, load_spec, spec_from_dict
from rollout_engine.status import describe, wave_label, wave_number
from rollout_engine.store import IN_PROGRESS, TERMINAL, RolloutStore

BASE_VERSION = "1.0.0"
TARGET_VERSION = "1.1.0"
ROLLOUT_ID = "wave-rollout"
HEARTBEAT_S = 30.0  # the wave-rollout scenario's device heartbeat interval
STEP_S = 5.0  # fleet time between two looks at the rollout
REGISTER_MAX_S = 600.0  # the longest the scenario waits for every device to register
Sample = dict[str, Any]
Progress = Callable[[Sample], None]


def default_spec(artifact: Path, *, seed: int, devices: int) -> dict[str, Any]:
    return {
        "rollout": {"name": f"firmware {TARGET_VERSION}", "artifact": str(artifact), "seed": seed},
        "targets": {"select": "all"},
        "waves": {"canary": max(1, devices // 20), "percents": [30.0, 35.0, 35.0]},
        "gates": {
            "success_threshold_pct": 90.0,
            "soak_s": 60.0,
            "failure_threshold_pct": 5.0,
            "min_finished": 10,
            "failure_action": "abort",
        },
        "device": {"timeout_s": 600.0, "retries": 0},
        "download": {"servers": 2, "mailbox_capacity": 2, "rate_bytes_per_s": 64 * 1024},
    }


def device_ids(devices: int) -> list[str]:
    return [device_name(i) for i in range(devices)]


def pick_failing(ids: list[str], fail_rate: float, seed: int) -> set[str]:
    count = round(len(ids) * fail_rate)
    return set(random.Random(f"fail:{seed}").sample(sorted(ids), count))


class RolloutSimulation(Simulation):
    """A fleet run whose mission is one rollout of `spec` (see the module docstring)."""

    ROLLOUT_ID = ROLLOUT_ID

    def __init__(self, opts: SimOptions, *, workdir: Path, spec: RolloutSpec, firmware: SimFirmware,
                 failing: int, fail_rate: float, max_fleet_s: float = 6 * 3600.0,
                 progress: Progress | None = None, progress_every_s: float = 30.0,
                 progress_idle_s: float | None = None, series_every_s: float | None = None,
                 cancel_at_s: float | None = None) -> None:
        if opts.processes > 1 or opts.shard is not None:
            raise ConfigError("simulate", "processes", "a rollout runs in one process with its whole fleet")
        super().__init__(opts, workdir=workdir, firmware=firmware)
        self.spec = spec
        # `simulate --cancel-at`: the operator cancels this long after the start
        self.cancel_at_s = cancel_at_s
        self.canceled_ms: int | None = None
        self._installed_at_cancel: set[str] = set()
        self.failing = failing
        self.fail_rate = fail_rate
        self.max_fleet_s = max_fleet_s
        self.rollout_id: str | None = None
        self.started_ms = 0
        self.completed = False
        self.versions: dict[str, int] = {}
        self.rollout_series: list[Sample] = []
        self._samplers: list[RolloutSampler] = []
        if progress is not None:
            idle_s = progress_idle_s if progress_idle_s is not None else 10 * progress_every_s
            self._samplers.append(RolloutSampler(self.fleet, progress, spec=spec, every_s=progress_every_s,
                                                 idle_s=idle_s, now=self.now))
        if series_every_s is not None:
            self._samplers.append(RolloutSampler(self.fleet, lambda p: self.rollout_series.append(_point(p)),
                                                 spec=spec, every_s=series_every_s, idle_s=series_every_s,
                                                 now=self.now))

    def _on_step(self) -> None:
        for sampler in self._samplers:
            sampler()

    async def _mission(self) -> None:
        fleet = self.fleet
        leader, service = fleet.leader, fleet.rollout
        assert leader is not None and service is not None
        self._on_step()
        devices = self.opts.devices
        await self._run_until(self.now() + REGISTER_MAX_S, stop_when=lambda: sum(leader.registry.counts()) >= devices,
                              step_s=STEP_S, on_step=self._on_step)
        self.started_ms = self.clock.now_ms()
        service = await self._orchestrating()
        rid = await service.orchestrator.start_rollout(self.spec, rollout_id=self.ROLLOUT_ID)
        self.rollout_id = rid
        for sampler in self._samplers:
            sampler.rid = rid
        self._on_step()

        def finished() -> bool:  # (the store of the leader running the rollouts: it may change hands)
            store = self._service().store
            r = store.get(rid)
            return r is not None and not r.active and not store.devices(rid, states=tuple(IN_PROGRESS))

        deadline = self.now() + self.max_fleet_s
        if self.cancel_at_s is not None:
            await self._run_until(min(deadline, self.now() + self.cancel_at_s), stop_when=finished, step_s=STEP_S,
                                  on_step=self._on_step)
            service = await self._orchestrating()
            r = service.store.get(rid)
            if r is not None and r.active:
                self._installed_at_cancel = self._installing_or_installed(service.store, rid)
                self.canceled_ms = self.clock.now_ms()
                await service.orchestrator.control(rid, "cancel")
        self.completed = await self._run_until(deadline, stop_when=finished, step_s=STEP_S, on_step=self._on_step)
        for sampler in self._samplers:
            sampler(force=True)

    def _service(self) -> Rollouts:
        service = self.fleet.rollout
        assert service is not None
        return service

    async def _orchestrating(self) -> Rollouts:
        """The rollout part of the leader running the rollouts, once one does (several leaders: a
        leader takes the orchestrator lease within a third of `rollout_lease_s`)."""
        await self._run_until(self.now() + REGISTER_MAX_S, stop_when=lambda: self._service().orchestrating,
                              step_s=STEP_S, on_step=self._on_step)
        return self._service()

    def _leaders(self, service: Rollouts) -> dict[str, Any]:
        """Several leaders: who crashed, and who holds the orchestrator lease at the end (its
        token counts the hands it went through)."""
        lease = lease_of(service.store)
        return {"crashed": sorted(self.fleet.crashed_leaders),
                "orchestrator": {"holder": lease.holder, "token": lease.token} if lease is not None else None}

    def _installing_or_installed(self, store: RolloutStore, rid: str) -> set[str]:
        """The devices that have written (or are writing) the new image into a slot."""
        past = ("installing", "rebooting", "verifying", "succeeded", "rolled_back")
        return {d.device_id for d in store.devices(rid, states=past)}

    async def _before_stop(self) -> None:
        versions: dict[str, int] = {}
        for device in self.fleet.workers:
            version = self.fleet.active_version(device)
            versions[version] = versions.get(version, 0) + 1
        self.versions = dict(sorted(versions.items()))

    async def _report(self, *, wall_s: float, cpu_s: float) -> Report:
        fleet_report = await super()._report(wall_s=wall_s, cpu_s=cpu_s)
        service = self.fleet.rollout
        assert service is not None and self.rollout_id is not None
        spec = self.spec
        status = describe(service.store, self.rollout_id)
        pools = [pool for each in self.fleet.rollouts for pool in each.pools.values()]  # every leader serves
        counts: dict[str, int] = status["counts"]
        waves = [{k: w[k] for k in ("index", "number", "canary", "size", "state", "succeeded", "finished", "counts",
                                    "detail")} for w in status["waves"]]
        targeted = sum(w["size"] for w in waves)
        terminal = sum(n for state, n in counts.items() if state in TERMINAL)
        untouched = sum(n for state, n in counts.items() if state == "queued")
        aborted = status["state"] in ("aborted", "canceled")
        # An aborted rollout leaves the devices it never offered the image queued: accounted for.
        rollout_lost = targeted - terminal - (untouched if aborted else 0)
        end_ms = status["finished_ms"] or self.clock.now_ms()
        duration_s = (end_ms - self.started_ms) / 1000.0
        conservation = sum(counts.values()) == targeted and status["devices_offered_after_abort"] == 0
        return {
            "scenario": "wave-rollout",
            "scenario_name": "wave-rollout",
            "devices": self.opts.devices,
            "seed": self.opts.seed,
            "fail_rate": self.fail_rate,
            "failing_devices": self.failing,
            "completed": self.completed,
            "rollout": {
                "id": self.rollout_id,
                "state": status["state"],
                "detail": status["detail"],
                "version": status["version"],
                "duration_s": duration_s,
                "waves": waves,
                "counts": counts,
                "offers": status["offers"],
                "devices_offered_after_abort": status["devices_offered_after_abort"],
                "progress_reports": status["progress_reports"],
                "cancel_at_s": self.cancel_at_s,
                "cancel_pending": status["cancel_pending"],
                # devices that began writing the image into a slot after the cancel (must be 0)
                "devices_installed_after_cancel": (
                    len(self._installing_or_installed(service.store, self.rollout_id) - self._installed_at_cancel)
                    if self.canceled_ms is not None else None),
            },
            "outcomes": counts,
            "downloads": {
                "bound": spec.download.servers * (spec.download.mailbox_capacity + 1),
                "max_concurrent": max((p.max_concurrent for p in pools), default=0),
                "mailbox_capacity": spec.download.mailbox_capacity,
                "mailbox_high_water": max((p.statistics()["mailbox_high_water"] for p in pools), default=0),
                "servers": spec.download.servers,
                "served": sum(p.served for p in pools),
                "busy": sum(p.busy for p in pools),
                # what the devices fetched against the image bytes they assembled (a delta copies the rest)
                "image_bytes": sum(int(w["download"]["bytes_total"]) for w in status["waves"]),
                "bytes_to_fetch": sum(int(w["download"]["bytes_to_fetch"]) for w in status["waves"]),
            },
            "fleet": {"versions": self.versions},
            **({"leaders": self._leaders(service)} if self.opts.leaders > 1 else {}),
            "faults": {"offline_episodes": len(self.offline_episodes), "crashes": len(self.crash_episodes),
                       "broker_outage": list(self.opts.broker_outage) if self.opts.broker_outage else None},
            # the fleet run's own accounting: heartbeats, telemetry, outboxes, relays
            "messages": fleet_report["messages"],
            "heartbeats": fleet_report["heartbeats"],
            "telemetry": fleet_report["telemetry"],
            "relay": fleet_report["relay"],
            "drained": fleet_report["drained"],
            "lost": rollout_lost + fleet_report["lost"],
            "conservation_ok": conservation and fleet_report["conservation_ok"],
            "timeseries": self.rollout_series,
            "wall": {
                "seconds": round(wall_s, 3), "cpu_seconds": round(cpu_s, 3), "peak_rss_mb": peak_rss_mb(),
                "fleet_seconds_per_wall_second": round(duration_s / wall_s, 1) if wall_s > 0 else None,
            },
        }


class RolloutSampler:
    """Calls `progress` with a sample when the rollout's state, its current wave or that wave's
    state changes; else after `every_s` of fleet time if devices moved (`_MOVES`), after `idle_s`
    if they did not (see the module docstring)."""

    def __init__(self, fleet: SimFleet, progress: Progress, *, spec: RolloutSpec, every_s: float, idle_s: float,
                 now: Callable[[], float]) -> None:
        self.fleet = fleet
        self.progress = progress
        self.every_s = every_s
        self.idle_s = max(idle_s, every_s)
        from agent.leader.rollout_kinds import serves_image

        # the chunk downloads' bound; 0 for a kind that downloads no image (a config release)
        self.bound = (spec.download.servers * (spec.download.mailbox_capacity + 1)
                      if serves_image(spec.rollout.kind) else 0)
        self.rid: str | None = None
        self._now = now
        self._last: Sample | None = None

    def __call__(self, *, force: bool = False) -> None:
        t = self._now()
        sample = self.sample(t)
        last = self._last
        if last is not None:
            if force:
                if sample == last:
                    return  # shown already
            else:
                since = t - last["t"]
                moved = _phase(sample) != _phase(last)
                changed = any(sample[k] != last[k] for k in _MOVES)
                if not (moved or (changed and since >= self.every_s - 1e-9) or since >= self.idle_s - 1e-9):
                    return
        self._last = sample
        self.progress(sample)

    def sample(self, t: float) -> Sample:
        fleet = self.fleet
        leader, service = fleet.leader, fleet.rollout
        assert leader is not None and service is not None
        pools = [pool for each in fleet.rollouts for pool in each.pools.values()]
        out: Sample = {
            "kind": "rollout",
            "t": t,
            "devices": len(fleet.workers),
            "online": fleet.online(),
            "leader_sees_online": leader.registry.counts()[0],
            "in_flight": sum(r.in_flight for r in fleet.relay_metrics()),
            "outbox_pending": fleet.pending_rows(),
            "downloads": sum(p.in_flight for p in pools),
            "download_bound": self.bound,
            "rollout": None,
        }
        store = service.store
        r = store.get(self.rid) if self.rid is not None else None
        if r is None:
            return out
        per_wave = store.counts(r.id)
        waves = [
            {
                "number": wave_number(w.idx),
                "canary": w.idx == 0 and r.spec.waves.canary > 0,
                "size": w.size,
                "state": w.state,
                "counts": dict(sorted(per_wave.get(w.idx, {}).items())),
            }
            for w in store.waves(r.id)
        ]
        totals = store.totals(r.id)
        out["rollout"] = {
            "state": r.state,
            "detail": r.detail,
            "wave": wave_number(r.current_wave),
            "wave_count": r.wave_count,
            "waves": waves,
            "counts": dict(sorted(totals.items())),
            "targeted": sum(totals.values()),
            "finished": sum(n for state, n in totals.items() if state in TERMINAL),
        }
        return out


# What "devices move" means for the progress display: the outbox depth and the deliveries in
# flight change with every heartbeat, and are shown, but do not call for a line of their own.
_MOVES = ("online", "leader_sees_online", "downloads", "rollout")


def _point(sample: Sample) -> Sample:
    """A progress sample, compact for the report's time series."""
    ro = sample["rollout"]
    point = {k: sample[k] for k in ("t", "online", "leader_sees_online", "in_flight", "outbox_pending", "downloads")}
    point["t"] = round(point["t"], 3)
    if ro is None:
        return {**point, "state": "not-started", "wave": 0, "wave_state": "", "counts": {}}
    return {**point, "state": ro["state"], "wave": ro["wave"], "wave_state": ro["waves"][ro["wave"] - 1]["state"],
            "counts": ro["counts"]}


def _phase(sample: Sample) -> tuple[str, int, str] | None:
    """The rollout's state, current wave and that wave's state, as a sample shows them."""
    ro = sample["rollout"]
    if ro is None:
        return None
    return ro["state"], ro["wave"], ro["waves"][ro["wave"] - 1]["state"]


def public_key_for(spec_path: str | Path, public_key: str | Path | None) -> tuple[Path, str | None]:
    """The public key the simulated devices pin for `simulate --rollout SPEC`: `public_key`
    (`--public-key`), else the `public.pem` beside the spec's artifact. Returns the path and a
    warning when the artifact is not signed by that key (every device would refuse it).
    Raises `ConfigError` naming the option and the path when the key is missing or malformed."""
    from firmware_rollout.artifact.files import read_signed_manifest

    spec = load_spec(spec_path)
    artifact = Path(spec.rollout.artifact)
    try:
        signed = read_signed_manifest(artifact)
    except ArtifactError as exc:
        raise ConfigError("--rollout", None, f"{spec_path}: artifact {artifact}: {exc}") from None
    if public_key is None:
        key_path = artifact.parent / "public.pem"
        if not key_path.is_file():
            raise ConfigError("--public-key", None,
                              f"not given, and there is no public.pem beside the artifact ({key_path}):"
                              " give the fleet's public key with --public-key PATH")
    else:
        key_path = Path(public_key)
        if key_path.is_dir():
            raise ConfigError("--public-key", None,
                              f"{key_path}: a directory, not a key file (e.g. {key_path / 'public.pem'})")
        if not key_path.is_file():
            raise ConfigError("--public-key", None, f"{key_path}: no such file")
    try:
        key = load_verify_key(key_path)
    except ArtifactError as exc:  # KeyFileError: names the file
        raise ConfigError("--public-key", None, str(exc)) from None
    try:
        signed.verify(key)
    except ArtifactError as exc:
        return key_path, (f"{artifact} does not verify against {key_path} ({exc}): the leader, which checks it"
                          " against the same key, will refuse to start the rollout")
    return key_path, None


def rollout_options(**overrides: Any) -> SimOptions:
    """The wave-rollout scenario's options: 30 s heartbeats and no telemetry unless given."""
    values: dict[str, Any] = {"heartbeat_s": HEARTBEAT_S, "telemetry_s": 0.0, "scenario": "wave-rollout"}
    values.update(overrides)
    return SimOptions(**values)


async def run_rollout(opts: SimOptions, *, workdir: Path, spec_path: str | Path | None = None,
                      fail_rate: float = 0.0, public_key: str | Path | None = None,
                      fates: dict[str, DeviceFate] | None = None,
                      spec_overrides: dict[str, dict[str, Any]] | None = None, max_fleet_s: float = 6 * 3600.0,
                      progress: Progress | None = None, progress_every_s: float = 30.0,
                      progress_idle_s: float | None = None, series_every_s: float | None = 30.0,
                      cancel_at_s: float | None = None) -> Report:
    """Run the wave-rollout scenario with `opts` (devices, seed, faults). With `spec_path`
    (`simulate --rollout SPEC.toml`) the user's spec and artifact are rolled out instead; the
    devices pin `public_key` (default: the `public.pem` beside the artifact). `fates` sets the
    fate of named devices instead of `fail_rate`; `spec_overrides` replace spec keys by section.
    The report's `timeseries` has a point every `series_every_s` of fleet time (what `--plot`
    draws)."""
    if opts.devices < 2:
        raise ConfigError("simulate", "devices", "the wave-rollout scenario needs at least 2 devices")
    if not 0.0 <= fail_rate <= 1.0:
        raise ConfigError("simulate", "fail-rate", "must be between 0 and 1")
    workdir.mkdir(parents=True, exist_ok=True)
    if spec_path is not None:
        data = msgspec.to_builtins(load_spec(spec_path))
        artifact = Path(data["rollout"]["artifact"])
        public = Path(public_key) if public_key is not None else artifact.parent / "public.pem"
        if not public.is_file():
            raise ConfigError(str(spec_path), "rollout.artifact",
                              f"no public key to pin: {public} does not exist (give `public_key`)")
    else:
        artifact, public = make_artifact(workdir / "artifact", version=TARGET_VERSION, seed=opts.seed)
        data = default_spec(artifact, seed=opts.seed, devices=opts.devices)
    for section, values in (spec_overrides or {}).items():
        data.setdefault(section, {}).update(values)
    spec = spec_from_dict(data, source="wave-rollout scenario")
    ids = device_ids(opts.devices)
    if fates is None:
        fates = {d: DeviceFate(health_fails=True) for d in pick_failing(ids, fail_rate, opts.seed)}
    firmware = SimFirmware(public_key=public, base_version=opts.base_version, fates=fates)
    sim = RolloutSimulation(opts, workdir=workdir, spec=spec, firmware=firmware,
                            failing=sum(1 for f in fates.values() if f.failing), fail_rate=fail_rate,
                            max_fleet_s=max_fleet_s, progress=progress, progress_every_s=progress_every_s,
                            progress_idle_s=progress_idle_s, series_every_s=series_every_s, cancel_at_s=cancel_at_s)
    return await sim.run()


async def wave_rollout_scenario(*, devices: int = 200, seed: int = 3, fail_rate: float = 0.0,
                                work_dir: str | Path, **kwargs: Any) -> Report:
    """`run_rollout` with the scenario's options for `devices` and `seed` (tests and demos)."""
    return await run_rollout(rollout_options(devices=devices, seed=seed), workdir=Path(work_dir),
                             fail_rate=fail_rate, **kwargs)


def wave_lines(report: Report, what: str, *, note: str = "") -> list[str]:
    """A rollout scenario's first lines: `what` ("wave rollout of 1.1.0"), how it ended, and each wave."""
    ro = report["rollout"]
    lines = [f"{what} to {report['devices']} devices (seed {report['seed']}{note}):"
             f" {ro['state']} after {ro['duration_s']:.0f}s of fleet time ({report['wall']['seconds']:.1f}s wall)"
             + (f" - when it {ro['state']}: {ro['detail']}" if ro["detail"] else "")]
    for w in ro["waves"]:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(w["counts"].items())) or "untouched"
        devices = f"{w['size']} device" + ("" if w["size"] == 1 else "s")
        lines.append(f"  {wave_label(w['index'], canary=w.get('canary', False))}: {devices}, {w['state']}: {counts}")
    return lines


def outcome_lines(report: Report) -> list[str]:
    """The devices' outcomes, what the abort left alone and what was lost."""
    ro = report["rollout"]
    return ["devices at the end: " + ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items()))
            + " (a rollout's failure threshold counts failed and rolled_back alike; a device can finish after"
              " the abort)",
            f"offered after abort: {ro['devices_offered_after_abort']}   lost: {report['lost']}"
            f"   conservation_ok: {report['conservation_ok']}"]


def rollout_summary(report: Report) -> str:
    ro = report["rollout"]
    lines = wave_lines(report, f"wave rollout of {ro['version']}", note=f", {report['failing_devices']} failing")
    d = report["downloads"]
    lines.append(f"downloads: at most {d['max_concurrent']} at once (bound {d['bound']}), {d['served']} chunks"
                 f" served, {d['busy']} busy answers; {d['bytes_to_fetch']} of {d['image_bytes']} image bytes"
                 " fetched")
    devices, after = outcome_lines(report)
    lines.append(devices)
    if (led := report.get("leaders")) is not None and led["orchestrator"] is not None:
        crashed = f"{', '.join(led['crashed'])} crashed; " if led["crashed"] else ""
        lines.append(f"leaders: {crashed}{led['orchestrator']['holder']} ran the rollouts at the end"
                     f" (orchestrator lease token {led['orchestrator']['token']})")
    lines.append(after)
    if ro.get("cancel_at_s") is not None:
        lines.append(f"canceled at {ro['cancel_at_s']:g}s: devices installed after the cancel:"
                     f" {ro['devices_installed_after_cancel']}, still to confirm it: {ro['cancel_pending']}")
    return "\n".join(lines)


__all__ = [
    "BASE_VERSION",
    "HEARTBEAT_S",
    "ROLLOUT_ID",
    "TARGET_VERSION",
    "RolloutSampler",
    "RolloutSimulation",
    "default_spec",
    "device_ids",
    "pick_failing",
    "public_key_for",
    "rollout_options",
    "outcome_lines",
    "rollout_summary",
    "wave_lines",
    "run_rollout",
    "wave_rollout_scenario",
]
