"""Configuration rollout benchmark: what commit-confirmed costs on the device, what layers cost
the leader, and how fast the simulator rehearses a config rollout; each against a baseline in
the same run.

    python scripts/bench_config.py [--applies N] [--devices D] [--sim-devices S]

- apply: `ConfigApplier.apply` of a 2-document release (verify already done; stage, journal,
  keep the old documents, swap, commit: every step fsynced; no commands, settle 0, the host's
  confirm passing at once), median of N, against the baseline of writing the same documents
  the plain safe way (beside, fsync, rename, fsync the folder).
- layers: the leader's config offers for D devices with 3 layer values each (the values read
  from the layer store, each offer encoded) against the same offers without layers; and the
  device's rendering of its documents from those values.
- simulate: the config-rollout scenario with S devices (10% cut off by the config) on virtual
  time: wall seconds and fleet seconds per wall second, and the same scenario with no device cut
  off (a rollout that commits everywhere) as the baseline.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _release(tmp: Path, version: str, docs: dict[str, bytes], key: object) -> bytes:
    from config_rollout.release import build_release

    src = tmp / f"src-{version}"
    src.mkdir()
    for n, data in docs.items():
        (src / n).write_bytes(data)
    return build_release("app", version, [src / n for n in docs], key, created_ms=1)  # type: ignore[arg-type]


async def bench_apply(tmp: Path, applies: int) -> dict[str, float]:
    from agent.core.config import ConfigTargetSection
    from agent.service.files import fsync_path, write_private_file
    from config_rollout.device.apply import ConfigApplier
    from config_rollout.release import parse_release
    from rollout_engine.keys import SigningKey

    key = SigningKey.generate()
    target = ConfigTargetSection(directory=str(tmp / "etc" / "app"), settle_s=0.0)

    async def fine() -> str:
        return ""

    applier = ConfigApplier("app", target, tmp / "state", confirm=fine)
    releases = [parse_release(_release(tmp, f"1.{i}.0", {"app.toml": f"port = {i}\n".encode() * 200,
                                                          "limits.conf": f"max = {i}\n".encode() * 50}, key),
                              key.public) for i in range(applies)]
    took = []
    for release in releases:
        start = time.perf_counter()
        result = await applier.apply(release)
        took.append(time.perf_counter() - start)
        assert result.state == "committed", result
    plain_dir = tmp / "plain"
    plain_dir.mkdir()
    base = []
    for release in releases:
        start = time.perf_counter()
        for n, data in release.documents.items():
            beside = plain_dir / f".{n}.new"
            write_private_file(beside, data, 0o644)
            os.replace(beside, plain_dir / n)
        fsync_path(plain_dir)
        base.append(time.perf_counter() - start)
    return {"apply_ms": round(statistics.median(took) * 1000, 2),
            "baseline_plain_write_ms": round(statistics.median(base) * 1000, 2),
            "apply_ratio": round(statistics.median(took) / statistics.median(base), 1)}


def bench_layers(tmp: Path, devices: int) -> dict[str, float]:
    import msgspec

    from config_rollout.layer_store import LayerStore
    from config_rollout.layers import render
    from config_rollout.messages import ConfigOffer
    from rollout_engine.keys import SigningKey

    key = SigningKey.generate()
    raw = _release(tmp, "2.0.0", {"app.toml": b"log_level = 'info'\nport = 8080\n[limits]\nmax = 10\n"}, key)
    ids = [f"pi-{i:05d}" for i in range(devices)]
    tags = {d: ("site-a", "cold") if i % 2 else ("site-b",) for i, d in enumerate(ids)}
    with LayerStore.open(tmp / "leader.db") as store:
        store.set_value("app", "tag", "site-a", "app.toml", "log_level", "debug", set_by="bench", now_ms=1)
        store.set_value("app", "tag", "cold", "app.toml", "limits.max", 20, set_by="bench", now_ms=1)
        store.set_value("app", "tag", "site-b", "app.toml", "port", 9090, set_by="bench", now_ms=1)
        for d in ids[::10]:
            store.set_value("app", "device", d, "app.toml", "port", 7000, set_by="bench", now_ms=1)
        enc = msgspec.msgpack.Encoder()
        start = time.perf_counter()  # as the leader's port makes a wave's offers: the layers read once
        values = store.values_for_devices("app", tags, now_ms=2)
        offers = [enc.encode(ConfigOffer(rollout_id="r", release=raw, layers=values[d])) for d in ids]
        layered = time.perf_counter() - start
        start = time.perf_counter()
        plain = [enc.encode(ConfigOffer(rollout_id="r", release=raw)) for _ in ids]
        bare = time.perf_counter() - start
    from config_rollout.release import parse_release

    release = parse_release(raw, key.public)
    with LayerStore.open(tmp / "leader.db") as store:
        one = store.values_for("app", ids[1], tags[ids[1]], now_ms=2)
    start = time.perf_counter()
    for _ in range(1000):
        render(release.documents, one)
    rendering = (time.perf_counter() - start) / 1000
    assert len(offers) == len(plain) == devices
    return {"layered_offers_per_device_us": round(layered / devices * 1e6, 1),
            "baseline_offers_without_layers_per_device_us": round(bare / devices * 1e6, 1),
            "device_render_us": round(rendering * 1e6, 1)}


async def bench_sim(tmp: Path, devices: int) -> dict[str, float]:
    from agent.sim.config_rollout import config_rollout_options, run_config_rollout

    out: dict[str, float] = {}
    for name, rate in (("cut", 0.1), ("baseline_no_cut", 0.0)):
        start = time.perf_counter()
        report = await run_config_rollout(config_rollout_options(devices=devices, seed=7, progress=False),
                                          workdir=tmp / name, cut_rate=rate)
        wall = time.perf_counter() - start
        assert report["lost"] == 0 and report["conservation_ok"], report["lost"]
        out[f"sim_{name}_wall_s"] = round(wall, 2)
        out[f"sim_{name}_fleet_s_per_wall_s"] = round(report["rollout"]["duration_s"] / wall, 1)
        out[f"sim_{name}_state"] = report["rollout"]["state"]  # type: ignore[assignment]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--applies", type=int, default=30)
    parser.add_argument("--devices", type=int, default=2000)
    parser.add_argument("--sim-devices", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-config-") as tmp:
        root = Path(tmp)
        (root / "a").mkdir()
        (root / "l").mkdir()
        result: dict[str, object] = {"applies": args.applies, "devices": args.devices,
                                     "sim_devices": args.sim_devices}
        result.update(asyncio.run(bench_apply(root / "a", args.applies)))
        result.update(bench_layers(root / "l", args.devices))
        result.update(asyncio.run(bench_sim(root / "s", args.sim_devices)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
