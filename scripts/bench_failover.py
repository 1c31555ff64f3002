#!/usr/bin/env python3
"""Fail-over between several leaders on one PostgreSQL: from the SIGKILL of the leader holding the
orchestrator lease to the first finished orchestrator tick of the leader that takes it over, and
from the SIGKILL of the leader running the job queue to another opening it (its new epoch).

    python scripts/bench_failover.py [--quick] [--kills N] [--lease S]

Needs Debian's mosquitto and postgresql (server binaries under /usr/lib/postgresql/*/bin) and
the project's `postgresql` extra (psycopg). It starts its own mosquitto and PostgreSQL cluster on
free loopback ports and three real `edge-agent run` leaders sharing one database and one shared
subscription (`[leader] rollout_lease_s` = --lease). Each round waits until one leader holds the
lease and has ticked, SIGKILLs it, and reads the lease row until another leader holds it and has
finished a tick (`ticked_ms`, the database server's time: the same clock as the kill's on this
one machine); the killed leader is then started again. The baseline, measured in the same run:
the same hand-over after a clean stop (SIGTERM: the holder releases the lease). The job queue's
lease (`job_lease_s` = --lease) is measured the same way, to the time the next leader took it
(its `acquired_ms`, the server's time). The last line is JSON: median and max seconds of each, and
whether the kills stayed under the 15 s target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_mqtt  # noqa: E402  (the broker)
import bench_pg_driver  # noqa: E402  (the PostgreSQL cluster)

from agent.core.clock import SystemClock  # noqa: E402
from agent.core.errors import StoreError  # noqa: E402
from rollout_engine.lease import lease_of  # noqa: E402
from rollout_engine.store import LeaseRow, RolloutStore  # noqa: E402

TARGET_S = 15.0
NAMES = ("gw1", "gw2", "gw3")


def log(message: str) -> None:
    print(f"[bench_failover] {message}", file=sys.stderr, flush=True)


def _config(path: Path, name: str, url: str, lease_s: float) -> Path:
    path.write_text("\n".join([
        "[agent]", 'role = "leader"', f'device_id = "{name}"', 'fleet = "bench"', 'log_level = "INFO"',
        "[leader]", f'database = "{url}"', 'shared_group = "leaders"', f"rollout_lease_s = {lease_s}",
        f"job_lease_s = {lease_s}",
        "[metrics]", 'listen = ""', "[artifacts]", 'listen = ""',
    ]) + "\n")
    return path


def _start(work: Path, name: str, broker_port: int, url: str, lease_s: float) -> subprocess.Popen[bytes]:
    conf = _config(work / f"{name}.toml", name, url, lease_s)
    with open(work / f"{name}.log", "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--config", str(conf), "--broker",
             f"mqtt://127.0.0.1:{broker_port}", "--data-dir", str(work / name)],
            stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})


def _lease(url: str) -> LeaseRow | None:
    try:
        with RolloutStore.open_readonly(url, clock=SystemClock()) as store:
            return lease_of(store)
    except StoreError:
        return None


def _wait(url: str, ok: object, what: str, limit_s: float = 120.0) -> LeaseRow:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        lease = _lease(url)
        if lease is not None and lease.ticked_ms is not None and ok(lease):  # type: ignore[operator]
            return lease
        time.sleep(0.02)
    raise SystemExit(f"bench_failover: {what} not within {limit_s:g}s")


def hand_over(url: str, procs: dict[str, subprocess.Popen[bytes]], signal_name: str) -> float:
    """Stop the holder (SIGKILL or SIGTERM); seconds until another leader finished a tick."""
    holder = _wait(url, lambda lease: procs[lease.holder].poll() is None, "a leader running the rollouts")
    proc = procs[holder.holder]
    at_ms = time.time() * 1000
    proc.kill() if signal_name == "kill" else proc.terminate()
    taken = _wait(url, lambda lease: lease.token > holder.token and lease.ticked_ms > at_ms, "the take-over")
    proc.wait(30)
    return (float(taken.ticked_ms or 0) - at_ms) / 1000


def _job_lease(url: str) -> tuple[str, int, int] | None:
    """(holder, epoch, taken_ms) of the job queue's lease."""
    from agent.core import postgres
    from agent.core.sql import ServerUrl

    try:
        conn = postgres.connect(ServerUrl(url))
    except StoreError:
        return None
    try:
        from agent.core.lease import lease_row
        from agent.leader.jobs import LEASE_NAME

        row = lease_row(conn, LEASE_NAME)
        epoch = conn.execute("SELECT value FROM jobqueue_meta WHERE key = 'epoch'").fetchone()
        return (row.holder, int(epoch[0]) if epoch else 0, row.acquired_ms) if row is not None else None
    except StoreError:
        return None
    finally:
        conn.close()


