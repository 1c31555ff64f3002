#!/usr/bin/env python3
"""Benchmark `edge-agent status` on a large fleet against raw sqlite3 on the same file.

    python scripts/bench_status.py [--devices N] [--quick]

Builds a leader database of N devices (default 100,000; `--quick` 20,000) through the device
registry (tags, versions, a tenth offline, a rollout over a fifth of them, a configuration target
on each: every 20th device's last attempt reverted, half of those acknowledged by an operator),
then times, each as the best of three:

* ours: the whole `edge-agent status` command in this process (open read-only, the summary, one
  filtered page, the rendering): the first page, `--offline`, `--tag T --version V`, a page deep
  in the fleet (`--offset N-50`), one device in full, and `--limit 0` (every device listed);
* raw: a hand-written `SELECT` of the same rows on the same file (no summary, no rendering),
  for the filters and the full listing.

Progress goes to stderr; the last line on stdout is one JSON object. Target: every command in
under 2 s at 100,000 devices.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.cli import main as cli
from agent.core.clock import SystemClock
from agent.leader.registry import DeviceRegistry
from agent.protocol import ConfigState, Heartbeat, SystemSample
from config_rollout.attempt_acks import AttemptAckStore
from rollout_engine.spec import spec_from_dict
from rollout_engine.store import RolloutStore


def held(n: int) -> ConfigState:
    """What device n's configuration target `app` holds: every 20th reverted its second attempt."""
    if n % 20 == 0:
        return ConfigState(version="1.0.0", state="rolled_back", attempt=2)
    return ConfigState(version="1.1.0", state="committed", attempt=1)


def build(path: Path, devices: int) -> None:
    clock = SystemClock()
    ids = [f"pi-{n:06d}" for n in range(devices)]
    with DeviceRegistry.open(path, clock=clock) as reg:
        for start in range(0, devices, 5000):
            reg.apply_heartbeats([
                Heartbeat(device_id=i, seq=1, uptime_s=100.0, firmware_version="1.1.0" if n % 3 else "1.0.0",
                          tags=("lab",) if n % 7 == 0 else ("field", "north"), boot="b",
                          sample=SystemSample(cpu_percent=10.0, mem_percent=30.0), configs={"app": held(n)})
                for n, i in enumerate(ids[start:start + 5000], start)])
        for n in range(0, devices, 10):
            reg.apply_presence(ids[n], False)
    with AttemptAckStore.open(path) as acks:  # an operator acknowledged half of the reverted attempts
        for n in range(0, devices, 40):
            acks.acknowledge(ids[n], "app", held(n), by="bench", now_ms=clock.now_ms())
    artifact = path.parent / "fw.bin"
    artifact.write_bytes(b"x")
    spec = spec_from_dict({"rollout": {"name": "bench", "artifact": str(artifact), "seed": 1},
                           "waves": {"canary": 10, "counts": [devices // 5 - 10]},
                           "gates": {"success_threshold_pct": 100.0}, "device": {"timeout_s": 100.0}})
    members = ids[: devices // 5]
    with RolloutStore.open(path, clock=clock) as store:
        store.create_rollout("r1", spec=spec, artifact=str(artifact), version="1.2.0", signed_manifest=b"m",
                             waves=[members[:10], members[10:]], from_versions={})


def best_of(runs: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def ours(db: Path, *args: str) -> Callable[[], object]:
    def run() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli(["status", "--db", str(db), *args])
        if code != 0:
            raise SystemExit(f"status {' '.join(args)} exited {code}")
    return run


def raw(db: Path, sql: str, params: tuple[object, ...] = ()) -> Callable[[], object]:
    def run() -> None:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            conn.execute(sql, params).fetchall()
        finally:
            conn.close()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    devices = args.devices or (20_000 if args.quick else 100_000)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "leader.db"
        started = time.perf_counter()
        build(db, devices)
        print(f"built {devices} devices in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        cols = "device_id, online, offline_reason, last_seen_ms, firmware_version, tags"
        result: dict[str, object] = {"devices": devices}
        cases = {
            "first_page": (ours(db), raw(db, f"SELECT {cols} FROM devices ORDER BY device_id LIMIT 50")),
            "offline": (ours(db, "--offline"),
                        raw(db, f"SELECT {cols} FROM devices WHERE online = 0 ORDER BY device_id LIMIT 50")),
            "tag_and_version": (
                ours(db, "--tag", "lab", "--version", "1.0.0"),
                raw(db, f"SELECT {cols} FROM devices WHERE firmware_version = '1.0.0' AND tags LIKE '%\"lab\"%'"
                        " ORDER BY device_id LIMIT 50")),
            "deep_page": (ours(db, "--offset", str(devices - 50)),
                          raw(db, f"SELECT {cols} FROM devices ORDER BY device_id LIMIT 50 OFFSET {devices - 50}")),
            "rollout": (ours(db, "--rollout", "r1"),
                        raw(db, f"SELECT {cols} FROM devices WHERE device_id IN (SELECT device_id FROM rollout_devices"
                                " WHERE rollout_id = 'r1') ORDER BY device_id LIMIT 50")),
            "one_device": (ours(db, "--device", f"pi-{devices // 2:06d}"),
                           raw(db, "SELECT * FROM devices WHERE device_id = ?", (f"pi-{devices // 2:06d}",))),
            "all_devices": (ours(db, "--limit", "0"), raw(db, f"SELECT {cols} FROM devices ORDER BY device_id")),
        }
        for name, (ours_fn, raw_fn) in cases.items():
            mine, base = best_of(3, ours_fn), best_of(3, raw_fn)
            result[f"{name}_s"] = round(mine, 4)
            result[f"{name}_raw_select_s"] = round(base, 4)
            print(f"{name}: ours {mine:.3f}s, raw select {base:.3f}s", file=sys.stderr)
        result["slowest_s"] = max(v for k, v in result.items() if k.endswith("_s") and "raw" not in k
                                  and isinstance(v, float))
        result["targets"] = {"every_command_s<2": result["slowest_s"] < 2.0} if devices >= 100_000 else {}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
