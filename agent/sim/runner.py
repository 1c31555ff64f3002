"""Drive a simulated fleet through its timeline and collect the report.

The timeline (all drawn from generators seeded by `--seed`):

* t=0 the leader starts; each device boots at a random phase within its boot window (its first
  heartbeat interval, or a whole fraction of it no longer than a minute: `boot_window_s`),
  quantized to tenths of it, so devices share timer deadlines as real fleets do;
* every device sends telemetry every `telemetry_s`, heartbeats every `heartbeat_s`;
* `offline_rate` of the devices lose their uplink once for `offline_duration_s`;
* the whole broker goes away for `--broker-outage AT:FOR`;
* `crash_rate` of the devices crash once (their agent stops; the rows they stored stay in
  their shared outbox file) and restart `crash_downtime_s` later as their next incarnation;
* `--jobs N` jobs are submitted after the first heartbeat round.

After `duration_s` the faults are healed and the fleet runs on until every outbox is empty and
every job is confirmed (at most `drain_s`); the fleet's state is sampled (the report's
`at_end`), then the workers stop, the leader processes what it holds, and the numbers are read.
`samples` times during the run the state is also sampled into the report's time series.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from agent.core.clock import Clock, SystemClock, VirtualClock
from agent.core.errors import EdgeAgentError
from agent.protocol import JobSubmit
from agent.service.http import Request, Response
from agent.sim.clock import SimClock
from agent.sim.devices import SimFirmware
from agent.sim.fleet import SimFleet, device_name, rng_for
from agent.sim.options import APP_CLASS, SimOptions
from agent.sim.part import FleetPart, split
from agent.sim.report import Report, collect_report
from agent.sim.totals import DevicesNow, DeviceTotals, device_totals, devices_now, telemetry_sending
from agent.worker.actors import RecordTelemetry

Action = Callable[[], Awaitable[None] | None]
Sample = dict[str, Any]
Progress = Callable[[Sample], None]
PHASE_SLOTS = 10
MAX_STEP_S = 60.0
GC_THRESHOLDS = (50_000, 50, 1000)


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


def keep_out_of_gc() -> None:
    """Thousands of long-lived agents: the collector's full passes over them cost more than
    everything else; keep what exists now out of them, and collect less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


APP_PATH = f"/v1/messages/{APP_CLASS}"
APP_HEADERS = {"content-type": "application/json"}


