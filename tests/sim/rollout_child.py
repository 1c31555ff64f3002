"""Child process of the leader-SIGKILL test: a leader and N simulated devices in one process.

    python rollout_child.py WORK_DIR DEVICES SEED [PACE_S]

Everything durable lives under WORK_DIR: the leader's database (rollout state, registry,
outbox), the devices' updater databases and slots, their shared report outbox, and the virtual
clock's time (`clock.ms`, written after every step), so a run killed with SIGKILL and started
again continues where it stopped. The first run starts the rollout; every run drives it until
it ends and every offered device finished, then prints one JSON line. PACE_S (default 0) is
real time slept per half second of virtual time, so the parent can catch the run mid-wave.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

from agent.core.clock import DEFAULT_VIRTUAL_EPOCH_MS, VirtualClock
from agent.sim.devices import SimFirmware
from agent.sim.fleet import SimFleet
from agent.sim.rollout import BASE_VERSION, ROLLOUT_ID, default_spec, rollout_options
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.spec import spec_from_dict
from rollout_engine.status import describe
from rollout_engine.store import IN_PROGRESS


def save_clock(path: Path, now_ms: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(now_ms))
    os.replace(tmp, path)


async def main(work: Path, devices: int, seed: int, pace_s: float) -> None:
    clock_file = work / "clock.ms"
    start_ms = int(clock_file.read_text()) if clock_file.exists() else DEFAULT_VIRTUAL_EPOCH_MS
    clock = VirtualClock(start_ms=start_ms)
    runs = work / "runs"  # this start's number: every device is a new incarnation of its agent
    run = int(runs.read_text()) + 1 if runs.exists() else 1
    runs.write_text(str(run))
    artifact = work / "fw-1.1.0.eafw"
    if not artifact.exists():
        make_artifact(work, seed=seed)
    data = default_spec(artifact, seed=seed, devices=devices)
    data["gates"]["soak_s"] = 30.0
    spec = spec_from_dict(data)
    firmware = SimFirmware(public_key=work / "keys" / "public.pem", base_version=BASE_VERSION)
    fleet = SimFleet(rollout_options(devices=devices, seed=seed), clock=clock, workdir=work, firmware=firmware,
                     rollout_poll_s=1.0, incarnation=run)
    await fleet.open()
    await fleet.start_leader()
    for device in fleet.workers:
        await fleet.start_worker(device)
    assert fleet.leader is not None and fleet.rollout is not None
    store = fleet.rollout.store
    try:
        if store.get(ROLLOUT_ID) is None:
            while sum(fleet.leader.registry.counts()) < devices:
                await clock.advance(1.0)
            await fleet.rollout.orchestrator.start_rollout(spec, rollout_id=ROLLOUT_ID)
            print("started", flush=True)

        def done() -> bool:
            r = store.get(ROLLOUT_ID)
            return r is not None and not r.active and not store.devices(ROLLOUT_ID, states=tuple(IN_PROGRESS))

        for _ in range(20_000):
            if done():
                break
            await clock.advance(0.5)
            save_clock(clock_file, clock.now_ms())
            if pace_s:
                time.sleep(pace_s)  # pacing of this driver only: the parent watches in real time
        print(json.dumps(describe(store, ROLLOUT_ID)), flush=True)
    finally:
        stopping = asyncio.ensure_future(fleet.stop())
        while not stopping.done():
            await clock.advance(0.5)
        await stopping


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    pace = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), pace))
