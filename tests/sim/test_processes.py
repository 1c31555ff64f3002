"""A fleet spread over processes (`--processes N`): the same seed and N give the same report, nothing is
lost across faults, messages cross processes only at round ends and in one order, and a process that
dies ends the run with one line naming it."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.cli import main as cli_main
from agent.core.errors import ConfigError
from agent.sim import SimOptions, SpreadSimulation, to_json
from agent.sim.clock import SimClock
from agent.sim.part import split
from agent.sim.processes import SimProcessError
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryTransport
from agent.transport.rounds import RoundBroker
from tests.sim.test_determinism import as_text, simulate

FAULTS: dict[str, Any] = {"offline_rate": 0.2, "offline_duration_s": 40.0, "crash_rate": 0.1, "crash_downtime_s": 20.0,
                          "broker_outage": (150.0, 30.0), "jobs": 30}


def _without_wall(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "wall"}


async def _spread(workdir: Path, **kwargs: Any) -> dict[str, Any]:
    opts = SimOptions(progress=False, **kwargs)
    return await SpreadSimulation(opts, workdir=workdir).run()


async def test_a_fleet_over_three_processes_loses_nothing_and_repeats_its_report(tmp_path: Path) -> None:
    args: dict[str, Any] = {"devices": 60, "duration_s": 300.0, "seed": 4, "processes": 3, **FAULTS}
    first = await _spread(tmp_path / "a", **args)
    second = await _spread(tmp_path / "b", **args)
    assert first["lost"] == 0 and first["conservation_ok"] is True and first["drained"] is True
    assert first["jobs"]["confirmed"] == 30 and first["jobs"]["confirmed_more_than_once"] == 0
    assert first["crashes"] == 6 and first["offline_episodes"] == 12
    assert first["leader"]["devices_known"] == 60 and first["at_end"]["devices"] == 60
    assert first["telemetry"]["applied_by_leader"] == first["telemetry"]["generated"] > 0
    assert first["heartbeats"]["stale_devices"] == 0
    assert first["scenario"]["processes"] == 3 and first["scenario"]["round_s"] == 0.25
    assert to_json(_without_wall(first)) == to_json(_without_wall(second))


@pytest.mark.slow
def test_the_cli_repeats_a_report_with_two_processes(tmp_path: Path) -> None:
    args = ["--devices", "200", "--duration", "10m", "--seed", "7", "--processes", "2"]
    first = simulate(tmp_path, "a", args, hash_seed=31)
    second = simulate(tmp_path, "b", args, hash_seed=32)
    assert first["lost"] == 0 and first["conservation_ok"] is True
    assert first["scenario"]["processes"] == 2
    assert as_text(first) == as_text(second)


async def test_a_process_killed_mid_run_ends_the_run_with_one_line_naming_it(tmp_path: Path) -> None:
    opts = SimOptions(devices=30, duration_s=600.0, seed=2, processes=2, progress=True, samples=20)
    killed: list[int] = []

    def progress(sample: dict[str, Any]) -> None:
        if sample["t"] >= 60 and not killed:
            process = sim._links[0].process
            os.kill(process.pid, signal.SIGKILL)
            process.wait()  # gone before the next round is sent to it: that send breaks the socket too
            killed.append(process.pid)

    sim = SpreadSimulation(opts, workdir=tmp_path, progress=progress)
    with pytest.raises(SimProcessError, match=r"simulation process 1 exited \(-9\)"):
        await sim.run()
    assert killed


def test_processes_are_refused_where_they_cannot_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["--scenario", "wave-rollout", "--processes", "2"], "a rollout runs in one process"),
        (["--broker", "mqtt://127.0.0.1:1", "--processes", "2"], "needs the in-memory broker"),
        (["--processes", "many"], "expected a number or auto"),
        (["--processes", "0"], "must be between 1 and 64"),
        (["--devices", "3", "--processes", "4"], "must be at most --devices"),
        (["--processes", "2", "--round", "10s"], "between 1 ms and 5 s"),
        (["--shard", "2/2"], "shard: needs --broker"),
        (["--broker", "mqtt://127.0.0.1:1", "--shard", "3/2"], "1 <= K <= M <= --devices, got 3/2"),
        (["--broker", "mqtt://127.0.0.1:1", "--shard", "half"], "expected K/M"),
        (["--broker", "mqtt://127.0.0.1:1", "--shard", "1/2", "--scenario", "wave-rollout"],
         "leave out --shard"),
    ]
    for args, message in cases:
        assert cli_main(["simulate", *args, "--quiet", "--data-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    with pytest.raises(ConfigError, match="processes"):
        SimOptions(devices=10, processes=2, realtime=True)


@given(devices=st.integers(min_value=1, max_value=5000), processes=st.integers(min_value=1, max_value=16))
def test_the_parts_cover_every_device_once_with_the_leader_in_the_first(devices: int, processes: int) -> None:
    processes = min(processes, devices)
    parts = split(devices, processes)
    assert [p.rank for p in parts] == list(range(processes))
    assert [i for p in parts for i in p.indices] == list(range(devices))
    assert [p.leader for p in parts] == [True] + [False] * (processes - 1)
    if processes > 1 and devices >= 100 * processes:
        assert len(parts[0].indices) < len(parts[1].indices)  # the leader's process runs fewer devices


async def test_a_message_crosses_to_another_process_at_the_end_of_the_next_round() -> None:
    clock = SimClock()
    brokers = [RoundBroker(rank=r, clock=clock, rng=random.Random(r), max_queued_per_session=10) for r in range(2)]
    got: list[tuple[str, bytes]] = []

    async def on_message(message: InboundMessage) -> None:
        got.append((message.topic, message.payload))

    leader = MemoryTransport(brokers[0], "leader")
    device = MemoryTransport(brokers[1], "dev-1")
    await leader.start()
    await device.start()
    await leader.subscribe("ea/v1/sim/+/up", on_message)

    def end_round() -> None:  # what `SpreadSimulation` does between the processes
        outs = [b.end_round(2) for b in brokers]
        changes = [c for out in outs for c in out.changes]
        for rank, broker in enumerate(brokers):
            broker.apply_changes(changes)
            broker.deliver_round(outs[rank].local, [m for out in outs for m in out.outbound.get(rank, [])])

    end_round()  # the leader's filter reaches the device's process
    await device.publish("ea/v1/sim/dev-1/up", b"late", qos=1)
    await clock.advance(0.1)
    await device.publish("ea/v1/sim/dev-1/up", b"first?", qos=1)
    await clock.advance(0.1)
    assert got == []  # held until the round ends
    await leader.publish("ea/v1/sim/leader/up", b"local", qos=1)
    await leader.publish("ea/v1/sim/dev-1/status", b"retained", qos=1, retain=True)
    end_round()
    await clock.advance(0.1)
    # one order in every process: by publish time, then by process
    assert got == [("ea/v1/sim/dev-1/up", b"late"), ("ea/v1/sim/dev-1/up", b"first?"),
                   ("ea/v1/sim/leader/up", b"local")]
    assert brokers[1].retained("ea/v1/sim/dev-1/status") == b"retained"  # a retained message is everyone's
    assert brokers[1].crossed == 2 and brokers[0].arrived == 2
    await leader.unsubscribe("ea/v1/sim/+/up")
    end_round()
    await device.publish("ea/v1/sim/dev-1/up", b"nobody", qos=1)
    assert brokers[1].end_round(2).outbound == {}  # no process subscribes any more: nothing crosses


async def test_a_long_round_counts_every_record_still_on_its_way_when_the_load_ends(tmp_path: Path) -> None:
    """With 1-2 s of delivery latency, records sent directly are still unanswered when the load
    ends: the drain waits for them (before, the workers stopped under them, and the leader applied
    records no device had counted)."""
    report = await _spread(tmp_path, devices=40, duration_s=120.0, seed=9, processes=2, round_s=1.0,
                           telemetry_s=2.0)
    tel = report["telemetry"]
    assert report["lost"] == 0 and report["conservation_ok"] is True
    assert tel["applied_by_leader"] == tel["generated"] == tel["direct"] + tel["via_outbox"] > 0
