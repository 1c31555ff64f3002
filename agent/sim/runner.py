"""Drive a simulated fleet through its timeline and collect the report.

The timeline (all drawn from generators seeded by `--seed`):

* t=0 the leader starts; each device boots at a random phase within its first heartbeat
  interval (quantized to tenths of it, so devices share timer deadlines as real fleets do);
* every device sends telemetry every `telemetry_s`, heartbeats every `heartbeat_s`;
* `offline_rate` of the devices lose their uplink once for `offline_duration_s`;
* the whole broker goes away for `--broker-outage AT:FOR`;
* `--jobs N` jobs are submitted after the first heartbeat round.

After `duration_s` the faults are healed and the fleet runs on until every outbox is empty and
every job is confirmed (at most `drain_s`), then the workers stop, the leader processes what it
holds, and the numbers are read.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from agent.core.clock import Clock, SystemClock, VirtualClock
from agent.core.errors import EdgeAgentError
from agent.protocol import JobSubmit
from agent.sim.fleet import SimFleet, device_name, rng_for
from agent.sim.options import SimOptions
from agent.sim.report import Report, collect_report
from agent.worker.actors import RecordTelemetry

Action = Callable[[], Awaitable[None] | None]
Progress = Callable[[str], None]
PHASE_SLOTS = 10
DRAIN_QUANTUM_S = 60.0


class Timeline:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Action]] = []
        self._order = itertools.count()

    def at(self, t: float, label: str, action: Action) -> None:
        heapq.heappush(self._heap, (t, next(self._order), label, action))

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    async def run_due(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now + 1e-9:
            _, _, _, action = heapq.heappop(self._heap)
            result = action()
            if result is not None:
                await result


class Simulation:
    def __init__(self, opts: SimOptions, *, workdir: Path, progress: Progress | None = None) -> None:
        self.opts = opts
        self.workdir = workdir
        self.clock: Clock = SystemClock() if (opts.realtime or opts.broker_url) else VirtualClock()
        self.fleet = SimFleet(opts, clock=self.clock, workdir=workdir)
        self.timeline = Timeline()
        self._progress = progress
        self._t0 = 0.0
        self._generating = True
        self.telemetry_refused = 0
        self.jobs_submitted = 0
        self.offline_episodes: list[tuple[str, float, float]] = []
        self.drain_fleet_s = 0.0
        self.drained = False

    # -- time ------------------------------------------------------------------------------------
    def now(self) -> float:
        return self.clock.monotonic() - self._t0

    async def _advance_to(self, t: float) -> None:
        delta = t - self.now()
        if delta <= 0:
            await asyncio.sleep(0)
            return
        if isinstance(self.clock, VirtualClock):
            await self.clock.advance(delta)
        else:
            await asyncio.sleep(delta)

    async def _run_until(self, end: float, *, report_every: float | None = None) -> None:
        next_report = report_every if report_every else None
        while self.now() < end - 1e-9:
            candidates = [end]
            nt = self.timeline.next_time()
            if nt is not None:
                candidates.append(nt)
            if next_report is not None:
                candidates.append(next_report)
            target = min(candidates)
            await self._advance_to(target)
            await self.timeline.run_due(self.now())
            if next_report is not None and self.now() >= next_report - 1e-9:
                await self._say_progress()
                next_report += report_every  # type: ignore[operator]

    async def _say_progress(self) -> None:
        if self._progress is None:
            return
        fleet = self.fleet
        online = sum(1 for w in fleet.workers.values() if w.transport.connected.is_open)
        pending = await fleet.outbox_pending()
        leader = fleet.leader
        assert leader is not None
        hb = leader.intake.statistics() if leader.intake is not None else None
        self._progress(
            f"t={_fmt(self.now())} online={online}/{len(fleet.workers)} outbox_pending={pending}"
            f" leader_mailbox={hb.depth if hb else 0}/{hb.capacity if hb else 0}"
            f" jobs_confirmed={leader.jobs_queue.stats().confirmed}/{self.jobs_submitted}"
        )

    # -- the plan ----------------------------------------------------------------------------------
    def _plan(self) -> None:
        opts = self.opts
        fleet = self.fleet
        boot = rng_for(opts.seed, "boot")
        for i in range(opts.devices):
            device = device_name(i)
            phase = boot.randrange(PHASE_SLOTS) * opts.heartbeat_s / PHASE_SLOTS
            self.timeline.at(phase, f"boot {device}", lambda d=device: fleet.start_worker(d))
            if opts.telemetry_s > 0:
                offset = phase + boot.random() * opts.telemetry_s
                self._telemetry_loop(device, offset, rng_for(opts.seed, f"telemetry:{device}"))
        if fleet.broker is not None:
            self.offline_episodes = self.offline_plan()
            for device, start, span in self.offline_episodes:
                self.timeline.at(start, f"cut {device}", lambda d=device: fleet.cut(d))
                self.timeline.at(start + span, f"heal {device}", lambda d=device: fleet.heal(d))
        if opts.broker_outage is not None and fleet.broker is not None:
            at, span = opts.broker_outage
            self.timeline.at(at, "broker down", fleet.broker_down)
            self.timeline.at(at + span, "broker up", fleet.broker_up)
        if opts.jobs > 0:
            self.timeline.at(min(2 * opts.heartbeat_s, opts.duration_s / 2), "submit jobs", self._submit_jobs)

    def offline_plan(self) -> list[tuple[str, float, float]]:
        """(device, start, duration) of every uplink loss, drawn from the seed alone."""
        opts = self.opts
        if opts.offline_rate <= 0:
            return []
        pick = rng_for(opts.seed, "offline")
        count = round(opts.offline_rate * opts.devices)
        latest = max(0.0, opts.duration_s - opts.offline_duration_s)
        devices = [device_name(i) for i in range(opts.devices)]
        plan = []
        for device in sorted(pick.sample(devices, count)):
            start = float(int(pick.uniform(opts.heartbeat_s, max(opts.heartbeat_s, latest))))
            plan.append((device, start, opts.offline_duration_s))
        return plan

    def _telemetry_loop(self, device: str, first: float, rng: object) -> None:
        worker = self.fleet.workers[device]
        interval = self.opts.telemetry_s

        def fire() -> None:
            if not self._generating:
                return
            if worker.telemetry is not None:
                try:
                    worker.telemetry.tell(RecordTelemetry("temperature", round(20 + 10 * rng.random(), 3)))  # type: ignore[attr-defined]
                except EdgeAgentError:
                    self.telemetry_refused += 1
            self.clock.call_later(interval, fire)

        self.clock.call_later(first, fire)

    async def _submit_jobs(self) -> None:
        leader = self.fleet.leader
        assert leader is not None
        jobs = [JobSubmit(job_id=f"job-{n:06d}", kind="sim", payload=f"{n}".encode()) for n in range(self.opts.jobs)]
        await leader.submit_jobs(jobs)
        self.jobs_submitted = len(jobs)

    # -- the run -----------------------------------------------------------------------------------
    async def run(self) -> Report:
        opts = self.opts
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        self._t0 = self.clock.monotonic()
        await self.fleet.open()
        try:
            await self.fleet.start_leader()
            self._plan()
            await self._run_until(opts.duration_s, report_every=opts.duration_s / 10 if opts.progress else None)
            # Heal and drain: everything held must arrive.
            self._generating = False
            self.fleet.broker_up()
            for device in list(self.fleet._cut):
                self.fleet.heal(device)
            await self._drain()
            for worker in self.fleet.workers.values():
                await worker.stop()  # idle after the drain: no clock time needed
            await self._advance_to(self.now() + opts.leader_interval_s + 1.0)
            report = await collect_report(self, wall_s=time.perf_counter() - wall0,
                                          cpu_s=time.process_time() - cpu0)
        finally:
            await self._with_time(self.fleet.stop())
        return report

    async def _with_time(self, aw: Awaitable[None]) -> None:
        """Await `aw` while virtual time keeps moving (an actor may be asleep on the clock)."""
        task = asyncio.ensure_future(aw)
        if not isinstance(self.clock, VirtualClock):
            await task
            return
        while not task.done():
            await self.clock.advance(0.5)
        await task

    async def _drain(self) -> None:
        """Run on until nothing is pending, in whole `DRAIN_QUANTUM_S` periods: the exact moment
        the last ack lands may vary by a retry's jitter; whole periods keep the report stable."""
        start = self.now()
        leader = self.fleet.leader
        assert leader is not None
        while self.now() - start < self.opts.drain_s:
            await self._run_until(self.now() + DRAIN_QUANTUM_S)
            jobs = leader.jobs_queue.stats()
            if await self.fleet.outbox_pending() == 0 and jobs.pending == 0 and jobs.in_flight == 0:
                self.drained = True
                break
        self.drain_fleet_s = self.now() - start


def _fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h:d}:{m:02d}:{s:02d}"


__all__ = ["Simulation", "Timeline"]
