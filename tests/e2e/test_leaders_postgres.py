"""Several real leaders on one PostgreSQL, one fleet: two `edge-agent run` leader processes share
the fleet's registry in a real PostgreSQL and the uplinks through a real mosquitto's shared
subscription; one is SIGKILLed mid-stream and PostgreSQL is stopped and started again: every
telemetry record a device sent is applied exactly once, and the devices' outboxes drain."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.clock import SystemClock
from agent.core.errors import StoreError
from agent.leader.registry import DeviceRegistry, RegistryReads
from tests.e2e.agent_support import (
    REPO,
    fleet_jobs,
    healthz,
    kill,
    pending,
    spawn_agent,
    stop_all,
    submit_through_outbox,
    until,
    worker,
)
from tests.postgres import PostgresCluster

pytestmark = pytest.mark.timeout(300)
FAST = {"heartbeat": {"interval_s": 0.5}}


def _fleet(url: str) -> tuple[int, dict[str, int], dict[str, int]]:
    """(telemetry records applied, devices by leader, telemetry by device) in the shared registry."""
    try:
        conn = DeviceRegistry.connect_reader(url)
    except StoreError:  # not made yet, or the database stopped
        return 0, {}, {}
    try:
        reads = RegistryReads(conn)
        counts = reads.telemetry_counts()
        return sum(counts.values()), reads.leaders(), counts
    finally:
        conn.close()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})


async def _empty(w) -> bool:  # type: ignore[no-untyped-def]
    return await pending(w) == 0


def _end(leaders: dict[str, subprocess.Popen[bytes]]) -> None:
    """Stop every leader process (a frozen one woken first, so that it can stop)."""
    for proc in leaders.values():
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
        kill(proc, signal.SIGTERM)


@contextlib.asynccontextmanager
async def _two_leaders(mosquitto, url: str, tmp: Path, *, workers: int, deadline_s: float,  # type: ignore[no-untyped-def]
                       ) -> AsyncIterator[tuple[SystemClock, dict[str, subprocess.Popen[bytes]], list[Any]]]:
    """Two real leader processes sharing `url` on one shared subscription, and worker agents;
    yielded once the broker spreads the devices' messages over both leaders."""
    clock = SystemClock()
    shared = {"leader": {"heartbeat_deadline_s": deadline_s, "shared_group": "leaders", "database": url}}
    leaders = {name: spawn_agent(tmp, "leader", name, mosquitto.url, **shared) for name in ("gw1", "gw2")}
    agents = [await worker(clock, tmp, f"w{i}", url=mosquitto.url, sections=FAST) for i in range(workers)]
    try:
        await until(clock, lambda: set(_fleet(url)[1]) == {"gw1", "gw2"}, limit_s=60, step_s=0.2,
                    what="both leaders serving devices of the one registry")
        yield clock, leaders, agents
    finally:
        _end(leaders)
        await stop_all(*agents)


async def _all_applied(clock: SystemClock, url: str, agents: list[Any], sent: int) -> dict[str, int]:
    """Wait for `sent` records in the registry and every outbox drained; telemetry by worker."""
    await until(clock, lambda: _fleet(url)[0] >= sent, limit_s=120, step_s=0.2, what="every record applied")
    for w in agents:
        await until(clock, lambda w=w: _empty(w), limit_s=60, step_s=0.1, what="outboxes drained")
    total, _, per_device = _fleet(url)
    assert total == sent  # each record once: none lost, none applied twice
    return {d: n for d, n in per_device.items() if d.startswith("w")}


