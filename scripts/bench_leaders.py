#!/usr/bin/env python3
"""Several leaders: the same offered heartbeat load against 1 leader on SQLite (the baseline),
1 leader on PostgreSQL and 2 leaders on one PostgreSQL behind a shared subscription.

    python scripts/bench_leaders.py [--quick] [--devices N] [--rate R] [--seconds S]

Needs Debian's mosquitto and postgresql (server binaries under /usr/lib/postgresql/*/bin) and
the project's `postgresql` extra (psycopg). It starts its own mosquitto and its own PostgreSQL
cluster on free loopback ports, a fresh database a scenario. The leaders are real `edge-agent
run` processes; the load is `bench_mqtt`'s generator (one process writing pre-encoded MQTT v5
PUBLISH packets of real heartbeat envelopes of N devices, paced at R per second).

Per scenario: heartbeats the leaders answered `accepted` per second (their /metrics), each
leader's share of them, the CPU of the leader processes and of the PostgreSQL server per
accepted heartbeat (psutil, over the window), and `devices_behind`: devices whose newest stored
heartbeat is not the last one the generator sent them (0: nothing lost). The last line is JSON;
`pg1_cpu_vs_sqlite` and `pg2_cpu_vs_sqlite` compare the total CPU per accepted heartbeat with the
SQLite baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
for where in (ROOT, ROOT / "scripts"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

import bench_mqtt  # noqa: E402  (the broker and the load generator)
import bench_pg_driver  # noqa: E402  (the PostgreSQL cluster and its CPU)

FLEET = "bench"


def log(message: str) -> None:
    print(f"[bench_leaders] {message}", file=sys.stderr, flush=True)


def _leader_config(path: Path, name: str, metrics_port: int, database: str, group: str) -> Path:
    lines = [
        "[agent]", 'role = "leader"', f'device_id = "{name}"', f'fleet = "{FLEET}"', 'log_level = "WARNING"',
        "[leader]", "heartbeat_deadline_s = 600.0", "device_rate_per_s = 0.0",
        *([f'database = "{database}"'] if database else []),
        *([f'shared_group = "{group}"'] if group else []),
        "[mailbox]", "capacity = 20000",
        "[metrics]", f'listen = "127.0.0.1:{metrics_port}"',
        "[artifacts]", 'listen = ""',
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _metric(port: int, name: str) -> float:
    """One number of a leader's /metrics (`ea_leader_NAME VALUE`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith(f"ea_leader_{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"no {name} in the leader's metrics")


