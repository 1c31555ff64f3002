"""The worker's release module. Offered again a release it has concluded: the runner is an actor,
so an offer the leader sent again while the parts converged waits in its mailbox and comes after
the conclusion. The device says the outcome again; it does not converge again (that said
`installing` after `succeeded`, and the leader's row went back to `installing`). Offered a
release with firmware before its updater has read the slots: it waits for them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from agent.core.clock import SystemClock, VirtualClock
from agent.worker.agent import WorkerAgent
from agent.worker.releases import OUTCOME_POLL_S, OUTCOME_WAIT_S, CheckedRelease, ReleaseModule, _Journal
from release_rollout.document import Part, build_document, parse_release
from release_rollout.messages import ReleaseOffer
from rollout_engine.keys import SigningKey
from rollout_engine.messages import ReportState


@pytest.mark.parametrize(("failed", "said"), [("", "succeeded"),
                                              ("config:app: its health check failed", "rolled_back")])
async def test_a_concluded_release_offered_again_says_its_outcome_again(tmp_path: Path, failed: str,
                                                                        said: ReportState) -> None:
    key = SigningKey.generate()
    part = Part(kind="config", name="app", version="1.0.0", file="app.eacfg", sha256="0" * 64, size=1)
    document = build_document("board", "1.0.0", [part], key, created_ms=0)
    worker = cast(WorkerAgent, SimpleNamespace(clock=SystemClock(), device_id="board-1", kind_parts={}))
    module = ReleaseModule(worker, key=key.public, state_dir=tmp_path)
    module._keep(_Journal("r1", document, (), "done", failed=failed, before="config:app none",
                          figures=("config:app held after 2.0 s",)))
    reports: list[tuple[str, str, str, str, str]] = []

    async def report(rid: str, version: str, state: ReportState, phase: str, detail: str, *,
                     until_ms: int = 0) -> None:
        reports.append((rid, version, state, phase, detail))

    module.report = report
    offer = ReleaseOffer(rollout_id="r1", document=document, parts=())
    await module.apply(offer, CheckedRelease(parse_release(document, key.public), {}), report)

    assert [(rid, version, state) for rid, version, state, _, _ in reports] == [("r1", "1.0.0", said)]
    assert ("converged: config app 1.0.0" in reports[0][4]) is (said == "succeeded"), reports


async def test_a_release_waits_for_the_updater_to_read_the_slots_before_it_compares_the_firmware() -> None:
    """Until the updater opens the device does not know what it runs (its heartbeat says ""):
    the release asks the slots, not the config file, whether its firmware needs a trial boot."""
    clock = VirtualClock()
    actor = SimpleNamespace(updater=None, not_open="the root helper does not answer")
    worker = cast(WorkerAgent, SimpleNamespace(clock=clock, device_id="board-1", firmware_version=lambda: "",
                                               kind_parts={"firmware": SimpleNamespace(actor=actor)}))
    module = ReleaseModule(worker, key=SigningKey.generate().public, state_dir=Path("/nonexistent"))
    asked = asyncio.ensure_future(module.running_firmware())
    await clock.advance(60)
    assert not asked.done()
    actor.updater = SimpleNamespace(active_version="1.0.0")  # the slots read
    await clock.advance(OUTCOME_POLL_S)
    assert asked.done() and asked.result() == "1.0.0"

    actor.updater = None  # a start whose updater never opens: not known, never guessed
    asked = asyncio.ensure_future(module.running_firmware())
    await clock.advance(OUTCOME_WAIT_S + OUTCOME_POLL_S)
    assert asked.done() and asked.result() is None