async def test_two_leaders_share_one_registry_and_lose_nothing_to_a_kill_or_a_database_restart(
        mosquitto, postgres: PostgresCluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url = postgres.url()
    async with _two_leaders(mosquitto, url, tmp_path, workers=4, deadline_s=3.0) as (clock, leaders, workers):
        sent = 0
        for n in range(30):
            for w in workers:
                await w.send_telemetry("t", float(n))
                sent += 1
            if n == 10:
                kill(leaders["gw1"])  # SIGKILL one leader mid-stream: its unanswered ones go to gw2
            if n == 18:
                postgres.stop("immediate")  # the database lost: gw2 answers busy, devices keep them
            if n == 24:
                postgres.start()
            await asyncio.sleep(0.02)
        assert await _all_applied(clock, url, workers, sent) == {f"w{i}": 30 for i in range(4)}
        assert leaders["gw2"].poll() is None  # the database's outage did not stop it
        assert "Traceback" not in (tmp_path / "gw2.log").read_text()
        # the views read the whole fleet from the database, and say which leader served whom
        status = _cli("status", "--db", url, "--device", "w0")
        assert status.returncode == 0, status.stderr
        assert "served by leader gw" in status.stdout
        summary = _cli("status", "--db", url)
        assert summary.returncode == 0 and "fleet: " in summary.stdout, summary.stderr
        assert _cli("rejects", "list", "--db", url).returncode == 0


async def test_a_leader_frozen_and_woken_applies_nothing_twice(
        mosquitto, postgres: PostgresCluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP one of two leaders while devices send: what reaches it waits unanswered, the
    devices send it again (to the other, as the broker spreads it), the fleet goes on; SIGCONT:
    the frozen leader wakes to what it held, and the database refuses every second application."""
    url = postgres.url()
    async with _two_leaders(mosquitto, url, tmp_path, workers=3, deadline_s=30.0) as (clock, leaders, workers):
        sent = stopped_at = 0
        for n in range(24):
            for w in workers:
                await w.send_telemetry("t", float(n))
                sent += 1
            if n == 6:
                leaders["gw1"].send_signal(signal.SIGSTOP)
                stopped_at = sent
            await asyncio.sleep(0.02)
        # the fleet goes on without it: gw2 applies what was sent after the freeze, in time
        await until(clock, lambda: _fleet(url)[0] >= stopped_at + (sent - stopped_at) // 2, limit_s=120,
                    step_s=0.2, what="the other leader carrying the fleet")
        leaders["gw1"].send_signal(signal.SIGCONT)
        # none twice, though gw1 woke to messages the others had applied
        assert await _all_applied(clock, url, workers, sent) == {f"w{i}": 24 for i in range(3)}
        assert leaders["gw1"].poll() is None and leaders["gw2"].poll() is None


def test_a_leader_whose_database_is_unreachable_says_so_in_one_line(tmp_path: Path) -> None:
    from tests.e2e.agent_support import write_config
    from tests.mosquitto import free_port

    url = f"postgresql://ea:hunter2@127.0.0.1:{free_port()}/fleet?connect_timeout=2"
    conf = write_config(tmp_path / "gw.toml", "leader", "gw1", leader={"database": url})
    done = _cli("run", "--config", str(conf), "--broker", f"mqtt://127.0.0.1:{free_port()}", "--data-dir",
                str(tmp_path / "gw1"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "cannot connect to postgresql://ea:***@127.0.0.1" in done.stderr
    assert "hunter2" not in done.stderr and "Traceback" not in done.stderr


def _lease(url: str) -> Any:
    """Who holds the orchestrator lease now (None: nobody yet, or the database is not up)."""
    from rollout_engine.lease import lease_of
    from rollout_engine.store import RolloutStore

    try:
        with RolloutStore.open_readonly(url, clock=SystemClock()) as store:
            return lease_of(store)
    except StoreError:
        return None


def _control_answered(url: str, control_id: int) -> Any:
    from rollout_engine.store import RolloutStore

    with RolloutStore.open_readonly(url, clock=SystemClock()) as store:
        row = store.control(control_id)
    return row if row is not None and row.applied_ms is not None else None


async def test_one_leader_runs_the_rollouts_and_another_takes_over_when_it_is_killed_or_frozen(
        mosquitto, postgres: PostgresCluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The orchestrator lease between two real leaders: SIGKILL its holder and the other takes the
    rollouts over (its orchestrator answers a control); freeze the new holder past its lease and
    the first takes them back, and the frozen one, woken, stands by instead of writing."""
    from rollout_engine.store import RolloutStore

    url = postgres.url()
    clock = SystemClock()
    shared = {"leader": {"shared_group": "leaders", "database": url, "rollout_lease_s": 1.0}}
    leaders = {name: spawn_agent(tmp_path, "leader", name, mosquitto.url, **shared) for name in ("gw1", "gw2")}
    try:
        await until(clock, lambda: (lease := _lease(url)) is not None and lease.ticked_ms is not None,
                    limit_s=60, step_s=0.1, what="one leader running the rollouts")
        first = _lease(url)
        other = "gw2" if first.holder == "gw1" else "gw1"
        kill(leaders[first.holder])  # SIGKILL: no release, the lease runs out
        await until(clock, lambda: (lease := _lease(url)) is not None and lease.holder == other
                    and lease.ticked_ms is not None, limit_s=60, step_s=0.1,
                    what="the other leader taking the rollouts over")
        taken = _lease(url)
        assert taken.token == first.token + 1
        # status names the dead leader dead (silent for three of its 3 s beats) and who runs what
        await until(clock, lambda: f"{first.holder} serves 0 (silent for" in _cli("status", "--db", url).stdout,
                    limit_s=60, step_s=0.2, what="status showing the killed leader not running")
        said = _cli("status", "--db", url).stdout
        assert f"{other} serves 0, runs the rollouts" in said, said
        with RolloutStore.open(url, clock=SystemClock()) as store:
            control = store.add_control("no-such-rollout", "pause", actor="test")
        await until(clock, lambda: _control_answered(url, control), limit_s=60, step_s=0.1,
                    what="the new holder's orchestrator answering a control")
        answered = _control_answered(url, control)
        assert answered.refused and "no-such-rollout" in answered.result

        # the first comes back; the holder freezes past its lease: the first takes over, and the
        # frozen one, woken, writes nothing and stands by
        leaders[first.holder] = spawn_agent(tmp_path, "leader", first.holder, mosquitto.url, **shared)
        leaders[other].send_signal(signal.SIGSTOP)
        await until(clock, lambda: (lease := _lease(url)) is not None and lease.holder == first.holder
                    and lease.ticked_ms is not None, limit_s=60, step_s=0.1,
                    what="the restarted leader taking the rollouts back")
        back = _lease(url)
        assert back.token == taken.token + 1
        leaders[other].send_signal(signal.SIGCONT)
        log = tmp_path / f"{other}.log"
        await until(clock, lambda: "another leader runs the fleet's rollouts now" in log.read_text(), limit_s=60,
                    step_s=0.1, what="the woken leader standing by")
        lease = _lease(url)
        assert lease is not None and (lease.holder, lease.token) == (first.holder, back.token)
        assert leaders[other].poll() is None and leaders[first.holder].poll() is None
        for name in leaders:
            assert "Traceback" not in (tmp_path / f"{name}.log").read_text()
    finally:
        _end(leaders)


async def test_a_rollout_goes_on_exactly_when_the_leader_running_it_is_killed(
        mosquitto, postgres: PostgresCluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A firmware rollout to four devices with the real updater, across two real leaders: the
    canary passes and the rollout waits for its approval; the leader running it is SIGKILLed; the
    other takes the lease, applies the approval and finishes the rollout. Every device is offered
    the image once and runs it; the leaders, who hear each other's presence, are no devices of it."""
    from firmware_rollout.artifact.fixture import make_artifact
    from rollout_engine.status import describe
    from rollout_engine.store import RolloutStore
    from tests.e2e.agent_support import updating_worker

    url = postgres.url()
    clock = SystemClock()
    artifact, public = make_artifact(tmp_path, version="1.1.0", size=64 * 1024, chunk_size=8 * 1024)
    shared = {"leader": {"shared_group": "leaders", "database": url, "rollout_lease_s": 1.0},
              "firmware": {"public_key": str(public)}, "artifacts": {"listen": ""}}
    leaders = {name: spawn_agent(tmp_path, "leader", name, mosquitto.url, **shared) for name in ("gw1", "gw2")}
    devices = [await updating_worker(clock, tmp_path, f"w{i}", mosquitto.url, public, FAST) for i in range(4)]
    spec = tmp_path / "rollout.toml"
    spec.write_text(f'[rollout]\nname = "fail-over"\nartifact = "{artifact}"\n[waves]\ncanary = 1\ncounts = [3]\n'
                    "[gates]\nmanual_approval = true\n[device]\ntimeout_s = 300\n")

    def rollout() -> dict[str, Any] | None:
        try:
            with RolloutStore.open_readonly(url, clock=clock) as store:
                return describe(store, "r1") if store.get("r1") is not None else None
        except StoreError:
            return None

    try:
        await until(clock, lambda: len(_fleet(url)[2]) == 4 and (lease := _lease(url)) is not None
                    and lease.ticked_ms is not None, limit_s=60, step_s=0.2, what="the devices known, a lease held")
        started = _cli("rollout", "start", str(spec), "--db", url, "--id", "r1", "--no-wait")
        assert started.returncode == 0, started.stderr
        await until(clock, lambda: (r := rollout()) is not None and r["waves"][0]["state"] == "awaiting_approval",
                    limit_s=120, step_s=0.2, what="the canary passed, the rollout waiting for approval")
        holder = _lease(url)
        kill(leaders[holder.holder])  # SIGKILL the leader running the rollout
        approved = _cli("rollout", "approve", "r1", "--db", url, "--no-wait")
        assert approved.returncode == 0, approved.stderr
        await until(clock, lambda: (r := rollout()) is not None and r["state"] not in ("running", "paused"),
                    limit_s=120, step_s=0.2, what="the rollout finished by the other leader")
        done = rollout()
        assert done is not None and done["state"] == "succeeded" and done["counts"] == {"succeeded": 4}, done
        taken = _lease(url)
        assert taken.holder != holder.holder and taken.token == holder.token + 1
        with RolloutStore.open_readonly(url, clock=clock) as store:
            offers = [device for device, _, _ in store.offers("r1")]
        assert sorted(offers) == ["w0", "w1", "w2", "w3"]  # each once, and no leader among them
        assert all(agent.firmware_version() == "1.1.0" for agent, _ in devices)
        assert "Traceback" not in (tmp_path / f"{taken.holder}.log").read_text()
    finally:
        for agent, part in devices:
            await part.stop()
            await agent.stop()
        _end(leaders)


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
async def test_the_job_queue_goes_on_when_the_leader_running_it_is_killed_or_frozen(
        mosquitto, postgres: PostgresCluster, tmp_path: Path, fault: str) -> None:  # type: ignore[no-untyped-def]
    """Work-pulling across two real leaders: one runs the fleet's job queue (its lease), the other
    posts the results and demands it hears for it. The holder is SIGKILLed, or frozen
    past its lease, with jobs in flight and offers in its outbox: the other takes the queue under
    the next epoch, offers every unconfirmed job again, and all are confirmed; nothing waits for
    the dead leader, and the frozen one, woken, stands by."""
    from agent.protocol import JobSubmit

    url = postgres.url()
    jobs = {"jobs": {"demand_window": 2}}
    shared = {"leader": {"shared_group": "leaders", "database": url, "job_lease_s": 1.0,
                         "heartbeat_deadline_s": 5.0, "operators": ["w0"]}}
    clock = SystemClock()
    leaders = {name: spawn_agent(tmp_path, "leader", name, mosquitto.url, **shared) for name in ("gw1", "gw2")}
    agents = [await worker(clock, tmp_path, f"w{i}", url=mosquitto.url, sections={**FAST, **jobs}) for i in range(3)]
    try:
        await until(clock, lambda: fleet_jobs(url).run_by in leaders, limit_s=60,
                    step_s=0.1, what="one leader running the job queue")
        await submit_through_outbox(agents[0], [JobSubmit(job_id=f"job-{n:02d}", kind="sleep", payload=b"0.2")
                                                for n in range(30)])
        await until(clock, lambda: fleet_jobs(url).confirmed >= 6, limit_s=90, step_s=0.05, what="some jobs confirmed")
        before = fleet_jobs(url)
        epoch, holder = before.epoch, before.run_by
        other = "gw2" if holder == "gw1" else "gw1"
        if fault == "SIGKILL":
            kill(leaders[holder])  # the leader running the queue dies, jobs in flight
        else:
            leaders[holder].send_signal(signal.SIGSTOP)  # it freezes past its lease
            await until(clock, lambda: fleet_jobs(url).epoch > epoch, limit_s=60, step_s=0.1, what="a takeover")
            leaders[holder].send_signal(signal.SIGCONT)
        await until(clock, lambda: fleet_jobs(url).confirmed == 30, limit_s=120, step_s=0.1,
                    what="every job confirmed through the other leader")
        after = fleet_jobs(url)
        assert (after.confirmed, after.run_by) == (30, other) and after.epoch == epoch + 1
        for w in agents:
            await until(clock, lambda w=w: _empty(w), limit_s=60, step_s=0.1, what="outboxes drained")
        log = (tmp_path / f"{other}.log").read_text()
        assert "runs the fleet's job queue now" in log and "Traceback" not in log
        assert leaders[other].poll() is None
        if fault == "SIGSTOP":  # woken, the old holder found the queue taken and stood by
            woken = tmp_path / f"{holder}.log"
            await until(clock, lambda: "this one stands by" in woken.read_text(), limit_s=60, step_s=0.1,
                        what="the woken leader standing by")
            assert leaders[holder].poll() is None and "Traceback" not in woken.read_text()
        status = _cli("status", "--db", url)  # the fleet's one queue, and who runs it
        assert f"jobs: 0 pending, 30 confirmed (0 failed), queue epoch {epoch + 1}, run by leader {other}" \
            in status.stdout, status.stdout + status.stderr
    finally:
        _end(leaders)
        await stop_all(*agents)


def _metric(port: int, name: str) -> float | None:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            text = response.read().decode()
    except OSError:
        return None
    found = [line.split()[-1] for line in text.splitlines() if line.startswith(f"{name} ")]
    return float(found[0]) if found else None


def _online(url: str, device: str) -> bool | None:
    try:
        conn = DeviceRegistry.connect_reader(url)
    except StoreError:
        return None
    try:
        found = RegistryReads(conn).device(device)
        return None if found is None else found[0].online
    finally:
        conn.close()


async def test_a_database_outage_is_one_state_and_loses_no_presence_and_no_message(
        mosquitto, postgres: PostgresCluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """PostgreSQL stops under a running leader: the leader says so in one line and on /healthz
    and /metrics, answers a device's telemetry busy (the device keeps it), keeps a device's
    going offline until it can store it, and says in one line when the database is back; then
    the telemetry is stored once and the device is offline in the registry."""
    from mosquitto import free_port

    url, port = postgres.url(), free_port()
    gw = spawn_agent(tmp_path, "leader", "gw1", mosquitto.url, leader={"database": url},
                     metrics={"listen": f"127.0.0.1:{port}"})
    clock = SystemClock()
    agents = [await worker(clock, tmp_path, f"w{i}", url=mosquitto.url, sections=FAST) for i in range(2)]
    try:
        await until(clock, lambda: _online(url, "w0") and _online(url, "w1"), limit_s=60, step_s=0.2,
                    what="both devices online in the fleet's database")
        assert healthz(port)["checks"]["fleet database"] == {"ok": True, "detail": "reachable"}
        assert _metric(port, 'ea_fleet_leaders{state="running"}') == 1.0 and _metric(port, "ea_job_queue_held") == 1.0
        postgres.stop("immediate")
        await until(clock, lambda: healthz(port).get("checks", {}).get("fleet database", {}).get("ok") is False,
                    limit_s=60, step_s=0.2, what="/healthz saying the database is lost")
        detail = healthz(port)["checks"]["fleet database"]["detail"]
        assert detail.startswith("unreachable since ") and "answered busy" in detail, detail
        assert _metric(port, "ea_leader_database_reachable") == 0.0
        await agents[1].stop()  # its going offline reaches the leader while the database is away
        await agents[0].send_telemetry("t", 1.0)  # answered busy: kept in the device's outbox
        await until(clock, lambda: (_metric(port, "ea_leader_presence_pending") or 0) >= 1, limit_s=60, step_s=0.2,
                    what="the offline presence kept until it can be stored")
        assert await pending(agents[0]) >= 1
        postgres.start()
        await until(clock, lambda: _online(url, "w1") is False, limit_s=60, step_s=0.2,
                    what="the presence kept through the outage applied")
        await until(clock, lambda: _fleet(url)[2].get("w0") == 1, limit_s=60, step_s=0.2,
                    what="the telemetry kept by the device stored once")
        await until(clock, lambda: _empty(agents[0]), limit_s=60, step_s=0.1, what="the device's outbox drained")
        await until(clock, lambda: healthz(port).get("checks", {}).get("fleet database", {}).get("ok") is True,
                    limit_s=60, step_s=0.2, what="/healthz saying the database is back")
        assert _metric(port, "ea_leader_database_outages_total") == 1.0
        assert _metric(port, "ea_leader_presence_pending") == 0.0
        said = (tmp_path / "gw1.log").read_text()
        assert said.count("answer busy until it is back") == 1 and said.count("is back after") == 1, said
        assert "level=error" not in said and "Traceback" not in said and "never retrieved" not in said, said
        assert gw.poll() is None
    finally:
        kill(gw, signal.SIGTERM)
        await stop_all(*agents[:1])
