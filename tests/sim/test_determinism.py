"""Same seed, same report, byte for byte (apart from `wall`), on every `edge-agent simulate` path:
a user's own `--rollout SPEC.toml` and each named scenario. Every run is a process of its own
with a different PYTHONHASHSEED, as users run them: nothing may depend on str hashing, thread
timing or the wall clock."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agent.core.clock import SystemClock
from agent.core.tasks import in_thread
from agent.sim.clock import SimClock
from agent.sim.rollout import wave_rollout_scenario
from firmware_rollout.artifact.fixture import make_artifact

ROOT = Path(__file__).resolve().parents[2]

# A user's spec: the artifact's own chunk size, unlimited download rate (the ConfigServers answer
# as soon as their file read is done), retries, a soak longer than the simulated heartbeat.
SPEC = """\
[rollout]
name = "lab 1.1.0"
artifact = "{artifact}"
seed = 7

[targets]
select = "versions"
versions = ["1.0.0"]

[waves]
canary = 2
percents = [40.0, 60.0]

[gates]
success_threshold_pct = 50.0
soak_s = 60
failure_threshold_pct = 30.0
min_finished = 4
failure_action = "abort"

[device]
timeout_s = 600
retries = 1
retry_backoff_s = 30

[download]
servers = 1
mailbox_capacity = 1
"""

# Small versions of each named scenario (the options not given come from its preset).
SCENARIO_ARGS = {
    "heartbeat-coalescing": ["--devices", "12", "--duration", "3m"],
    "thundering-herd": ["--devices", "24", "--duration", "2m", "--leader-mailbox", "8"],  # a herd for 24 devices
    "offline-store-and-forward": ["--devices", "12", "--duration", "4m", "--offline-duration", "1m"],
    "work-pulling": ["--devices", "6", "--duration", "2m", "--jobs", "20"],
    "wave-rollout": ["--devices", "16", "--fail-rate", "0.25"],
}
# The rollout scenario with the fleet's faults while it runs (uplinks lost, agents crashing).
FAULTY_ROLLOUT = ["--scenario", "wave-rollout", "--devices", "40", "--offline-rate", "0.2", "--offline-duration",
                  "1m", "--crash-rate", "0.1", "--duration", "5m"]


def simulate(tmp_path: Path, name: str, args: list[str], *, hash_seed: int) -> dict[str, Any]:
    """`edge-agent simulate ARGS --quiet --report R` in a process of its own; the report
    without its `wall` section."""
    report = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "simulate", *args, "--quiet", "--report", str(report)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=110, check=False,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: something lost or a claim failed (checked below)
    data: dict[str, Any] = json.loads(report.read_text())
    assert set(data["wall"]) >= {"seconds"}
    del data["wall"]
    return data


def as_text(report: dict[str, Any]) -> str:
    return json.dumps(report, sort_keys=True, indent=1)


@pytest.fixture
def user_spec(tmp_path: Path) -> tuple[Path, Path]:
    """A spec beside a signed artifact of 10 chunks of 64 KiB, and the key that signed it."""
    artifact, public = make_artifact(tmp_path / "build", size=600_000, chunk_size=65_536, seed=5)
    spec = tmp_path / "build" / "rollout.toml"
    spec.write_text(SPEC.format(artifact=artifact.name))
    return spec, public


@pytest.mark.slow
def test_a_user_spec_gives_the_same_report_for_the_same_seed(tmp_path: Path, user_spec: tuple[Path, Path]) -> None:
    spec, public = user_spec
    args = ["--rollout", str(spec), "--public-key", str(public), "--devices", "30", "--fail-rate", "0.1"]
    first = simulate(tmp_path, "a", [*args, "--seed", "3"], hash_seed=1)
    second = simulate(tmp_path, "b", [*args, "--seed", "3"], hash_seed=2)
    assert first["lost"] == 0 and first["conservation_ok"] is True
    assert first["downloads"]["busy"] > 0  # downloads did contend for the ConfigServer
    assert as_text(first) == as_text(second)
    other = simulate(tmp_path, "c", [*args, "--seed", "4"], hash_seed=3)
    # Another seed picks other failing devices: the waves' outcomes differ, not only `seed`.
    assert {k: v for k, v in other.items() if k != "seed"} != {k: v for k, v in first.items() if k != "seed"}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIO_ARGS))
def test_each_named_scenario_gives_the_same_report_for_the_same_seed(tmp_path: Path, scenario: str) -> None:
    args = ["--scenario", scenario, *SCENARIO_ARGS[scenario], "--seed", "5"]
    first = simulate(tmp_path, "a", args, hash_seed=11)
    second = simulate(tmp_path, "b", args, hash_seed=12)
    assert first["lost"] == 0 and first["conservation_ok"] is True
    assert first["claim"]["holds"] is True, first["claim"]
    assert as_text(first) == as_text(second)


def test_thread_work_under_an_inline_io_clock_runs_on_the_loop_in_submission_order() -> None:
    """Why the reports repeat: no job's result reaches the loop at a moment the OS picks."""
    seen: list[tuple[int, int]] = []

    def job(n: int) -> int:
        seen.append((n, threading.get_ident()))
        if n == 3:
            raise OSError("disk full")
        return n * 10

    async def main() -> list[object]:
        clock = SimClock()
        assert clock.inline_io is True  # the outbox stores' SQLite work runs on the loop too
        return await asyncio.gather(*(in_thread(clock, job, n) for n in range(5)), return_exceptions=True)

    results = asyncio.run(main())
    assert results[:3] == [0, 10, 20] and isinstance(results[3], OSError) and results[4] == 40
    assert seen == [(n, threading.get_ident()) for n in range(5)]  # this (the loop's) thread, in order


