#!/usr/bin/env python3
"""Several leaders on one PostgreSQL: how soon the job queue's holder applies a worker's result
that another leader took (posted to `job_results_posted`), and what the holder costs the server
while nothing happens.

    python scripts/bench_job_wake.py [--quick] [--rounds N]

Needs Debian's postgresql (server binaries under /usr/lib/postgresql/*/bin) and the project's
`postgresql` extra (psycopg); it starts its own cluster on a free loopback port. Two leaders'
job queues (the product's `JobQueue`) share the database: gw1 holds the queue, gw2 stands by.
Each round gw1 offers a job to a worker, gw2 posts the worker's result at a random moment, and
the time until gw1 has confirmed it is measured:

- `notify`: gw1 listens on the queue's channel (`Store.listener`) and claims at the notice, as a
  leader does while its listening session is up;
- `tick` (the baseline, in the same run): gw1 claims on a tick every second, as a leader did
  before and still does while its listening session is lost.

Idle: for `--idle` seconds nothing is posted; the server's committed transactions per second
(pg_stat_database) and its CPU (psutil) with gw1 ticking, then with gw1 listening. The last line
is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_pg_driver  # noqa: E402  (the PostgreSQL cluster and its CPU)

from agent.core.clock import SystemClock  # noqa: E402
from agent.leader.jobs import CHANNEL, JobQueue  # noqa: E402
from agent.protocol import JobDemand, JobResult, JobSubmit  # noqa: E402

TICK_S = 1.0  # the holder's tick (`agent.leader.agent.LeaderAgent._tend_jobs`)


def log(message: str) -> None:
    print(f"[bench_job_wake] {message}", file=sys.stderr, flush=True)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 2),
            "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 2), "max": round(ordered[-1], 2)}


class Pair:
    """gw1 holding the queue with one worker bound (window 1), gw2 standing by."""

    def __init__(self, url: str) -> None:
        self.clock = SystemClock()
        self.holder = JobQueue.open(url, clock=self.clock, holder="gw1")
        self.standby = JobQueue.open(url, clock=self.clock, holder="gw2")
        assert self.holder.held and not self.standby.held
        self.holder.demand(JobDemand(worker="w1", incarnation="i1", window=1), seq=1)
        self.n = 0

    def offer(self) -> JobResult:
        self.n += 1
        job_id = f"j{self.n}"
        self.holder.submit(JobSubmit(job_id=job_id, kind="work", payload=b"p"))
        (dispatch,) = self.holder.dispatch()
        assert dispatch.offer.job_id == job_id
        return JobResult(job_id=job_id, epoch=self.holder.epoch, worker="w1", ok=True)

    def confirmed(self) -> int:
        return sum(ack.outcome == "confirmed" for ack in self.holder.read_results())

    def close(self) -> None:
        self.holder.close()
        self.standby.close()


async def by_notice(pair: Pair, rounds: int, rng: random.Random) -> list[float]:
    listener = pair.holder.listener(CHANNEL)
    assert listener is not None
    await listener.wait(pair.clock, 0)  # listening (its first wait hears every channel once)
    out: list[float] = []
    try:
        for _ in range(rounds):
            result = pair.offer()
            await asyncio.sleep(rng.uniform(0, 0.05))
            posted = time.perf_counter()
            pair.standby.result(result)
            while True:
                heard = await listener.wait(pair.clock, 5.0)
                if heard and pair.confirmed():
                    break
            out.append((time.perf_counter() - posted) * 1000)
    finally:
        listener.close()
    return out


async def by_tick(pair: Pair, rounds: int, rng: random.Random) -> list[float]:
    out: list[float] = []
    waiting: dict[str, float] = {}
    done = asyncio.Event()

    async def ticks() -> None:
        while not done.is_set():
            await asyncio.sleep(TICK_S)
            if pair.confirmed():
                for job_id, posted in list(waiting.items()):
                    out.append((time.perf_counter() - posted) * 1000)
                    del waiting[job_id]
                if len(out) >= rounds:
                    done.set()

    ticking = asyncio.create_task(ticks())
    while len(out) < rounds:
        result = pair.offer()
        await asyncio.sleep(rng.uniform(0, TICK_S))  # the post falls anywhere between two ticks
        waiting[result.job_id] = time.perf_counter()
        pair.standby.result(result)
        while waiting:
            await asyncio.sleep(0.01)
    done.set()
    await ticking
    return out[:rounds]


def server_counts(url: str, postmaster: int) -> tuple[int, float]:
    """(transactions committed in the database so far, the server's CPU seconds so far)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0]), bench_pg_driver.server_cpu(postmaster)


async def idle(pair: Pair, url: str, postmaster: int, seconds: float, *, listening: bool) -> dict[str, float]:
    listener = pair.holder.listener(CHANNEL) if listening else None
    if listener is not None:
        await listener.wait(pair.clock, 0)
    await asyncio.sleep(2.0)  # the server's statistics of what came before flushed
    before, _ = server_counts(url, postmaster)
    await asyncio.sleep(2.0)
    xacts0, cpu0 = server_counts(url, postmaster)
    reading = xacts0 - before  # what one reading of the counters itself commits
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        if listener is not None:
            if await listener.wait(pair.clock, left):
                pair.confirmed()
                pair.holder.read_demands()
        else:
            await asyncio.sleep(min(TICK_S, left))
            pair.confirmed()
            pair.holder.read_demands()
    await asyncio.sleep(2.0)
    xacts1, cpu1 = server_counts(url, postmaster)
    if listener is not None:
        listener.close()
    return {"transactions_per_s": round((xacts1 - xacts0 - reading) / seconds, 2),
            "server_cpu_ms_per_s": round((cpu1 - cpu0) * 1000 / (seconds + 2.0), 3)}


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(7)
    with bench_pg_driver.cluster() as (url, pids):
        pair = Pair(url)
        try:
            log(f"{args.rounds} results posted by the standby, the holder listening")
            notice = await by_notice(pair, args.rounds, rng)
            tick_rounds = max(10, args.rounds // 5)
            log(f"{tick_rounds} results posted by the standby, the holder ticking every {TICK_S}s")
            tick = await by_tick(pair, tick_rounds, rng)
            log(f"idle for {args.idle}s, ticking, then listening")
            idle_tick = await idle(pair, url, pids[0], args.idle, listening=False)
            idle_notice = await idle(pair, url, pids[0], args.idle, listening=True)
        finally:
            pair.close()
    return {
        "rounds": args.rounds,
        "posted_to_confirmed_ms": {"notify": summary(notice), "tick_baseline": summary(tick)},
        "idle_holder": {"notify": idle_notice, "tick_baseline": idle_tick},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of each idle window")
    parser.add_argument("--quick", action="store_true", help="40 rounds, 5 s idle windows")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.idle = 40, 5.0
    print(json.dumps(asyncio.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
