"""A simulated fleet spread over several processes, on one virtual timeline.

`SpreadSimulation` runs in the leader's process (process 0): the leader, a smaller share of the
devices (`agent.sim.part`), and the run itself (the plan, the samples, the drain, the report).
Every other process is a `agent.sim.host` running its share of the devices, started here with a
socket to this process.

Time moves in rounds of `round_s` (conservative windows; the round is the broker's least delivery
latency in the network model, see `agent.transport.rounds`). Each process runs its rounds on its own
and sends what it published for the others at the end of each. At the end of round k+1, this
process gathers round k from every process, hands each its share, and every process delivers
round k's messages at that moment, in the same order. A process other than this one waits at the
end of round k+1 for round k's share; this one waits for the others' round k, so it may run one
round ahead of them (its leader works in bursts, once per processing interval). A process's
devices never see another's past, and the same seed with the same number of processes gives the
same report (but its `wall` section).

Between rounds this process may ask the others for their state (a progress sample, the rows
still pending, the totals of the report) or tell them to act (end the load, stop the workers):
each answers at the end of the round it is running, before that round's delivery.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import agent
from agent.core.errors import EdgeAgentError
from agent.sim.options import SimOptions
from agent.sim.part import FleetPart, split
from agent.sim.runner import Progress, Simulation, keep_out_of_gc
from agent.sim.totals import DevicesNow, DeviceTotals, devices_now
from agent.transport.rounds import FilterChange, RoundBroker, RoundOutput, WireMessage

# ("round", index, outbound by process, filter changes): one process's round, for the others.
RoundFrom = tuple[str, int, dict[int, list[WireMessage]], list[FilterChange]]


class SimProcessError(EdgeAgentError):
    """A process of a spread simulation failed or went away."""


class Channel:
    """Both ends of the socket between two processes of a run: `send` never waits for the other
    end to read (a thread writes, in order), so two processes sending each other a large round
    at once cannot block each other; `recv` waits."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._failed: OSError | None = None
        self._writer = threading.Thread(target=self._write, name="sim-channel", daemon=True)
        self._writer.start()

    def send(self, message: object) -> None:
        if self._failed is not None:
            raise self._failed
        self._queue.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        return self.conn.recv()

    def _write(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError as exc:
                self._failed = exc
                return

    def close(self) -> None:
        """Send what is queued, then close."""
        self._queue.put(None)
        self._writer.join(timeout=30.0)
        self.conn.close()


class HostLink:
    """This process's end of the socket to one `agent.sim.host` process."""

    def __init__(self, part: FleetPart, opts: SimOptions, workdir: Path) -> None:
        self.rank = part.rank
        ours, theirs = socket.socketpair()
        root = str(Path(agent.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.process = subprocess.Popen([sys.executable, "-m", "agent.sim.host", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Channel(Connection(ours.detach()))
        self._rounds: deque[RoundFrom] = deque()  # read while waiting for an answer, kept in order
        self.waited_s = 0.0  # wall time this process waited for that one's rounds
        self._send((opts, part, str(workdir)))
        self.arrive(-1, [], [])  # round 0 ends with the delivery of nothing

    def _gone(self) -> SimProcessError:
        code = self.process.wait()
        return SimProcessError(f"simulation process {self.rank} exited ({code}) in the middle of the run")

    def _send(self, message: object) -> None:
        try:
            self.conn.send(message)
        except OSError:  # the socket broke: the process is gone
            raise self._gone() from None

    def _recv(self) -> tuple[Any, ...]:
        try:
            message: tuple[Any, ...] = self.conn.recv()
        except (EOFError, OSError):
            raise self._gone() from None
        if message[0] == "error":
            raise SimProcessError(f"simulation process {self.rank} failed: {message[1]}")
        return message

    def arrive(self, index: int, arrived: list[WireMessage], changes: list[FilterChange]) -> None:
        """The others' messages and filter changes of round `index`, delivered at the end of the next."""
        self._send(("arrive", index, arrived, changes))

    def round_from(self, index: int) -> RoundFrom:
        """What the process published for the others in round `index`, and its filter changes."""
        if self._rounds:
            message = self._rounds.popleft()
        else:
            t0 = time.perf_counter()
            message = self._recv()
            self.waited_s += time.perf_counter() - t0
        if message[0] != "round" or message[1] != index:
            raise SimProcessError(f"simulation process {self.rank} sent {message[:2]!r}, not round {index}")
        return message

    def call(self, name: str) -> Any:
        """Ask or tell the process `name` (`PartSimulation._answer`); its answer, given at the end of
        the round this process is in (before that round's delivery)."""
        self._send(("call", name))
        while True:
            message = self._recv()
            if message[0] == "round":
                self._rounds.append(message)
                continue
            return message[1]

    def close(self, *, timeout_s: float = 30.0) -> None:
        self.conn.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class SpreadSimulation(Simulation):
    """A fleet run over `opts.processes` processes (see the module docstring); this is process 0."""

    def __init__(self, opts: SimOptions, *, workdir: Path, progress: Progress | None = None) -> None:
        parts = split(opts.devices, opts.processes)
        super().__init__(opts, workdir=workdir, progress=progress, part=parts[0])
        self._parts = parts
        self._links: list[HostLink] = []
        self._round_index = 0  # rounds completed
        self._held: dict[int, RoundOutput] = {}  # this process's rounds not delivered yet

    @property
    def broker(self) -> RoundBroker:
        broker = self.fleet.broker
        assert isinstance(broker, RoundBroker)
        return broker

    async def _open(self) -> None:
        for part in self._parts[1:]:
            workdir = self.workdir / f"part-{part.rank}"
            workdir.mkdir(parents=True, exist_ok=True)
            self._links.append(HostLink(part, self.opts, workdir))
        await super()._open()
        for link in self._links:
            link.call("ready")

    async def _close(self) -> None:
        try:
            await super()._close()
        finally:
            for link in self._links:
                try:
                    link.call("stop")
                except SimProcessError:
                    pass
                link.close()

    # -- time -------------------------------------------------------------------------------------
    async def _advance_to(self, t: float) -> None:
        round_s = self.opts.round_s
        while (self._round_index + 1) * round_s <= t + 1e-9:
            index = self._round_index
            await super()._advance_to((index + 1) * round_s)
            self._held[index] = self.broker.end_round(self.opts.processes)
            if index >= 1:
                self._exchange(index - 1)
            self._round_index += 1
        await super()._advance_to(t)

    def _exchange(self, index: int) -> None:
        """Round `index`'s messages: gather every process's, hand each its share, deliver ours
        (see the module docstring). Called at the end of round `index + 1`."""
        processes = self.opts.processes
        ours = self._held.pop(index)
        arrived: list[list[WireMessage]] = [[] for _ in range(processes)]
        changes = list(ours.changes)
        for rank, batch in ours.outbound.items():
            arrived[rank].extend(batch)
        for link in self._links:
            _, _, outbound, theirs = link.round_from(index)
            changes.extend(theirs)
            for rank, batch in outbound.items():
                arrived[rank].extend(batch)
        for link in self._links:
            link.arrive(index, arrived[link.rank], [c for c in changes if c[0] != link.rank])
        self.broker.apply_changes(changes)
        self.broker.deliver_round(ours.local, arrived[0])

    # -- the other processes' state ---------------------------------------------------------------
    async def _devices_now(self) -> DevicesNow:
        now = await devices_now(self.fleet)
        for link in self._links:
            now.add(link.call("devices_now"))
        return now

    async def _unsettled(self) -> int:
        return await super()._unsettled() + sum(int(link.call("unsettled")) for link in self._links)

    async def end_generating(self) -> None:
        await super().end_generating()
        for link in self._links:
            link.call("end_generating")

    async def stop_workers(self) -> None:
        await super().stop_workers()
        for link in self._links:
            link.call("stop_workers")

    async def _device_totals(self, *, cpu_s: float) -> DeviceTotals:
        totals = await super()._device_totals(cpu_s=cpu_s)
        # process 0's wait for the others' rounds: the time one process's rounds cost the other
        totals.by_process[0]["waited_for_others_s"] = round(sum(link.waited_s for link in self._links), 3)
        for link in self._links:
            totals.add(link.call("totals"))
        return totals


def simulation(opts: SimOptions, *, workdir: Path, progress: Progress | None = None) -> Simulation:
    """The fleet run `opts` asks for: in one process, or spread over `opts.processes`."""
    if opts.processes > 1:
        return SpreadSimulation(opts, workdir=workdir, progress=progress)
    return Simulation(opts, workdir=workdir, progress=progress)


class PartSimulation(Simulation):
    """One part of a spread fleet's devices, in a process of its own (`agent.sim.host`): its
    rounds and calls come from the leader's process (`HostLink`)."""

    async def serve(self, conn: Channel) -> None:
        cpu0 = time.process_time()
        broker = self.fleet.broker
        assert isinstance(broker, RoundBroker)
        processes, round_s = self.opts.processes, self.opts.round_s
        held: dict[int, list[WireMessage]] = {}
        closed = False
        await self.fleet.open()
        try:
            await self.fleet.start_leader()  # the relays of this part's outbox files
            self._plan()
            keep_out_of_gc()
            index = 0
            while True:
                await self._run_until((index + 1) * round_s)
                out = broker.end_round(processes)
                conn.send(("round", index, out.outbound, out.changes))
                held[index] = out.local
                # The end of round `index`: the calls made meanwhile, then round `index - 1`'s messages.
                while True:
                    message = conn.recv()
                    if message[0] == "arrive":
                        break
                    if message[1] == "stop":
                        closed = True
                        await self._close()
                        conn.send(("answer", None))
                        return
                    conn.send(("answer", await self._answer(message[1], cpu_s=time.process_time() - cpu0)))
                _, done, arrived, changes = message
                if done != index - 1:
                    raise SimProcessError(f"round {done} arrived at the end of round {index}")
                broker.apply_changes(changes)
                broker.deliver_round(held.pop(done, []), arrived)
                index += 1
        finally:
            if not closed:
                await self._close()

    async def _answer(self, name: str, *, cpu_s: float) -> object:
        if name == "devices_now":
            return await devices_now(self.fleet)
        if name == "unsettled":
            return await self._unsettled()
        if name == "end_generating":
            await self.end_generating()
        elif name == "stop_workers":
            await self.stop_workers()
        elif name == "totals":
            return await self._device_totals(cpu_s=cpu_s)
        elif name != "ready":
            raise SimProcessError(f"unknown call {name!r}")
        return None


__all__ = ["Channel", "HostLink", "PartSimulation", "SimProcessError", "SpreadSimulation", "simulation"]