class AppLoad:
    """What the devices' applications sent and how the local API answered each."""

    def __init__(self) -> None:
        self.sent = 0
        self.direct = 0  # 202: the leader holds it
        self.stored = 0  # 202: the device's outbox holds it
        self.refused = 0  # 4xx or 5xx
        self.refused_at_source = 0  # its device was down
        self.in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, loop: asyncio.AbstractEventLoop, answer: Awaitable[Response]) -> None:
        self.sent += 1
        self.in_flight += 1
        task = loop.create_task(self._count(answer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _count(self, answer: Awaitable[Response]) -> None:
        try:
            response = await answer
        finally:
            self.in_flight -= 1
        if response.status != 202:
            self.refused += 1
        elif json.loads(response.body)["path"] == "direct":
            self.direct += 1
        else:
            self.stored += 1


class Simulation:
    """The fleet run: the timeline for `duration_s`, then heal, drain and report. A subclass
    gives the run another mission (`_mission`) and report (`_report`): `agent.sim.rollout`."""

    def __init__(self, opts: SimOptions, *, workdir: Path, progress: Progress | None = None,
                 firmware: SimFirmware | None = None, part: FleetPart | None = None) -> None:
        self.opts = opts
        self.workdir = workdir
        self.clock: Clock = SystemClock() if (opts.realtime or opts.broker_url) else SimClock(tick_s=opts.tick_s)
        if part is None and opts.shard is not None:
            part = split(opts.devices, opts.shard[1])[opts.shard[0] - 1]
        self.fleet = SimFleet(opts, clock=self.clock, workdir=workdir, firmware=firmware, part=part)
        self.timeline = Timeline()
        self._progress = progress
        self._t0 = 0.0
        self._generating = True
        self.telemetry_refused = 0
        self.apps = AppLoad()  # the devices' applications, through their agents' local API
        self.jobs_submitted = 0
        self.offline_episodes: list[tuple[str, float, float]] = []
        self.crash_episodes: list[tuple[str, float, float]] = []
        self.series: list[Sample] = []
        self.at_end: Sample = {}
        self.drain_fleet_s = 0.0
        self.drained = False
        self._wall_deadline: float | None = None
        self.truncated_at: float | None = None  # fleet time when `max_wall_s` ran out

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

    async def _run_until(self, end: float, *, sample_every: float | None = None,
                         stop_when: Callable[[], bool] | None = None, step_s: float = MAX_STEP_S,
                         on_step: Callable[[], None] | None = None) -> bool:
        """Run the timeline to fleet time `end`, in steps of at most `step_s`; True when
        `stop_when()` held after a step (it is looked at between steps, as is the wall budget).
        `on_step` is called after every step; it must only read, never await."""
        next_sample = self.now() + sample_every if sample_every else None
        while self.now() < end - 1e-9:
            if stop_when is not None and stop_when():
                return True
            if self._wall_deadline is not None and time.perf_counter() > self._wall_deadline:
                self.truncated_at = self.now()
                return False
            candidates = [end, self.now() + step_s]
            nt = self.timeline.next_time()
            if nt is not None:
                candidates.append(nt)
            if next_sample is not None:
                candidates.append(next_sample)
            target = min(candidates)
            await self._advance_to(target)
            await self.timeline.run_due(self.now())
            if next_sample is not None and sample_every is not None and self.now() >= next_sample - 1e-9:
                await self._sample()
                next_sample += sample_every
            if on_step is not None:
                on_step()
        return stop_when is not None and stop_when()

    async def snapshot(self) -> Sample:
        """The fleet's state now: what the progress display and the time series show."""
        fleet = self.fleet
        leader = fleet.leader  # None in a shard without the leader (`--shard K/M`, K > 1)
        boxes = {s.name: s for s in leader.mailbox_statistics()} if leader is not None else {}
        hb = boxes.get("heartbeats")
        # Read before anything is awaited (an await lets the fleet's ready tasks run).
        gateways = {each.device_id for each in fleet.leaders}  # several leaders hear each other's presence
        seen_online = sum(1 for d in leader.registry.devices() if d.online and d.device_id not in gateways) \
            if leader is not None else None
        devices = await self._devices_now()
        limits = devices.limits
        leader_pending = (await leader.outbox.stats()).pending if leader is not None else 0
        return {
            "t": round(self.now(), 3),
            "online": devices.online,
            "devices": devices.devices,
            "leader_sees_online": seen_online,
            "crashed": devices.crashed,
            "outbox_pending": devices.outbox_pending + leader_pending,
            "heartbeats_pending": devices.heartbeats_pending,
            "in_flight": devices.in_flight + (leader.relay.metrics().in_flight if leader is not None else 0),
            "leader_mailbox": hb.depth if hb else 0,
            "leader_mailbox_capacity": hb.capacity if hb else 0,
            "aimd_limit_min": min(limits) if limits else None,
            "aimd_limit_mean": round(sum(limits) / len(limits), 2) if limits else None,
            "air_bytes": devices.air_bytes,
            "jobs_confirmed": sum(each.leader_stats.stats.results.get("confirmed", 0) for each in fleet.leaders
                                  if each.leader_stats is not None),
            "jobs_submitted": self.jobs_submitted,
        }

    async def _devices_now(self) -> DevicesNow:
        """The state of the devices (`snapshot`): here, every device runs in this process."""
        return await devices_now(self.fleet)

    async def _unsettled(self) -> int:
        """Rows pending in every outbox of the fleet (the leader's included), and telemetry records
        sent directly and application messages not answered yet: the drain ends when there are none."""
        return await self.fleet.outbox_pending() + telemetry_sending(self.fleet) + self.apps.in_flight

    async def _sample(self) -> None:
        sample = await self.snapshot()
        self.series.append(sample)
        if self._progress is not None:
            self._progress(sample)

    # -- the plan ----------------------------------------------------------------------------------
    def _plan(self) -> None:
        opts = self.opts
        fleet = self.fleet
        boot = rng_for(opts.seed, "boot")
        local = fleet.part.indices
        first = local[0] if len(local) else 0
        for _ in range(first):  # the draws of the devices run by other processes
            boot.randrange(PHASE_SLOTS)
            if opts.telemetry_s > 0:
                boot.random()
        for i in local:
            device = device_name(i)
            phase = boot.randrange(PHASE_SLOTS) * opts.boot_window_s / PHASE_SLOTS
            self.timeline.at(phase, f"boot {device}", partial(fleet.start_worker, device))
            if opts.telemetry_s > 0:
                offset = phase + boot.random() * opts.telemetry_s
                self._telemetry_loop(device, offset, rng_for(opts.seed, f"telemetry:{device}"))
            if opts.app_every_s > 0:  # (its own generator: the plan of a run without applications is unchanged)
                app = rng_for(opts.seed, f"app:{device}")
                self._app_loop(device, phase + app.random() * opts.app_every_s, app)
        if fleet.broker is not None:
            self.offline_episodes = self.offline_plan()
            for device, start, span in self.offline_episodes:
                if device not in fleet.workers:
                    continue  # run by another process
                self.timeline.at(start, f"cut {device}", partial(fleet.cut, device))
                self.timeline.at(start + span, f"heal {device}", partial(fleet.heal, device))
        if opts.broker_outage is not None and fleet.broker is not None:
            at, span = opts.broker_outage
            self.timeline.at(at, "broker down", fleet.broker_down)
            self.timeline.at(at + span, "broker up", fleet.broker_up)
        self.crash_episodes = self.crash_plan()
        for device, start, span in self.crash_episodes:
            if device not in fleet.workers:
                continue
            self.timeline.at(start, f"crash {device}", partial(fleet.crash, device))
            self.timeline.at(start + span, f"restart {device}", partial(fleet.restart, device))
        if opts.leader_crash_s is not None and fleet.leader is not None:
            self.timeline.at(opts.leader_crash_s, "leader crash", fleet.crash_leader)
        if opts.jobs > 0 and fleet.leader is not None:
            self.timeline.at(min(2 * opts.boot_window_s, opts.duration_s / 2), "submit jobs", self._submit_jobs)

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
            start = float(int(pick.uniform(opts.boot_window_s, max(opts.boot_window_s, latest))))
            plan.append((device, start, opts.offline_duration_s))
        return plan

    def crash_plan(self) -> list[tuple[str, float, float]]:
        """(device, crash time, downtime) of every crash, drawn from the seed alone."""
        opts = self.opts
        if opts.crash_rate <= 0:
            return []
        pick = rng_for(opts.seed, "crash")
        count = round(opts.crash_rate * opts.devices)
        latest = max(opts.boot_window_s, opts.duration_s - opts.crash_downtime_s)
        devices = [device_name(i) for i in range(opts.devices)]
        return [(device, float(int(pick.uniform(opts.boot_window_s, latest))), opts.crash_downtime_s)
                for device in sorted(pick.sample(devices, count))]

    def _telemetry_loop(self, device: str, first: float, rng: random.Random) -> None:
        fleet = self.fleet
        interval = self.opts.telemetry_s

        def fire() -> None:
            if not self._generating:
                return
            worker = fleet.workers[device]  # the current incarnation
            if device in fleet.down:
                self.telemetry_refused += 1  # a crashed device measures nothing
            elif worker.telemetry is not None:
                try:
                    worker.telemetry.tell(RecordTelemetry("temperature", round(20 + 10 * rng.random(), 3)))
                except EdgeAgentError:
                    self.telemetry_refused += 1
            self.clock.call_later(interval, fire)

        self.clock.call_later(first, fire)

    def _app_loop(self, device: str, first: float, rng: random.Random) -> None:
        """The device's application: every `app_every_s` one reading POSTed to its agent's local
        API, answered as on the socket (202 once the leader or the outbox holds it)."""
        fleet = self.fleet
        interval = self.opts.app_every_s
        loop = asyncio.get_running_loop()

        def fire() -> None:
            if not self._generating:
                return
            api = fleet.local_api(device)
            if api is None:
                self.apps.refused_at_source += 1  # a crashed device's application has no agent
            else:
                body = b'{"door": %d}' % rng.randrange(2)
                self.apps.start(loop, api.serve(Request("POST", APP_PATH, APP_PATH, {}, APP_HEADERS, body)))
            self.clock.call_later(interval, fire)

        self.clock.call_later(first, fire)

    async def _submit_jobs(self) -> None:
        leader = self.fleet.job_leader
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
        if opts.max_wall_s is not None:
            self._wall_deadline = wall0 + opts.max_wall_s
        thresholds = gc.get_threshold()
        await self._open()
        try:
            await self.fleet.start_leader()
            self._plan()
            await self._sample()
            keep_out_of_gc()
            await self._mission()
            self._wall_deadline = None
            # Heal and drain: everything held must arrive.
            await self.end_generating()
            await self._drain()
            # What the fleet looks like at the end, before the workers are stopped (stopping
            # them sends their `offline` presence: the leader would then count them offline).
            self.at_end = await self.snapshot()
            await self._before_stop()
            if self._progress is not None:
                self._progress(self.at_end)
            await self.stop_workers()
            await self._leader_catch_up()
            report = await self._report(wall_s=time.perf_counter() - wall0, cpu_s=time.process_time() - cpu0)
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
            await self._close()
        return report

    async def _open(self) -> None:
        await self.fleet.open()

    async def _close(self) -> None:
        await self._with_time(self.fleet.stop())

    async def end_generating(self) -> None:
        """The end of the load: no more telemetry, every fault healed, every crashed device back."""
        self._generating = False
        self.fleet.heal_all()
        for device in sorted(self.fleet.down):
            await self.fleet.restart(device)

    async def stop_workers(self) -> None:
        for worker in self.fleet.workers.values():
            if self.drained:
                await worker.stop()  # idle after the drain: no clock time needed
            else:  # a job may still be running on the clock (its work outlasted the drain)
                await self._with_time(worker.stop())

    async def _mission(self) -> None:
        """What the run is for: here, the timeline for `duration_s`, sampled `samples` times."""
        opts = self.opts
        await self._run_until(opts.duration_s, sample_every=opts.duration_s / opts.samples)

    async def _before_stop(self) -> None:
        """Called once the fleet has drained, before the workers stop (they are still running)."""

    async def _report(self, *, wall_s: float, cpu_s: float) -> Report:
        return await collect_report(self, await self._device_totals(cpu_s=cpu_s), wall_s=wall_s)

    async def _device_totals(self, *, cpu_s: float) -> DeviceTotals:
        """What the devices add up to (the report): here, every device runs in this process."""
        return await device_totals(self, cpu_s=cpu_s)

    async def _with_time(self, aw: Awaitable[None]) -> None:
        """Await `aw` while virtual time keeps moving (an actor may be asleep on the clock)."""
        task = asyncio.ensure_future(aw)
        if not isinstance(self.clock, VirtualClock):
            await task
            return
        while not task.done():
            await self.clock.advance(0.5)
        await task

    async def _leader_catch_up(self, rounds: int = 10) -> None:
        """Let the leader apply the heartbeats its mailbox still holds (one batch per interval)."""
        leader = self.fleet.leader
        if leader is None:  # a shard without the leader
            return
        for _ in range(rounds):
            await self._advance_to(self.now() + self.opts.leader_interval_s + 1.0)
            box = {s.name: s for s in leader.mailbox_statistics()}.get("heartbeats")
            if box is None or box.depth == 0:
                break

    async def _drain(self) -> None:
        """Run on until nothing is pending (at most `drain_s`).

        Devices keep beating while the held rows drain, so a new heartbeat is pending for a
        moment after every beat. The check therefore looks between the heartbeat phase slots
        (devices boot on tenths of the boot window, a whole fraction of the interval): half a slot
        after one, every slot."""
        start = self.now()
        leader = self.fleet.leader
        slot = self.opts.boot_window_s / PHASE_SLOTS
        at = (int(self.now() / slot) + 1.5) * slot
        while self.now() - start < self.opts.drain_s:
            await self._run_until(at)
            at += slot
            job_leader = self.fleet.job_leader
            queue = job_leader.jobs_queue if job_leader is not None else None
            jobs = queue.stats() if queue is not None else None
            settled = queue is None or jobs is None or (queue.held and jobs.pending == 0 and jobs.in_flight == 0)
            if settled and await self._unsettled() == 0:
                self.drained = True
                break
        if leader is not None and self.opts.shard is not None and self.opts.shard[1] > 1:
            await self._run_until(start + self.opts.drain_s, stop_when=self._other_shards_done, step_s=1.0)
        self.drain_fleet_s = self.now() - start

    def _other_shards_done(self) -> bool:
        """The leader's shard: every device of the fleet was seen, and the other shards' are gone
        (their workers stopped after their own drain), or the drain time ran out."""
        leader = self.fleet.leader
        assert leader is not None
        known = leader.registry.devices()
        ours = self.fleet.workers
        return len(known) >= self.opts.devices and not any(d.online for d in known if d.device_id not in ours)


__all__ = ["Simulation", "Timeline"]
