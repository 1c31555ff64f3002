"""The device's offer runner (`rollout_engine.device`), with a module that records what it is
asked: an offer outside its window waits on a timer and survives the runner's end (its journal),
the window opening applies it once; a cancel drops one still waiting, across a restart too; a
module's refusal is reported `rejected` and nothing is applied; every report's seq is above the
previous one, across restarts; a rollout offered again after it concluded here is answered with
its outcome, not applied again, unless it failed (the leader's retry)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from agent.actors import ActorSystem
from agent.core.clock import VirtualClock
from rollout_engine.device import CONCLUDED_KEPT, JOURNAL, Facts, OfferRunner, Rejected, Reporter, Resume
from rollout_engine.keys import SigningKey
from rollout_engine.messages import ReportState, RolloutCancel, RolloutReport

KEY = SigningKey.generate().public
OUTCOMES: dict[str, ReportState] = {"b": "rolled_back", "f": "failed"}  # by the rollout id's first letter


class Offer(msgspec.Struct, frozen=True):
    rollout_id: str
    version: str
    window: str = ""


class Recording:
    offer_type = Offer

    def __init__(self) -> None:
        self.applied: list[str] = []
        self.resumed = 0

    def facts(self, offer: Offer) -> Facts:
        return Facts(offer.rollout_id, offer.version, (offer.window,) if offer.window else (), b"")

    def check(self, offer: Offer) -> str:
        if offer.version == "0.0.0":
            raise Rejected("not a version this device takes")
        return offer.version

    async def apply(self, offer: Offer, checked: str, report: Reporter) -> None:
        self.applied.append(offer.rollout_id)
        outcome = OUTCOMES.get(offer.rollout_id[:1], "succeeded")
        await report(offer.rollout_id, checked, outcome, "done", "applied" if outcome == "succeeded" else outcome)

    async def resume(self, report: Reporter) -> None:
        self.resumed += 1


class Device:
    """A device's runners over one state directory, their reports in `sent` (each start a new
    runner, as a restarted agent makes)."""

    def __init__(self, state_dir: Path, clock: VirtualClock, sent: list[RolloutReport]) -> None:
        self.state_dir, self.clock, self.sent = state_dir, clock, sent

    async def send(self, report: RolloutReport) -> None:
        self.sent.append(report)

    def runner(self, module: Recording) -> OfferRunner[Offer, str]:
        return OfferRunner(module, device_id="pi-1", key=KEY, clock=self.clock, state_dir=self.state_dir,
                           send=self.send)


def window_in_two_hours(clock: VirtualClock) -> str:
    hour = (clock.now_ms() // 3_600_000 + 2) % 24
    return f"{hour:02d}:00-{hour:02d}:30"


async def test_a_waiting_offer_survives_a_restart_and_a_cancel_drops_one(tmp_path: Path) -> None:
    clock = VirtualClock()
    sent: list[RolloutReport] = []
    runner = Device(tmp_path, clock, sent).runner

    first = Recording()
    window = window_in_two_hours(clock)
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(runner(first), name="offers")
        ref.tell(Resume())
        ref.tell(Offer("r1", "1.1.0", window))
        ref.tell(Offer("r2", "1.2.0", window))
        ref.tell(Offer("r3", "0.0.0"))
        await clock.advance(1)
        assert [(r.rollout_id, r.state) for r in sent] == [("r1", "waiting_window"), ("r2", "waiting_window"),
                                                         ("r3", "rejected")]
        assert sent[2].detail == "not a version this device takes" and first.applied == []
        assert sent[0].until_ms > clock.now_ms() + 3_000_000
    assert (tmp_path / JOURNAL).is_file()  # the waiting offers, kept

    second = Recording()  # the device started again
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(runner(second), name="offers")
        ref.tell(Resume())
        await clock.advance(1)
        assert second.resumed == 1
        ref.tell(RolloutCancel(rollout_id="r2", reason="canceled by operator"))
        await clock.advance(1)
        assert (sent[-1].rollout_id, sent[-1].state) == ("r2", "canceled")
        assert sent[-1].detail == "canceled while waiting for its maintenance window: canceled by operator"
        await clock.advance(3 * 3600)  # the window opens: r1 once, r2 never
        assert second.applied == ["r1"] and first.applied == []
        assert (sent[-1].rollout_id, sent[-1].state) == ("r1", "succeeded")
    assert msgspec.json.decode((tmp_path / JOURNAL).read_bytes()) == {
        "waiting": {}, "concluded": {"r1": {"version": "1.1.0", "state": "succeeded", "phase": "done",
                                           "detail": "applied"}}}
    seqs = [r.seq for r in sent]
    assert seqs == sorted(set(seqs))  # each above the one before, across the restart


async def test_a_concluded_rollout_offered_again_is_answered_not_applied_again(tmp_path: Path) -> None:
    clock = VirtualClock()
    sent: list[RolloutReport] = []
    runner = Device(tmp_path, clock, sent).runner

    first = Recording()
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(runner(first), name="offers")
        ref.tell(Resume())
        for rid in ("s1", "b1", "f1", "s1", "b1"):  # the second s1 and b1: came twice
            ref.tell(Offer(rid, "2.0.0"))
        await clock.advance(1)
        assert first.applied == ["s1", "b1", "f1"]
        assert [(r.rollout_id, r.state, r.detail) for r in sent[3:]] == [("s1", "succeeded", "applied"),
                                                                       ("b1", "rolled_back", "rolled_back")]

    second = Recording()  # the device started again: the leader's retry of f1, and s1 sent again
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(runner(second), name="offers")
        ref.tell(Resume())
        ref.tell(Offer("f1", "2.0.0"))
        ref.tell(Offer("s1", "2.0.0"))
        for n in range(CONCLUDED_KEPT):  # newer rollouts: the runner keeps the newest outcomes only
            ref.tell(Offer(f"n{n}", "2.0.0"))
        ref.tell(Offer("s1", "2.0.0"))
        await clock.advance(1)
        assert second.applied == ["f1", *(f"n{n}" for n in range(CONCLUDED_KEPT)), "s1"]
    seqs = [r.seq for r in sent]
    assert seqs == sorted(set(seqs))
    assert len(msgspec.json.decode((tmp_path / JOURNAL).read_bytes())["concluded"]) == CONCLUDED_KEPT
