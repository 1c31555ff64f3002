#!/usr/bin/env python3
"""A chaos run of several leaders on one PostgreSQL: real `edge-agent run` leader processes on a
real mosquitto's shared subscription, real worker agents sending telemetry, pulling jobs from the
fleet's one job queue and taking one firmware rollout (the real updater on slot directories,
rebooting in-process), leaders SIGKILLed (and started again) and SIGSTOPped (and continued) at
random, PostgreSQL restarted once.

    python scripts/chaos_leaders.py [--quick] [--seconds S] [--leaders N] [--workers W] [--seed K]

Needs Debian's mosquitto and postgresql and the project's `postgresql` extra. At the end every
worker's outbox must drain, and the shared registry must hold each worker's telemetry exactly as
many times as the worker's agent accepted a record (`lost` and `applied_twice` both 0); the
rollout, started with `edge-agent rollout start --db` once every device is known, must succeed
with every wave passed, each device offered the image once (`rollout_offers`: the offers the
orchestrators decided; a new lease holder sending a pending offer again adds none) and running
the new version. The jobs (`--jobs`, submitted by one worker, an operator of the leaders, in
batches through the run) must all be confirmed, each once; `job_queue_epochs` says how many
times a leader opened the queue (its start, and every takeover). The last line is JSON.
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
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
for where in (ROOT, ROOT / "tests"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

from mosquitto import Mosquitto  # noqa: E402  (tests/: a real broker on a free loopback port)
from postgres import PostgresCluster  # noqa: E402  (tests/: a real PostgreSQL cluster)

from tests.e2e.agent_support import (  # noqa: E402
    fleet_jobs,
    pending,
    spawn_agent,
    submit_through_outbox,
    updating_worker,
)

T = TypeVar("T")


def log(message: str) -> None:
    print(f"[chaos_leaders] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def registry_reads(url: str, read: Callable[[Any], T], empty: T) -> T:
    """`read(RegistryReads)` on a read-only connection to the shared registry; `empty` while it
    cannot be read (not made yet, or the database stopped)."""
    from agent.core.errors import StoreError
    from agent.leader.registry import DeviceRegistry, RegistryReads

    try:
        conn = DeviceRegistry.connect_reader(url)
    except StoreError:
        return empty
    try:
        return read(RegistryReads(conn))
    except StoreError:
        return empty
    finally:
        conn.close()


def applied(url: str) -> dict[str, int]:
    """Telemetry records applied per device in the shared registry."""
    return registry_reads(url, lambda reads: reads.telemetry_counts(), {})


def last_heard(url: str) -> dict[str, int]:
    """When the shared registry last heard from each device (its `last_seen_ms`, what a soak's
    gate reads)."""
    return registry_reads(url, lambda reads: {d.device_id: d.last_seen_ms or 0 for d in reads.page(limit=0)[1]}, {})


def online(url: str) -> dict[str, bool]:
    """Each device's presence in the shared registry."""
    return registry_reads(url, lambda reads: {d.device_id: d.online for d in reads.page(limit=0)[1]}, {})


async def watch_heard(url: str, gaps: dict[str, float]) -> None:
    """The longest the registry went without hearing from a device, per device, in seconds
    (sampled every half second while the database answers, off the event loop)."""
    while True:
        await asyncio.sleep(0.5)
        heard = await asyncio.to_thread(last_heard, url)
        now_ms = time.time() * 1000
        for device, at_ms in heard.items():
            gap = (now_ms - at_ms) / 1000
            if at_ms and gap > gaps.get(device, 0.0):
                gaps[device] = gap
                if gap > 10 and int(gap * 2) % 10 == 0:
                    log(f"{device}: not heard from for {gap:.0f}s")


ROLLOUT_ID = "chaos-1"
NEW_VERSION = "1.1.0"