async def test_an_inline_job_resumes_its_caller_on_a_later_loop_turn_and_survives_cancellation() -> None:
    order: list[str] = []
    loop = asyncio.get_running_loop()

    async def caller() -> None:
        await in_thread(SimClock(), order.append, "job")
        order.append("resumed")

    task = asyncio.create_task(caller())
    loop.call_soon(order.append, "other")
    await task
    assert order == ["job", "other", "resumed"]  # other callbacks run between, as with a thread

    seen: list[str] = []
    task = asyncio.create_task(in_thread(SimClock(), seen.append, "ran"))
    await asyncio.sleep(0)  # the job has run; its result is on its way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # the late result meets a cancelled future: dropped, nothing raised
    assert seen == ["ran"]


class RefusingExecutor(ThreadPoolExecutor):
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        raise AssertionError(f"thread work in a simulated rollout: {fn!r}")


def test_a_simulated_rollout_starts_no_thread_work(tmp_path: Path) -> None:
    """No executor setup needed: every file and SQLite job of the scenario runs on the loop."""

    async def main() -> dict[str, Any]:
        asyncio.get_running_loop().set_default_executor(RefusingExecutor(max_workers=1))
        return await wave_rollout_scenario(devices=12, seed=2, fail_rate=0.0, work_dir=tmp_path)

    report = asyncio.run(main())
    assert report["rollout"]["state"] == "succeeded"
    assert report["downloads"]["served"] > 0  # the ConfigServers did read the image (inline)


async def test_a_real_clock_runs_the_job_on_a_thread() -> None:
    assert await in_thread(SystemClock(), threading.get_ident) != threading.get_ident()


@pytest.mark.slow
def test_a_rollout_with_faults_gives_the_same_report_for_the_same_seed(tmp_path: Path) -> None:
    first = simulate(tmp_path, "a", [*FAULTY_ROLLOUT, "--seed", "3"], hash_seed=21)
    second = simulate(tmp_path, "b", [*FAULTY_ROLLOUT, "--seed", "3"], hash_seed=22)
    assert first["faults"]["offline_episodes"] == 8 and first["faults"]["crashes"] == 4
    assert first["lost"] == 0 and first["conservation_ok"] is True
    assert first["rollout"]["state"] in ("succeeded", "aborted")
    assert as_text(first) == as_text(second)


def test_applications_through_the_local_api_give_the_same_report_and_lose_nothing(tmp_path: Path) -> None:
    """Each device's application hands its agent's local API a message every 20 s while uplinks
    are lost and agents crash: the same report twice, every accepted message stored by the
    leader exactly once, and the run through the same assembly as `edge-agent run`."""
    args = ["--devices", "30", "--duration", "4m", "--seed", "5", "--app-every", "20s", "--offline-rate", "0.2",
            "--offline-duration", "1m", "--crash-rate", "0.1"]
    first = simulate(tmp_path, "apps-1", args, hash_seed=1)
    second = simulate(tmp_path, "apps-2", args, hash_seed=2)
    assert as_text(first) == as_text(second)
    apps = first["applications"]
    assert apps["sent"] > 300 and apps["via_outbox"] > 0 and apps["refused"] == 0
    assert apps["applied_by_leader"] == apps["accepted"] == apps["direct"] + apps["via_outbox"]
    assert apps["lost"] == 0 and first["lost"] == 0 and first["conservation_ok"] is True
