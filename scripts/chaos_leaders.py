#!/usr/bin/env python3
"""A chaos run of several leaders on one PostgreSQL: real `edge-agent run` leader processes on a
real mosquitto's shared subscription, real worker agents sending telemetry, leaders SIGKILLed
(and started again) and SIGSTOPped (and continued) at random, PostgreSQL restarted once.

    python scripts/chaos_leaders.py [--quick] [--seconds S] [--leaders N] [--workers W] [--seed K]

Needs Debian's mosquitto and postgresql and the project's `postgresql` extra. At the end every
worker's outbox must drain, and the shared registry must hold each worker's telemetry exactly as
many times as the worker's agent accepted a record (`lost` and `applied_twice` both 0). The last
line is JSON. Rollouts and jobs are each leader's own for now: they are not part of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for where in (ROOT, ROOT / "tests"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

from mosquitto import Mosquitto  # noqa: E402  (tests/: a real broker on a free loopback port)
from postgres import PostgresCluster  # noqa: E402  (tests/: a real PostgreSQL cluster)

from tests.e2e.agent_support import pending, spawn_agent, worker  # noqa: E402


def log(message: str) -> None:
    print(f"[chaos_leaders] {message}", file=sys.stderr, flush=True)


def applied(url: str) -> dict[str, int]:
    """Telemetry records applied per device in the shared registry ({} while it cannot be read)."""
    from agent.core.errors import StoreError
    from agent.leader.registry import DeviceRegistry, RegistryReads

    try:
        conn = DeviceRegistry.connect_reader(url)
    except StoreError:
        return {}
    try:
        return RegistryReads(conn).telemetry_counts()
    except StoreError:
        return {}
    finally:
        conn.close()


class Leaders:
    """The leader processes, each killed, stopped, continued and started again by name."""

    def __init__(self, work: Path, broker_url: str, database: str, count: int) -> None:
        self.work = work
        self.broker_url = broker_url
        self.sections: dict[str, dict[str, Any]] = {
            "leader": {"heartbeat_deadline_s": 30.0, "shared_group": "leaders", "database": database}}
        self.procs = {f"gw{n + 1}": self._spawn(f"gw{n + 1}") for n in range(count)}
        self.stopped: set[str] = set()
        self.dead: set[str] = set()

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        return spawn_agent(self.work, "leader", name, self.broker_url, **self.sections)

    def running(self) -> list[str]:
        return [n for n in self.procs if n not in self.stopped and n not in self.dead]

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(15)
        self.dead.add(name)

    def start(self, name: str) -> None:
        self.procs[name] = self._spawn(name)
        self.dead.discard(name)

    def stop(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGSTOP)
        self.stopped.add(name)

    def cont(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGCONT)
        self.stopped.discard(name)

    def end(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def chaos(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from agent.core.clock import SystemClock

    rng = random.Random(args.seed)
    clock = SystemClock()
    broker = Mosquitto(work / "mosquitto").start()
    database = PostgresCluster().start()
    url = database.url()
    leaders = Leaders(work, broker.url, url, args.leaders)
    fast = {"heartbeat": {"interval_s": 1.0}, "mqtt": {"reply_timeout_s": 5.0}}
    workers = [await worker(clock, work, f"w{i:02d}", url=broker.url, sections=fast) for i in range(args.workers)]
    accepted = dict.fromkeys((w.device_id for w in workers), 0)
    events: dict[str, int] = {"kills": 0, "stops": 0, "database_restarts": 0}
    due: list[tuple[float, str, str]] = []  # (when, action, leader): the undoing of a fault
    try:
        while len(applied(url)) < args.workers:  # every device heard of once
            await asyncio.sleep(0.2)
        t0 = time.monotonic()
        next_fault = t0 + rng.uniform(5, 10)
        db_restart_at = t0 + args.seconds * 0.4
        db_back_at: float | None = None
        n = 0
        while time.monotonic() - t0 < args.seconds:
            now = time.monotonic()
            for w in workers:
                await w.send_telemetry("t", float(n))  # "direct" or "outbox": accepted either way
                accepted[w.device_id] += 1
            n += 1
            for item in [d for d in due if d[0] <= now]:
                due.remove(item)
                _, action, name = item
                (leaders.start if action == "start" else leaders.cont)(name)
                log(f"{action} {name}")
            if now >= next_fault and len(leaders.running()) > 1:
                name = rng.choice(leaders.running())
                if rng.random() < 0.5:
                    leaders.kill(name)
                    events["kills"] += 1
                    due.append((now + rng.uniform(2, 8), "start", name))
                    log(f"SIGKILL {name}")
                else:
                    leaders.stop(name)
                    events["stops"] += 1
                    due.append((now + rng.uniform(3, 15), "cont", name))
                    log(f"SIGSTOP {name}")
                next_fault = now + rng.uniform(8, 20)
            if db_back_at is None and now >= db_restart_at:
                database.stop("immediate")
                events["database_restarts"] += 1
                db_back_at = now + 5.0
                log("PostgreSQL stopped")
            elif db_back_at is not None and db_back_at > 0 and now >= db_back_at:
                database.start()
                db_back_at = 0.0
                log("PostgreSQL started again")
            await asyncio.sleep(0.5)
        for _, action, name in due:  # every fault undone before the drain
            (leaders.start if action == "start" else leaders.cont)(name)
        if db_back_at:
            database.start()
        drain0 = time.monotonic()
        while True:
            held = [await pending(w) for w in workers]
            if sum(held) == 0 and sum(applied(url).get(d, 0) for d in accepted) >= sum(accepted.values()):
                break
            if time.monotonic() - drain0 > args.drain_s:
                log(f"not drained after {args.drain_s:.0f}s: {sum(held)} rows held")
                break
            await asyncio.sleep(0.5)
        drain_s = time.monotonic() - drain0
        counts = applied(url)
        lost = sum(max(0, accepted[d] - counts.get(d, 0)) for d in accepted)
        twice = sum(max(0, counts.get(d, 0) - accepted[d]) for d in accepted)
        return {"seconds": args.seconds, "leaders": args.leaders, "workers": args.workers, "seed": args.seed,
                "accepted": sum(accepted.values()), "applied": sum(counts.get(d, 0) for d in accepted),
                "lost": lost, "applied_twice": twice, **events, "drain_s": round(drain_s, 1),
                "rollouts": "not part of the run: rollouts are each leader's own"}
    finally:
        for w in workers:
            await w.stop()
        leaders.end()
        database.close()
        broker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 s instead of 5 minutes")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--leaders", type=int, default=3)
    parser.add_argument("--workers", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--drain-s", type=float, default=180.0)
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (60.0 if args.quick else 300.0)
    with tempfile.TemporaryDirectory(prefix="ea-chaos-") as tmp:
        result = asyncio.run(chaos(args, Path(tmp)))
    print(json.dumps(result))
    return 0 if result["lost"] == 0 and result["applied_twice"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