@contextlib.contextmanager
def leaders(work: Path, broker_port: int, count: int, database: str) -> Iterator[list[tuple[psutil.Process, int]]]:
    procs: list[subprocess.Popen[bytes]] = []
    found: list[tuple[psutil.Process, int]] = []
    work.mkdir(parents=True, exist_ok=True)
    try:
        for n in range(count):
            name = f"gw{n + 1}"
            port = bench_mqtt.free_port()
            conf = _leader_config(work / f"{name}.toml", name, port, database, "leaders" if count > 1 else "")
            out = open(work / f"{name}.log", "ab")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "run", "--config", str(conf), "--broker",
                 f"mqtt://127.0.0.1:{broker_port}", "--data-dir", str(work / name)],
                stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)}))
            out.close()
            found.append((psutil.Process(procs[-1].pid), port))
        deadline = time.monotonic() + 60
        for proc, port in found:
            while True:
                with contextlib.suppress(OSError, RuntimeError):
                    _metric(port, "accepted")
                    break
                if time.monotonic() > deadline or procs[found.index((proc, port))].poll() is not None:
                    logs = " ".join(p.read_text()[-400:] for p in work.glob("*.log"))
                    raise SystemExit(f"bench_leaders: a leader did not come up: {logs}")
                time.sleep(0.1)
        time.sleep(1.0)  # subscribed
        yield found
    finally:
        bench_mqtt.stop_processes(*procs)


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def scenario(name: str, work: Path, broker_port: int, count: int, database: str, postmaster: int | None, *,
             devices: int, rate: float, seconds: float) -> dict[str, float | list[float]]:
    log(f"{name}: {count} leader(s) on {'PostgreSQL' if database else 'SQLite'}, {rate:.0f} heartbeats/s offered")
    with leaders(work / name, broker_port, count, database) as running:
        ctx = multiprocessing.get_context("spawn")
        ready, go, counter = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
        gen = ctx.Process(target=bench_mqtt.heartbeat_publisher, daemon=True,
                          args=(broker_port, range(devices), seconds, rate, ready, go, counter))
        gen.start()
        ready.wait(120)
        before = [_metric(port, "accepted") for _, port in running]
        batches0 = sum(_metric(port, "heartbeat_batches") for _, port in running)
        cpu0 = [_cpu(p) for p, _ in running]
        srv0 = bench_pg_driver.server_cpu(postmaster) if postmaster else 0.0
        t0 = time.perf_counter()
        go.set()
        gen.join(seconds + 60)
        time.sleep(1.0)  # what the broker still held
        elapsed = time.perf_counter() - t0
        accepted = [_metric(port, "accepted") - b for (_, port), b in zip(running, before, strict=True)]
        batches = sum(_metric(port, "heartbeat_batches") for _, port in running) - batches0
        cpu = sum(_cpu(p) - c for (p, _), c in zip(running, cpu0, strict=True))
        srv = (bench_pg_driver.server_cpu(postmaster) - srv0) if postmaster else 0.0
        behind = _devices_behind(work / name, database, devices, int(counter.value), rate, seconds)
    total = sum(accepted) or 1.0
    return {
        "leaders": float(count),
        "offered": float(counter.value),
        "accepted_per_s": round(sum(accepted) / elapsed, 1),
        "shares": [round(a / total, 3) for a in accepted],
        "leader_cpu_us_per_hb": round(cpu / total * 1e6, 2),
        "server_cpu_us_per_hb": round(srv / total * 1e6, 2),
        "cpu_us_per_hb": round((cpu + srv) / total * 1e6, 2),
        "devices_behind": float(behind),
        "heartbeats_per_batch": round(sum(accepted) / max(1.0, batches), 1),
    }


def _devices_behind(work: Path, database: str, devices: int, sent: int, rate: float, seconds: float) -> int:
    """Devices whose stored heartbeat seq is not the last the generator sent them."""
    from agent.leader.registry import DeviceRegistry

    rounds, extra = divmod(sent, devices)
    expected = {f"dev-{d:05d}": rounds + (1 if d < extra else 0) for d in range(devices)}
    target = database or str(work / "gw1" / "leader.db")
    conn = DeviceRegistry.connect_reader(target)
    try:
        stored = {str(d): int(s) for d, s in conn.execute("SELECT device_id, hb_seq FROM devices")}
    finally:
        conn.close()
    return sum(1 for d, seq in expected.items() if seq and stored.get(d, -1) != seq)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short window (10 s)")
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=6_000.0, help="heartbeats/s offered")
    parser.add_argument("--seconds", type=float, default=None)
    args = parser.parse_args(argv)
    seconds = args.seconds or (10.0 if args.quick else 30.0)
    result: dict[str, object] = {"devices": args.devices, "offered_per_s": args.rate, "seconds": seconds}
    with tempfile.TemporaryDirectory(prefix="ea-bench-leaders-") as tmp, bench_mqtt.mosquitto(Path(tmp)) as port, \
            bench_pg_driver.cluster() as (base_url, pids):
        work = Path(tmp)
        result["sqlite1"] = scenario("sqlite1", work, port, 1, "", None, devices=args.devices, rate=args.rate,
                                     seconds=seconds)
        for key, count in (("pg1", 1), ("pg2", 2)):
            url = _fresh_database(base_url, key)
            result[key] = scenario(key, work, port, count, url, pids[0], devices=args.devices, rate=args.rate,
                                   seconds=seconds)
    base = result["sqlite1"]["cpu_us_per_hb"]  # type: ignore[index]
    for key in ("pg1", "pg2"):
        result[f"{key}_cpu_vs_sqlite"] = round(result[key]["cpu_us_per_hb"] / base, 2)  # type: ignore[index]
    print(json.dumps(result))
    return 0


def _fresh_database(base_url: str, name: str) -> str:
    import psycopg

    with psycopg.connect(base_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return base_url.rsplit("/", 1)[0] + f"/{name}"


if __name__ == "__main__":
    raise SystemExit(main())
