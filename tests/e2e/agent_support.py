"""Helpers shared by the agent tests: configs, agents on a MemoryBroker or a real broker, and
waiting on virtual or real time."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from agent.app import make_transport
from agent.core.clock import Clock, VirtualClock
from agent.core.config import AgentConfig, convert
from agent.leader.agent import LeaderAgent
from agent.leader.jobs import JobCounts
from agent.leader.readonly import open_leader_db
from agent.protocol import JobSubmit
from agent.transport.memory import MemoryBroker
from agent.worker.actors import outbox_message
from agent.worker.agent import WorkerAgent

FLEET = "t"
REPO = Path(__file__).resolve().parents[2]


def config(role: str, device: str, **sections: dict[str, Any]) -> AgentConfig:
    data: dict[str, Any] = {
        "agent": {"role": role, "device_id": device, "fleet": FLEET},
        "heartbeat": {"interval_s": 5.0},
        "relay": {"reconnect_jitter_s": 0.5, "partitions": 1},
        "mqtt": {"reply_timeout_s": 5.0, "reconnect_min_s": 0.2, "reconnect_max_s": 1.0},
        "outbox": {"backoff_base_s": 0.2, "backoff_cap_s": 5.0, "max_attempts": 1000},
        "artifacts": {"listen": "127.0.0.1:0"},  # a leader's artifact server on a free loopback port
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return convert(data, AgentConfig, source="test")


async def leader(clock: Clock, tmp: Path, *, broker: MemoryBroker | None = None, url: str | None = None,
                 name: str = "gw", **sections: dict[str, Any]) -> LeaderAgent:
    cfg = config("leader", name, **sections)
    transport = make_transport(cfg, clock=clock, memory_broker=broker, broker_url=url, rng=random.Random(1))
    agent = await LeaderAgent.open(cfg, transport=transport, clock=clock, data_dir=tmp / name,
                                   rng=random.Random(name))
    await agent.start()
    return agent


async def worker(clock: Clock, tmp: Path, name: str, *, broker: MemoryBroker | None = None,
                 url: str | None = None, start: bool = True, **kwargs: Any) -> WorkerAgent:
    sections = kwargs.pop("sections", {})
    rng = kwargs.pop("rng", None) or random.Random(name)
    cfg = config("worker", name, **sections)
    transport = make_transport(cfg, clock=clock, memory_broker=broker, broker_url=url, rng=random.Random(name))
    sampler = kwargs.pop("sampler", None)
    agent = await WorkerAgent.open(cfg, transport=transport, clock=clock, data_dir=tmp / name,
                                   rng=rng, sampler=sampler, **kwargs)
    if start:
        await agent.start()
    return agent


async def until(clock: Clock, predicate: Callable[[], Any], *, limit_s: float = 600.0, step_s: float = 0.5,
                what: str = "condition") -> None:
    """Move time (virtual: advance; real: sleep) until `predicate()` is true (may be async)."""
    waited = 0.0
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if waited >= limit_s:
            raise AssertionError(f"{what} not reached within {limit_s}s")
        if isinstance(clock, VirtualClock):
            await clock.advance(step_s)
        else:
            await asyncio.sleep(step_s)
        waited += step_s


async def updating_worker(clock: Clock, tmp: Path, name: str, url: str, public_key: Path,
                          sections: dict[str, Any] | None = None) -> tuple[WorkerAgent, Any]:
    """A worker agent on a real broker with the real updater on slot directories, rebooting
    in-process (as the simulator's devices): (the agent, its updater part), both started."""
    from agent.sim.devices import SimFirmware, sim_hardware
    from agent.worker.updater_actor import UpdaterPart

    sections = {**(sections or {}), "firmware": {"public_key": str(public_key)}}
    agent = await worker(clock, tmp, name, url=url, sections=sections, start=False)
    part = UpdaterPart(agent, sim_hardware(SimFirmware(public_key=public_key), agent,
                                           state_dir=tmp / name / "firmware"))
    await agent.start()
    await part.start()
    return agent, part


def fleet_jobs(url: str) -> JobCounts:
    """The job queue's counts in a fleet's PostgreSQL database, with the leader running it
    (`run_by`); all zero while the queue cannot be read (not made yet, or the database stopped)."""
    from agent.core.errors import StoreError
    from agent.leader.jobs import JobQueue, JobReads

    try:
        conn = JobQueue.connect_reader(url)
    except StoreError:
        return JobCounts()
    try:
        return JobReads(conn).counts() or JobCounts()
    except StoreError:
        return JobCounts()
    finally:
        conn.close()


async def submit_through_outbox(submitter: WorkerAgent, jobs: Iterable[JobSubmit]) -> None:
    """Submit jobs as an operator's agent does: each a `job.submit` through its outbox (the
    leader must list `submitter` in `[leader] operators`)."""
    for job in jobs:
        await submitter.outbox.enqueue(outbox_message(submitter.ids, submitter.device_id, job,
                                                      key=f"job.submit:{job.job_id}"))


async def pending(agent: WorkerAgent | LeaderAgent, kind: str | None = None) -> int:
    stats = await agent.outbox.stats()
    if kind is None:
        return stats.pending
    cls = stats.by_class.get(kind)
    return cls.pending if cls is not None else 0


def telemetry_counts(db: Path) -> dict[str, int]:
    """device -> telemetry records applied, read from a leader database file."""
    with open_leader_db(db) as leader:
        return leader.registry.telemetry_counts()


def job_rows(db: Path) -> list[tuple[str, str, str | None]]:
    """(job_id, state, confirmed_by) of every job in a leader database file."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return list(conn.execute("SELECT job_id, state, confirmed_by FROM jobs ORDER BY job_id"))
    finally:
        conn.close()


async def with_time(clock: Clock, aw: Any) -> Any:
    """Await `aw`; under a VirtualClock keep time moving meanwhile (sleeping actors, timeouts)."""
    task = asyncio.ensure_future(aw)
    while isinstance(clock, VirtualClock) and not task.done():
        await clock.advance(0.5)
    return await task


async def stop_all(*agents: WorkerAgent | LeaderAgent | None, clock: Clock | None = None) -> None:
    """Stop agents; under a VirtualClock time keeps moving so sleeping actors can finish."""
    for agent in agents:
        if agent is None:
            continue
        task = asyncio.ensure_future(agent.stop())
        while isinstance(clock, VirtualClock) and not task.done():
            await clock.advance(0.5)
        await task


# -- agents in their own processes ----------------------------------------------------------------
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_tables(prefix: str, values: dict[str, Any], lines: list[str]) -> None:
    """`values` as the table `prefix`: its plain keys, then a sub-table per mapping (TOML has no null)."""
    lines.append(f"[{prefix}]")
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in values.items()
              if not isinstance(v, dict) and v is not None]
    for k, v in values.items():
        if isinstance(v, dict):
            _toml_tables(f"{prefix}.{_toml_key(k)}", v, lines)


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else _toml_value(key)


def write_config(path: Path, role: str, device: str, **sections: dict[str, Any]) -> Path:
    """A TOML config for `edge-agent run` with the test defaults of `config()`."""
    cfg = config(role, device, **sections)
    data = msgspec.to_builtins(cfg)
    lines: list[str] = []
    for section, values in data.items():
        if values is not None:  # an optional section left out (TOML has no null)
            _toml_tables(section, values, lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def shipped_config(path: Path, shipped: str, **sections: dict[str, Any]) -> Path:
    """A config for `edge-agent run`: the shipped `configs/{shipped}` as it is, with `sections`'
    keys set over it (a test's data dir, broker, socket)."""
    data = tomllib.loads((REPO / "configs" / shipped).read_text())
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    lines: list[str] = []
    for section, values in data.items():
        _toml_tables(section, values, lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def run_agent(config_path: Path, log: Path) -> subprocess.Popen[bytes]:
    """`python -m agent.cli run --config FILE`, logging to `log`."""
    out = open(log, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(config_path)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(REPO),
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        out.close()


def spawn_agent(tmp: Path, role: str, device: str, url: str, **sections: dict[str, Any]) -> subprocess.Popen[bytes]:
    """`python -m agent.cli run` for one agent, logging to tmp/{device}.log."""
    conf = write_config(tmp / f"{device}.toml", role, device, **sections)
    log = open(tmp / f"{device}.log", "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--config", str(conf), "--broker", url,
             "--data-dir", str(tmp / device)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        log.close()


def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


def healthz(port: int) -> dict[str, Any]:
    """An agent process's `/healthz` answer (a 503 has the same body); {} while it does not listen."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as err:
        return dict(json.loads(err.read()))
    except OSError:
        return {}


def wait_for(predicate: Callable[[], Any], what: str, limit_s: float = 90.0) -> Any:
    """Poll `predicate` (another process's files, a broker's answers) until it returns something
    true, which is returned; an AssertionError naming `what` after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if found := predicate():
            return found
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {limit_s}s")


def db_query(db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read another process's database; an empty result while it does not exist yet."""
    if not db.exists():
        return []
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return list(conn.execute(sql, params))
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return []