async def submit_jobs(submitter: Any, first: int, count: int) -> None:
    """`count` jobs of half a second's work from `submitter` (an operator of the leaders), through
    its outbox: accepted by the leader running the queue (the others answer busy)."""
    from agent.protocol import JobSubmit

    await submit_through_outbox(submitter, [JobSubmit(job_id=f"job-{n:05d}", kind="sleep", payload=b"0.5")
                                            for n in range(first, first + count)])


def start_rollout(work: Path, url: str, artifact: Path, workers: int) -> None:
    """`edge-agent rollout start` against the shared database: a canary of 2, then the rest in
    two waves, each soaking 60 s (the waves last through the faults; see `longest_unheard_s`, the
    longest the registry went without hearing from a device)."""
    rest = workers - 2
    spec = work / "rollout.toml"
    spec.write_text(f'[rollout]\nname = "chaos"\nartifact = "{artifact}"\n'
                    f"[waves]\ncanary = 2\ncounts = [2, {rest // 2}, {rest - rest // 2}]\n"
                    "[gates]\nsoak_s = 60\n[device]\ntimeout_s = 900\n")
    started = subprocess.run(
        [sys.executable, "-m", "agent.cli", "rollout", "start", str(spec), "--db", url, "--id", ROLLOUT_ID,
         "--no-wait"], capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    if started.returncode != 0:
        raise SystemExit(f"chaos_leaders: rollout start failed: {started.stderr.strip()}")


def rollout_outcome(url: str) -> dict[str, Any] | None:
    """The rollout as the shared database holds it (None while it cannot be read)."""
    from agent.core.clock import SystemClock
    from agent.core.errors import StoreError
    from rollout_engine.status import describe
    from rollout_engine.store import RolloutStore

    try:
        with RolloutStore.open_readonly(url, clock=SystemClock()) as store:
            if store.get(ROLLOUT_ID) is None:
                return None
            status = describe(store, ROLLOUT_ID)
            offers = Counter(device for device, _, _ in store.offers(ROLLOUT_ID))
            unfinished = [(d.device_id, d.wave, d.state, d.detail) for d in store.devices(ROLLOUT_ID)
                          if d.state not in ("succeeded", "queued")]
    except StoreError:
        return None
    return {"state": status["state"], "waves": [w["state"] for w in status["waves"]], "counts": status["counts"],
            "devices_offered": len(offers), "max_offers_per_device": max(offers.values(), default=0),
            "in_progress": unfinished}


class Leaders:
    """The leader processes, each killed, stopped, continued and started again by name."""

    def __init__(self, work: Path, broker_url: str, database: str, count: int, public_key: Path,
                 keepalive_s: int = 0) -> None:
        self.work = work
        self.broker_url = broker_url
        self.sections: dict[str, dict[str, Any]] = {
            **({"mqtt": {"keepalive_s": keepalive_s}} if keepalive_s else {}),
            "leader": {"heartbeat_deadline_s": 30.0, "shared_group": "leaders", "database": database,
                       "operators": ["w00"]},  # w00 submits the jobs
            "firmware": {"public_key": str(public_key)},  # it checks what it rolls out, as the devices do
            "artifacts": {"listen": ""}}  # the devices download over MQTT chunks, from any leader
        self.procs = {f"gw{n + 1}": self._spawn(f"gw{n + 1}") for n in range(count)}
        self.stopped: set[str] = set()
        self.dead: set[str] = set()

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        return spawn_agent(self.work, "leader", name, self.broker_url, **self.sections)

    def running(self) -> list[str]:
        return [n for n in self.procs if n not in self.stopped and n not in self.dead]

    def restart_exited(self) -> list[str]:
        """Start again the leaders that exited by themselves (one started while PostgreSQL was
        down refuses in one line, exit 2), as systemd's `Restart=on-failure` does."""
        exited = [n for n in self.running() if self.procs[n].poll() is not None]
        for name in exited:
            self.start(name)
        return exited

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


async def inject_faults(leaders: Leaders, database: PostgresCluster, rng: random.Random, events: dict[str, int],
                        due: list[tuple[float, str, str]], *, t0: float, seconds: float) -> float | None:
    """SIGKILL or SIGSTOP a random leader every 8-20 s (started again 2-8 s later, continued
    3-15 s later), PostgreSQL stopped for 5 s once, an exited leader started again; until
    `seconds` after `t0`. What is still to undo stays in `due`; returns when PostgreSQL is due
    back if it is still down (None or 0: not)."""
    next_fault = t0 + rng.uniform(5, 10)
    db_restart_at = t0 + seconds * 0.4
    db_back_at: float | None = None
    while time.monotonic() - t0 < seconds:
        now = time.monotonic()
        for name in leaders.restart_exited():
            events["restarts_after_exit"] += 1
            log(f"{name} had exited: started again")
        for item in [d for d in due if d[0] <= now]:
            due.remove(item)
            _, action, name = item
            (leaders.start if action == "start" else leaders.cont)(name)
            log(f"{action} {name}")
        if now >= next_fault and len(leaders.running()) > 1:
            name = rng.choice(leaders.running())
            if rng.random() < 0.5:
                await asyncio.to_thread(leaders.kill, name)  # (off the loop: the devices go on)
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
            await asyncio.to_thread(database.stop, "immediate")
            events["database_restarts"] += 1
            db_back_at = now + 5.0
            log("PostgreSQL stopped")
        elif db_back_at is not None and db_back_at > 0 and now >= db_back_at:
            await asyncio.to_thread(database.start)
            db_back_at = 0.0
            log("PostgreSQL started again")
        await asyncio.sleep(0.2)
    return db_back_at


async def chaos(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from agent.core.clock import SystemClock
    from firmware_rollout.artifact.fixture import make_artifact

    rng = random.Random(args.seed)
    clock = SystemClock()
    broker = Mosquitto(work / "mosquitto").start()
    database = PostgresCluster().start()
    url = database.url()
    artifact, public = make_artifact(work, version=NEW_VERSION, size=256 * 1024, chunk_size=16 * 1024)
    leaders = Leaders(work, broker.url, url, args.leaders, public, args.keepalive)
    fast = {"heartbeat": {"interval_s": 1.0}, "mqtt": {"reply_timeout_s": 5.0}, "jobs": {"demand_window": 2}}
    devices = [await updating_worker(clock, work, f"w{i:02d}", broker.url, public, fast) for i in range(args.workers)]
    workers = [agent for agent, _ in devices]
    accepted = dict.fromkeys((w.device_id for w in workers), 0)
    events: dict[str, int] = {"kills": 0, "stops": 0, "database_restarts": 0, "restarts_after_exit": 0}
    due: list[tuple[float, str, str]] = []  # (when, action, leader): the undoing of a fault
    try:
        while len(applied(url)) < args.workers:  # every device heard of once
            await asyncio.sleep(0.2)
        gaps: dict[str, float] = {}
        watcher = asyncio.get_running_loop().create_task(watch_heard(url, gaps))
        # (what blocks runs off the event loop: the devices in it go on meanwhile)
        await asyncio.to_thread(start_rollout, work, url, artifact, args.workers)
        log(f"rollout {ROLLOUT_ID} started")
        t0 = time.monotonic()
        # the faults on their own timeline: a device's send waiting on a frozen leader never
        # holds back the leader's SIGCONT or a restart
        faulting = asyncio.get_running_loop().create_task(
            inject_faults(leaders, database, rng, events, due, t0=t0, seconds=args.seconds))
        n = submitted = 0
        batches = 5  # the jobs in batches over the first half of the run: some always in flight
        while time.monotonic() - t0 < args.seconds:
            if submitted < args.jobs and time.monotonic() - t0 >= submitted / args.jobs * args.seconds / 2:
                count = min(args.jobs - submitted, -(-args.jobs // batches))
                await submit_jobs(workers[0], submitted, count)
                submitted += count
                log(f"{submitted} jobs submitted")
            for w in workers:
                await w.send_telemetry("t", float(n))  # "direct" or "outbox": accepted either way
                accepted[w.device_id] += 1
            n += 1
            await asyncio.sleep(0.5)
        db_back_at = await faulting
        for _, action, name in due:  # every fault undone before the drain
            (leaders.start if action == "start" else leaders.cont)(name)
        if db_back_at:
            await asyncio.to_thread(database.start)
        drain0 = time.monotonic()
        while True:
            held = [await pending(w) for w in workers]
            rollout = rollout_outcome(url)
            if (sum(held) == 0 and sum(applied(url).get(d, 0) for d in accepted) >= sum(accepted.values())
                    and fleet_jobs(url).confirmed >= submitted
                    and rollout is not None and rollout["state"] not in ("scheduled", "running", "paused")):
                break
            events["restarts_after_exit"] += len(leaders.restart_exited())
            if time.monotonic() - drain0 > args.drain_s:
                log(f"not drained after {args.drain_s:.0f}s: {sum(held)} rows held")
                break
            await asyncio.sleep(0.5)
        drain_s = time.monotonic() - drain0
        watcher.cancel()
        counts = applied(url)
        lost = sum(max(0, accepted[d] - counts.get(d, 0)) for d in accepted)
        twice = sum(max(0, counts.get(d, 0) - accepted[d]) for d in accepted)
        jobs = fleet_jobs(url)
        rollout = rollout_outcome(url) or {"state": "unknown"}
        rollout["devices_on_new_version"] = sum(1 for w in workers if w.firmware_version() == NEW_VERSION)
        parts = {agent.device_id: part for agent, part in devices}
        for device, wave, state, detail in rollout.get("in_progress", ()):
            part = parts.get(device)
            told = part.actor.updater.status() if part is not None and part.actor and part.actor.updater else None
            log(f"{device} (wave {wave + 1}) {state} ({detail}) at the end; its updater: {told}")
        log(f"registry: {online(url)}")
        return {"seconds": args.seconds, "leaders": args.leaders, "workers": args.workers, "seed": args.seed,
                "leader_keepalive_s": args.keepalive or 50,
                "accepted": sum(accepted.values()), "applied": sum(counts.get(d, 0) for d in accepted),
                "lost": lost, "applied_twice": twice, **events, "drain_s": round(drain_s, 1),
                "longest_unheard_s": round(max(gaps.values(), default=0.0), 1),
                "jobs": {"submitted": submitted, "confirmed": jobs.confirmed, "failed": jobs.failed,
                         "job_queue_epochs": jobs.epoch},
                "rollout": rollout}
    finally:
        for agent, part in devices:
            await part.stop()
            await agent.stop()
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
    parser.add_argument("--jobs", type=int, default=500, help="jobs submitted during the run (default 500)")
    parser.add_argument("--drain-s", type=float, default=300.0)
    parser.add_argument("--keepalive", type=int, default=0,
                        help="the leaders' [mqtt] keepalive_s (default: the shipped 50)")
    parser.add_argument("--work", default="", help="a new directory to run in and keep (default: a temporary one)")
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (60.0 if args.quick else 300.0)
    if args.work:  # kept afterwards: the leaders' logs and data directories
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=False)
        result = asyncio.run(chaos(args, work))
    else:
        with tempfile.TemporaryDirectory(prefix="ea-chaos-") as tmp:
            result = asyncio.run(chaos(args, Path(tmp)))
    print(json.dumps(result))
    rollout = result["rollout"]
    rollout_ok = (rollout["state"] == "succeeded" and rollout["max_offers_per_device"] == 1
                  and rollout["devices_on_new_version"] == result["workers"])
    jobs_ok = result["jobs"]["confirmed"] == result["jobs"]["submitted"] and result["jobs"]["failed"] == 0
    return 0 if result["lost"] == 0 and result["applied_twice"] == 0 and rollout_ok and jobs_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
