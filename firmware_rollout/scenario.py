"""The `wave-rollout` scenario: N devices, one signed image, four waves behind gates.

    report = await wave_rollout_scenario(devices=200, seed=3, fail_rate=0.2)
    report = run_wave_rollout_scenario(devices=200, seed=3)          # from synchronous code

Runs a leader and N simulated devices (see `simfleet`) on a `VirtualClock` over the in-memory
broker: the devices register by heartbeat, a rollout of version 1.1.0 starts (a canary wave of
5%, then 25% / 35% / the rest; success gate 90%, 60 s soak, failure threshold 5% after 10
finished devices, abort), and the run ends when the rollout has ended and every device it
offered the image to has finished. `fail_rate` of the devices (chosen by the seed) fail their
health check on the new image and roll back.

`progress` (optional) is called with a sample of the fleet and the rollout (plain data: fleet
time, devices online, reports in flight, outbox depth, downloads, and the rollout's state, its
current wave, numbered from 1, and per-state device counts) whenever the rollout's state, its
current wave or that wave's state changes; otherwise at most every `progress_every_s` of fleet
time when something else changed, and every `progress_idle_s` (default ten times that) when
nothing did. Sampling only reads and never awaits, so the report is the same with or without it.

The report (plain data, JSON-ready): `rollout` (state, per-wave results, counts,
`devices_offered_after_abort`, duration), `outcomes` (devices per final state), `downloads`
(ConfigServer bound and the most requests it ever admitted at once, busy answers), `fleet`, and
with `series_every_s` a `timeseries`: samples (`t`, devices online, reports in flight, outbox
depth, downloads, the rollout's state, current wave and its state, devices per state) at every
change of the rollout's state or wave and every `series_every_s` of fleet time, whatever the
progress display does.

Reproducible runs: nothing may depend on thread timing. `SimRolloutClock.inline_io` asks the
outbox stores to do their SQLite work on the loop, and the updaters', ConfigServers' and
firmware stores' file and SQLite work (`firmware_rollout._fs.in_thread`) too. A thread pool,
even of one thread, is not enough: the loop would see a job finish at a moment set by the OS,
between whichever callbacks the earlier jobs' continuations happened to queue, so ConfigServer
admissions and busy answers would vary from run to run. On such a clock the same seed gives a
byte-identical report, whatever the loop's default executor.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from agent.core.clock import Clock, VirtualClock
from agent.core.errors import ConfigError
from firmware_rollout.artifact import build_artifact
from firmware_rollout.keys import generate_keypair, load_signing_key, load_verify_key
from firmware_rollout.rollout_store import IN_PROGRESS, TERMINAL
from firmware_rollout.simfleet import DeviceFate, SimFleet
from firmware_rollout.spec import RolloutSpec, load_spec, spec_from_dict
from firmware_rollout.status import describe, wave_number

BASE_VERSION = "1.0.0"
TARGET_VERSION = "1.1.0"
ROLLOUT_ID = "wave-rollout"
Sample = dict[str, Any]
Progress = Callable[[Sample], None]


class SimRolloutClock(VirtualClock):
    """The scenario's virtual clock: asks outbox stores to do their SQLite work, and the rollout
    components their file work (`in_thread`), on the loop (`inline_io`, as the fleet simulator's
    `SimClock` does) instead of on threads."""

    inline_io = True


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


def make_artifact(
    work_dir: Path,
    *,
    version: str = TARGET_VERSION,
    size: int = 8 * 4096,
    seed: int = 0,
    chunk_size: int = 4096,
    rollback: bool = False,
) -> tuple[Path, Path]:
    """A key pair and a signed artifact under `work_dir`: returns (artifact, public key path)."""
    keys_dir = work_dir / "keys"
    if not (keys_dir / "private.pem").exists():
        generate_keypair(keys_dir)
    image = work_dir / f"image-{version}.bin"
    image.write_bytes(random.Random(f"image:{seed}:{version}").randbytes(size))
    out = work_dir / f"fw-{version}.eafw"
    build_artifact(
        image,
        out,
        name="fw",
        version=version,
        key=load_signing_key(keys_dir / "private.pem"),
        created_ts=1_700_000_000_000,
        chunk_size=chunk_size,
        rollback=rollback,
    )
    return out, keys_dir / "public.pem"


def device_ids(devices: int) -> list[str]:
    return [f"dev-{i:05d}" for i in range(devices)]


def pick_failing(device_ids: list[str], fail_rate: float, seed: int) -> set[str]:
    count = round(len(device_ids) * fail_rate)
    return set(random.Random(f"fail:{seed}").sample(sorted(device_ids), count))


async def wave_rollout_scenario(
    *,
    devices: int = 200,
    seed: int = 3,
    fail_rate: float = 0.0,
    work_dir: str | Path | None = None,
    spec_overrides: dict[str, dict[str, Any]] | None = None,
    clock: Clock | None = None,
    max_fleet_s: float = 6 * 3600.0,
    fates: dict[str, DeviceFate] | None = None,
    spec_path: str | Path | None = None,
    public_key: str | Path | None = None,
    base_version: str = BASE_VERSION,
    progress: Progress | None = None,
    progress_every_s: float = 30.0,
    progress_idle_s: float | None = None,
    series_every_s: float | None = None,
) -> dict[str, Any]:
    """Run the scenario; see the module docstring. `work_dir` (default: a temporary directory,
    removed afterwards) holds the leader's and the devices' SQLite files and slots. `fates`
    sets the fate of named devices (`dev-00000` ...) instead of `fail_rate`.

    With `spec_path` (`simulate --rollout SPEC.toml`) the user's spec and artifact are rolled
    out instead (`spec_overrides` still apply); the devices pin `public_key` (default: the
    `public.pem` beside the artifact) and start on `base_version`."""
    if devices < 2:
        raise ValueError("the wave-rollout scenario needs at least 2 devices")
    if not 0.0 <= fail_rate <= 1.0:
        raise ValueError("fail_rate must lie between 0 and 1")
    owned = work_dir is None
    base = Path(tempfile.mkdtemp(prefix="wave-rollout-", dir=_fast_tmp())) if work_dir is None else Path(work_dir)
    base.mkdir(parents=True, exist_ok=True)
    try:
        return await _run(
            devices=devices,
            seed=seed,
            fail_rate=fail_rate,
            base=base,
            overrides=spec_overrides or {},
            clock=clock or SimRolloutClock(),
            max_fleet_s=max_fleet_s,
            fates=fates,
            spec_path=spec_path,
            public_key=public_key,
            base_version=base_version,
            progress=progress,
            progress_every_s=progress_every_s,
            progress_idle_s=progress_idle_s,
            series_every_s=series_every_s,
        )
    finally:
        if owned:
            shutil.rmtree(base, ignore_errors=True)


def run_wave_rollout_scenario(
    devices: int = 200, seed: int = 3, fail_rate: float = 0.0, **kwargs: Any
) -> dict[str, Any]:
    """`wave_rollout_scenario` for synchronous callers, on an event loop of its own."""
    return asyncio.run(wave_rollout_scenario(devices=devices, seed=seed, fail_rate=fail_rate, **kwargs))


async def _run(
    *,
    devices: int,
    seed: int,
    fail_rate: float,
    base: Path,
    overrides: dict[str, dict[str, Any]],
    clock: Clock,
    max_fleet_s: float,
    fates: dict[str, DeviceFate] | None,
    spec_path: str | Path | None,
    public_key: str | Path | None,
    base_version: str,
    progress: Progress | None = None,
    progress_every_s: float = 30.0,
    progress_idle_s: float | None = None,
    series_every_s: float | None = None,
) -> dict[str, Any]:
    if spec_path is not None:
        data = msgspec.to_builtins(load_spec(spec_path))
        artifact = Path(data["rollout"]["artifact"])
        public = Path(public_key) if public_key is not None else artifact.parent / "public.pem"
        if not public.is_file():
            raise ConfigError(str(spec_path), "rollout.artifact",
                              f"no public key to pin: {public} does not exist (give `public_key`)")
    else:
        artifact, public = make_artifact(base, seed=seed)
        data = default_spec(artifact, seed=seed, devices=devices)
    for section, values in overrides.items():
        data.setdefault(section, {}).update(values)
    spec: RolloutSpec = spec_from_dict(data, source="wave-rollout scenario")
    ids = device_ids(devices)
    failing = pick_failing(ids, fail_rate, seed)
    if fates is not None:
        failing = {d for d, f in fates.items() if f.health_fails or f.install_fails or f.silent}
    fleet = await SimFleet.open(
        clock=clock, work_dir=base, verify_key=load_verify_key(public), seed=seed, base_version=base_version
    )
    for device_id in ids:
        fate = fates.get(device_id) if fates is not None else None
        fleet.add_device(device_id, fate=fate or DeviceFate(health_fails=device_id in failing))
    await fleet.start()
    sampler = None
    if progress is not None:
        idle_s = progress_idle_s if progress_idle_s is not None else 10 * progress_every_s
        sampler = _Sampler(fleet, progress, spec=spec, every_s=progress_every_s, idle_s=idle_s)
    series: list[Sample] = []
    recorder = None
    if series_every_s is not None:
        recorder = _Sampler(fleet, lambda p: series.append(_point(p)), spec=spec, every_s=series_every_s,
                            idle_s=series_every_s)
    samplers = [x for x in (sampler, recorder) if x is not None]

    def on_step() -> None:
        for x in samplers:
            x()
    try:
        await fleet.run_until(lambda: fleet.leader.registry.counts()[0] >= devices, max_s=600.0, step_s=5.0,
                              on_step=on_step)
        started_ms = clock.now_ms()
        rid = await fleet.rollout.orchestrator.start_rollout(spec, rollout_id=ROLLOUT_ID)
        store = fleet.rollout.store
        for x in samplers:
            x.rid = rid
            x()

        def finished() -> bool:
            r = store.get(rid)
            return r is not None and not r.active and not store.devices(rid, states=tuple(IN_PROGRESS))

        completed = await fleet.run_until(finished, max_s=max_fleet_s, step_s=5.0, on_step=on_step)
        for x in samplers:
            x(force=True)
        status = describe(store, rid)
        pools = list(fleet.rollout.pools.values())
        downloads = {
            "bound": spec.download.servers * (spec.download.mailbox_capacity + 1),
            "max_concurrent": max((p.max_concurrent for p in pools), default=0),
            "mailbox_capacity": spec.download.mailbox_capacity,
            "mailbox_high_water": max((p.statistics()["mailbox_high_water"] for p in pools), default=0),
            "servers": spec.download.servers,
            "served": sum(p.served for p in pools),
            "busy": sum(p.busy for p in pools),
        }
        end_ms = status["finished_ms"] or clock.now_ms()
        return {
            "scenario": "wave-rollout",
            "devices": devices,
            "seed": seed,
            "fail_rate": fail_rate,
            "failing_devices": len(failing),
            "completed": completed,
            "rollout": {
                "id": rid,
                "state": status["state"],
                "detail": status["detail"],
                "version": status["version"],
                "duration_s": (end_ms - started_ms) / 1000.0,
                "waves": [
                    {k: w[k] for k in ("index", "number", "canary", "size", "state", "succeeded", "finished",
                                       "counts", "detail")}
                    for w in status["waves"]
                ],
                "counts": status["counts"],
                "offers": status["offers"],
                "devices_offered_after_abort": status["devices_offered_after_abort"],
            },
            "outcomes": status["counts"],
            "downloads": downloads,
            "fleet": {"versions": _versions(fleet)},
            **({"timeseries": series} if recorder is not None else {}),
        }
    finally:
        await fleet.stop()


class _Sampler:
    """Calls `progress` with a sample when the rollout's state, its current wave or that wave's
    state changes; else after `every_s` of fleet time if anything changed, after `idle_s` if
    nothing did (see the module docstring)."""

    def __init__(self, fleet: SimFleet, progress: Progress, *, spec: RolloutSpec, every_s: float,
                 idle_s: float) -> None:
        self.fleet = fleet
        self.progress = progress
        self.every_s = every_s
        self.idle_s = max(idle_s, every_s)
        self.bound = spec.download.servers * (spec.download.mailbox_capacity + 1)
        self.rid: str | None = None
        self._t0 = fleet.clock.monotonic()
        self._last: Sample | None = None

    def __call__(self, *, force: bool = False) -> None:
        t = self.fleet.clock.monotonic() - self._t0
        sample = self.sample(t)
        last = self._last
        if last is not None:
            if force:
                if sample == last:
                    return  # shown already
            else:
                since = t - last["t"]
                moved = _phase(sample) != _phase(last)
                changed = {k: v for k, v in sample.items() if k != "t"} != {k: v for k, v in last.items() if k != "t"}
                if not (moved or (changed and since >= self.every_s - 1e-9) or since >= self.idle_s - 1e-9):
                    return
        self._last = sample
        self.progress(sample)

    def sample(self, t: float) -> Sample:
        fleet = self.fleet
        pools = list(fleet.rollout.pools.values())
        out: Sample = {
            "kind": "rollout",
            "t": t,
            "devices": len(fleet.devices),
            "online": fleet.connected(),
            "leader_sees_online": fleet.leader.registry.counts()[0],
            "in_flight": fleet.device_outbox.in_flight,
            "outbox_pending": fleet.outbox_depth(),
            "downloads": sum(p.in_flight for p in pools),
            "download_bound": self.bound,
            "rollout": None,
        }
        store = fleet.rollout.store
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


def _versions(fleet: SimFleet) -> dict[str, int]:
    out: dict[str, int] = {}
    for device in fleet.devices.values():
        out[device.active_version] = out.get(device.active_version, 0) + 1
    return dict(sorted(out.items()))


def _fast_tmp() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


__all__ = [
    "SimRolloutClock",
    "default_spec",
    "device_ids",
    "make_artifact",
    "pick_failing",
    "run_wave_rollout_scenario",
    "wave_rollout_scenario",
]
