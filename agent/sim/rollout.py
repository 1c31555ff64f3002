"""`simulate --scenario wave-rollout` / `--rollout SPEC.toml`: the rollout orchestrator's scenario
(`firmware_rollout.scenario`: a leader with the rollout service and devices with the updater, on
the in-memory broker and a virtual clock), reported in the simulator's shape.

The report is the scenario's, plus the simulator's common keys:

* `lost`: targeted devices that did not end in a terminal state, or whose state the leader never
  learned (their report would have been lost). Must be 0.
* `conservation_ok`: the per-state counts add up to the devices targeted, and no device was
  offered the image after an abort.
* `wall`: wall and CPU seconds, peak RSS (the only section that varies between runs).

Waves are numbered from 1 in every text (the canary, when there is one, is wave 1), as
`edge-agent rollout list` and `rollout status` number them; the JSON keeps each wave's stored
`index` (from 0) beside its `number`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agent.core.errors import ArtifactError, ConfigError
from agent.sim.options import SimOptions
from agent.sim.report import Report, peak_rss_mb
from firmware_rollout.rollout_store import TERMINAL
from firmware_rollout.scenario import Progress, wave_rollout_scenario
from firmware_rollout.status import wave_label


def public_key_for(spec_path: str | Path, public_key: str | Path | None) -> tuple[Path, str | None]:
    """The public key the simulated devices pin for `simulate --rollout SPEC`: `public_key`
    (`--public-key`), else the `public.pem` beside the spec's artifact. Returns the path and a
    warning when the artifact is not signed by that key (every device would refuse it).
    Raises `ConfigError` naming the option and the path when the key is missing or malformed."""
    from firmware_rollout.artifact import read_signed_manifest
    from firmware_rollout.keys import load_verify_key
    from firmware_rollout.spec import load_spec

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
        return key_path, f"{artifact} does not verify against {key_path} ({exc}): every device will refuse it"
    return key_path, None


async def run_rollout(opts: SimOptions, *, workdir: Path, spec_path: str | Path | None = None,
                      fail_rate: float = 0.0, public_key: str | Path | None = None,
                      progress: Progress | None = None, progress_every_s: float = 30.0,
                      progress_idle_s: float | None = None, series_every_s: float = 30.0) -> Report:
    """Run the wave-rollout scenario with `opts.devices` and `opts.seed`. `progress` gets a
    sample (`firmware_rollout.scenario`) at every change of the rollout's state, its wave or
    the wave's state; else after `progress_every_s` of fleet time when something changed, after
    `progress_idle_s` (default ten times that) when nothing did. The report's `timeseries` has a
    point every `series_every_s` of fleet time (what `--plot` draws)."""
    # The scenario's clock has `inline_io`: its file and SQLite work runs on the loop, so the
    # same seed gives the same report (`firmware_rollout.scenario`).
    wall0, cpu0 = time.perf_counter(), time.process_time()
    result: dict[str, Any] = await wave_rollout_scenario(
        devices=opts.devices, seed=opts.seed, fail_rate=fail_rate, work_dir=workdir / "rollout",
        spec_path=spec_path, public_key=public_key, progress=progress, progress_every_s=progress_every_s,
        progress_idle_s=progress_idle_s, series_every_s=series_every_s)
    wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    ro = result["rollout"]
    counts: dict[str, int] = ro["counts"]
    targeted = sum(w["size"] for w in ro["waves"])
    terminal = sum(n for state, n in counts.items() if state in TERMINAL)
    untouched = sum(n for state, n in counts.items() if state == "queued")
    aborted = ro["state"] in ("aborted", "canceled")
    # An aborted rollout leaves the devices it never offered the image queued: accounted for.
    lost = targeted - terminal - (untouched if aborted else 0)
    result["lost"] = lost
    result["conservation_ok"] = sum(counts.values()) == targeted and ro["devices_offered_after_abort"] == 0
    result["scenario_name"] = "wave-rollout"
    result["wall"] = {
        "seconds": round(wall_s, 3), "cpu_seconds": round(cpu_s, 3), "peak_rss_mb": peak_rss_mb(),
        "fleet_seconds_per_wall_second": round(ro["duration_s"] / wall_s, 1) if wall_s > 0 else None,
    }
    return result


def rollout_summary(report: Report) -> str:
    ro = report["rollout"]
    lines = [
        f"wave rollout of {ro['version']} to {report['devices']} devices (seed {report['seed']},"
        f" {report['failing_devices']} failing): {ro['state']} after {ro['duration_s']:.0f}s of fleet time"
        f" ({report['wall']['seconds']:.1f}s wall) - {ro['detail']}",
    ]
    for w in ro["waves"]:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(w["counts"].items())) or "untouched"
        devices = f"{w['size']} device" + ("" if w["size"] == 1 else "s")
        lines.append(f"  {wave_label(w['index'], canary=w.get('canary', False))}: {devices}, {w['state']}: {counts}")
    d = report["downloads"]
    lines.append(f"downloads: at most {d['max_concurrent']} at once (bound {d['bound']}), {d['served']} chunks"
                 f" served, {d['busy']} busy answers")
    lines.append("devices: " + ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items())))
    lines.append(f"offered after abort: {ro['devices_offered_after_abort']}   lost: {report['lost']}"
                 f"   conservation_ok: {report['conservation_ok']}")
    return "\n".join(lines)


__all__ = ["public_key_for", "rollout_summary", "run_rollout"]
