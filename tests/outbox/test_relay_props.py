"""Property test: random delivery outcomes, durations and gate flaps, on a virtual clock.

Whatever happens: nothing is sent while the gate is closed, FIFO receivers never have two rows
in flight, a row's attempts never exceed its tries, every row ends delivered or dead once the
gate stays open, and the conservation law holds."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from relay_support import MemoryOutbox, message

from agent.core.clock import VirtualClock
from agent.core.errors import Capacity, Permanent, Transient
from agent.core.gate import Gate
from agent.outbox.limiter import AimdSettings
from agent.outbox.relay import Relay
from agent.outbox.retry import RetryPolicy
from agent.outbox.types import OutboxRow

OUTCOMES = ["ok", "ok", "ok", "capacity", "transient", "permanent", "bug"]


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@example(  # once spun forever: a full lane's class-discovery timer a float sliver early
    n=51,
    receivers=1,
    partitions=1,
    outcomes=["ok", "transient", "capacity", "permanent", "permanent", "ok", "ok", "transient",
              "capacity", "ok", "ok", "ok", "bug", "capacity", "permanent", "capacity"],
    durations=[0.3, 2.0, 0.01, 0.3],
    flaps=[3.5604511628293602, 3.6539354550824608, 2.207365071819069, 1.3693467030215518,
           0.7967280271812888, 0.31157889578617676],
    seed=5761,
)
@given(
    n=st.integers(min_value=1, max_value=60),
    receivers=st.integers(min_value=1, max_value=6),
    partitions=st.integers(min_value=1, max_value=3),
    outcomes=st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=40),
    durations=st.lists(st.sampled_from([0.0, 0.0, 0.01, 0.3, 2.0]), min_size=1, max_size=10),
    flaps=st.lists(st.floats(min_value=0.05, max_value=5.0), max_size=8),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_random_outcomes_and_gate_flaps(
    n: int,
    receivers: int,
    partitions: int,
    outcomes: list[str],
    durations: list[float],
    flaps: list[float],
    seed: int,
) -> None:
    asyncio.run(_scenario(n, receivers, partitions, outcomes, durations, flaps, seed))


async def _scenario(
    n: int,
    receivers: int,
    partitions: int,
    outcomes: list[str],
    durations: list[float],
    flaps: list[float],
    seed: int,
) -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock, max_attempts=4, fifo=["cmd"])
    gate = Gate(is_open=True)
    tries: Counter[int] = Counter()
    seen: dict[int, set[str]] = {}  # outcomes each row was given
    flying: Counter[str] = Counter()
    calls = 0

    async def deliver(row: OutboxRow) -> None:
        nonlocal calls
        assert gate.is_open, "sent while the gate was closed"
        if row.kind == "cmd":
            flying[row.receiver] += 1
            assert flying[row.receiver] == 1, "two rows of a FIFO receiver in flight"
        try:
            tries[row.row_id] += 1
            outcome = outcomes[calls % len(outcomes)]
            seen.setdefault(row.row_id, set()).add(outcome)
            wait = durations[calls % len(durations)]
            calls += 1
            if wait:
                await clock.sleep(wait)
            if outcome == "capacity":
                raise Capacity("full", retry_after_ms=200)
            if outcome == "transient":
                raise Transient("timeout")
            if outcome == "permanent":
                raise Permanent("refused")
            if outcome == "bug":
                raise RuntimeError("receiver bug")
        finally:
            if row.kind == "cmd":
                flying[row.receiver] -= 1

    for i in range(n):
        kind = "cmd" if i % 3 == 0 else "telemetry"
        await store.enqueue(message(f"m{i:03d}", receiver=f"r{i % receivers}", kind=kind))
    relay = Relay(
        store,
        deliver,
        clock=clock,
        ready=gate,
        partitions=partitions,
        retry=RetryPolicy(base_s=0.1, cap_s=1.0, transient_floor_s=0.05),
        limits=AimdSettings(initial=3, min=1, max=6),
        rng=random.Random(seed),
        reconnect_jitter_s=0.5,
    )
    async with relay:
        for i, at in enumerate(flaps):
            await clock.advance(at)
            gate.close() if i % 2 == 0 else gate.open()
        gate.open()
        await clock.advance(600)
        m = relay.metrics()
        stats = await store.stats()
    assert stats.conservation_ok, stats
    assert len(store.in_flight) <= stats.pending  # only a row still answered busy may be on its way
    assert stats.delivered + stats.dead_lettered + stats.pending == n
    for row_id, rec in store.recs.items():
        if rec.status == "pending":
            # only a receiver that answered busy every time keeps a row (busy spends no attempt),
            # or a FIFO row queued behind one
            assert seen.get(row_id, {"capacity"}) == {"capacity"} and rec.row.attempts == 0, (row_id, seen.get(row_id))
            assert "capacity" in outcomes
            continue
        assert rec.status in ("done", "dead")
        assert rec.row.attempts <= tries[row_id]
        assert rec.status != "dead" or seen[row_id] != {"capacity"}, "a row died of busy answers"
        if rec.status == "dead":
            assert rec.row.attempts == 4 or rec.row.last_error == "refused"
    assert m.in_flight <= stats.pending
    assert m.delivered >= stats.delivered