def hand_over_jobs(url: str, procs: dict[str, subprocess.Popen[bytes]], signal_name: str) -> float:
    """Stop the leader running the job queue; seconds until another leader opened it."""
    deadline = time.monotonic() + 120
    while (held := _job_lease(url)) is None or procs[held[0]].poll() is not None:
        if time.monotonic() > deadline:
            raise SystemExit("bench_failover: no leader running the job queue within 120s")
        time.sleep(0.02)
    holder, epoch, _ = held
    at_ms = time.time() * 1000
    procs[holder].kill() if signal_name == "kill" else procs[holder].terminate()
    deadline = time.monotonic() + 120
    while (taken := _job_lease(url)) is None or taken[1] <= epoch:
        if time.monotonic() > deadline:
            raise SystemExit("bench_failover: the job queue not taken over within 120s")
        time.sleep(0.02)
    procs[holder].wait(30)
    return (taken[2] - at_ms) / 1000


def summary(values: list[float]) -> dict[str, float | list[float]]:
    return {"median": round(statistics.median(values), 2), "max": round(max(values), 2),
            "all": [round(v, 2) for v in values]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 kills and 1 clean stop")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--stops", type=int, default=3)
    parser.add_argument("--lease", type=float, default=10.0,
                        help="[leader] rollout_lease_s and job_lease_s (default 10)")
    args = parser.parse_args(argv)
    kills, stops = (3, 1) if args.quick else (args.kills, args.stops)
    with tempfile.TemporaryDirectory(prefix="ea-bench-failover-") as tmp, bench_mqtt.mosquitto(Path(tmp)) as port, \
            bench_pg_driver.cluster() as (url, _):
        work = Path(tmp)
        procs = {name: _start(work, name, port, url, args.lease) for name in NAMES}
        try:
            measured: dict[str, list[float]] = {"kill": [], "stop": [], "jobs_kill": [], "jobs_stop": []}
            rounds_of = (("stop", stops), ("kill", kills), ("jobs_stop", stops), ("jobs_kill", kills))
            for kind, rounds in rounds_of:
                for n in range(rounds):
                    if kind.startswith("jobs_"):
                        seconds = hand_over_jobs(url, procs, kind.removeprefix("jobs_"))
                        log(f"{kind} {n + 1}/{rounds}: the next leader opened the job queue {seconds:.2f}s later")
                    else:
                        seconds = hand_over(url, procs, kind)
                        log(f"{kind} {n + 1}/{rounds}: the next leader ticked {seconds:.2f}s later")
                    measured[kind].append(seconds)
                    for name, proc in procs.items():  # three leaders again
                        if proc.poll() is not None:
                            procs[name] = _start(work, name, port, url, args.lease)
        finally:
            bench_mqtt.stop_processes(*procs.values())
    result = {"leaders": len(NAMES), "lease_s": args.lease, "kills": kills,
              "kill_to_first_tick_s": summary(measured["kill"]),
              "baseline_clean_stop_to_first_tick_s": summary(measured["stop"]),
              "job_queue_kill_to_taken_s": summary(measured["jobs_kill"]),
              "job_queue_baseline_clean_stop_to_taken_s": summary(measured["jobs_stop"]),
              "target_s": TARGET_S,
              "target_met": max(measured["kill"]) < TARGET_S and max(measured["jobs_kill"]) < TARGET_S}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
