"""Property test: random sequences of enqueue / take / ack / nack / release / time / crash
against a plain model. No message is lost, none is handed out twice at once, the conservation
law holds after every step."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from store_support import assert_conserved

from agent.core.clock import VirtualClock
from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxMessage

MAX_ATTEMPTS = 2


@dataclass
class Row:
    receiver: str
    key: str | None
    conflict: str
    seq: int
    payload: bytes
    attempts: int = 0
    send_at: int = 0
    dead: bool = False


class OutboxMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-props-"))
        self.clock = VirtualClock()
        self.store: OutboxStore | None = None
        self.rows: dict[int, Row] = {}
        self.flying: set[int] = set()
        self.delivered: list[bytes] = []
        self.names = itertools.count()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @initialize()
    def open(self) -> None:
        self.store = self.run(
            OutboxStore.open(self.dir / "o.db", clock=self.clock, max_attempts=MAX_ATTEMPTS)
        )

    def teardown(self) -> None:
        try:
            if self.store is not None:
                self.run(self.store.close())
        finally:
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- model helpers -----------------------------------------------------------------------
    def pending_with(self, receiver: str, key: str) -> list[int]:
        return sorted(
            rid
            for rid, r in self.rows.items()
            if not r.dead and r.receiver == receiver and r.key == key
        )

    def okey(self, rid: int) -> tuple[str, str | None] | None:
        r = self.rows[rid]
        return (r.receiver, r.key) if r.conflict == "overwrite" else None

    def superseded(self, rid: int) -> bool:
        """An OVERWRITE row with a newer pending row of its key (nack/release coalesce it)."""
        row = self.rows[rid]
        return row.conflict == "overwrite" and any(
            self.rows[o].seq > row.seq
            for o in self.pending_with(row.receiver, row.key or "")
            if o != rid
        )

    # -- rules -------------------------------------------------------------------------------
    @rule(
        receiver=st.sampled_from(["a", "b", "c"]),
        key=st.sampled_from([None, "k1", "k2"]),
        overwrite=st.booleans(),
        seq=st.integers(0, 6),
        delay=st.sampled_from([0, 0, 1_000]),
        kind=st.sampled_from(["k", "k", "j"]),  # two classes: the law must hold in each
    )
    def enqueue(
        self, receiver: str, key: str | None, overwrite: bool, seq: int, delay: int, kind: str
    ) -> None:
        assert self.store is not None
        conflict = "overwrite" if overwrite and key is not None else "append"
        payload = b"p%d" % next(self.names)
        msg = OutboxMessage(
            msg_id=payload.decode(), owner="dev", receiver=receiver, kind=kind, payload=payload,
            key=key, conflict=conflict, seq=seq,  # type: ignore[arg-type]
        )
        result = self.run(self.store.enqueue(msg, delay_ms=delay))
        now = self.clock.now_ms()
        same = self.pending_with(receiver, key) if key is not None else []
        if key is not None and conflict == "append" and same:
            assert (result.outcome, result.row_id) == ("duplicate", same[0])
            return
        if conflict == "overwrite" and same:
            if seq <= max(self.rows[r].seq for r in same):
                assert result.outcome == "stale"
                return
            free = [r for r in same if r not in self.flying]
            if free:
                assert result.outcome == "overwritten"
                old_send = self.rows[free[0]].send_at
                for replaced in free:
                    del self.rows[replaced]
                assert result.row_id is not None and result.row_id not in self.rows
                send_at = old_send if delay == 0 else max(old_send, now + delay)
                self.rows[result.row_id] = Row(receiver, key, conflict, seq, payload,
                                               send_at=send_at)
                return
        assert result.outcome == "stored", result
        assert result.row_id is not None and result.row_id not in self.rows
        self.rows[result.row_id] = Row(receiver, key, conflict, seq, payload, send_at=now + delay)

    @rule(limit=st.integers(1, 8))
    def take(self, limit: int) -> None:
        assert self.store is not None
        got = self.run(self.store.take_ready(limit=limit))
        now = self.clock.now_ms()
        # An OVERWRITE key has at most one row in flight: a row of a key in flight waits, and
        # one take hands out at most one row per key (the first in ready order).
        busy = {self.okey(rid) for rid in self.flying} - {None}
        ready: list[int] = []
        for rid in sorted(
            (rid for rid, r in self.rows.items()
             if not r.dead and rid not in self.flying and r.send_at <= now),
            key=lambda rid: (self.rows[rid].send_at, rid),
        ):
            okey = self.okey(rid)
            if okey is not None:
                if okey in busy:
                    continue
                busy.add(okey)
            ready.append(rid)
        assert len(got) == min(limit, len(ready)), (got, ready)
        for row in got:
            model = self.rows[row.row_id]
            assert row.row_id not in self.flying and not model.dead
            assert (row.payload, row.seq, row.attempts) == (
                model.payload, model.seq, model.attempts,
            )
            self.flying.add(row.row_id)
        # FIFO by id per receiver among rows due at the same time
        for receiver in "abc":
            ids = [r.row_id for r in got if r.receiver == receiver]
            sends = [self.rows[i].send_at for i in ids]
            assert sorted(zip(sends, ids, strict=True)) == list(zip(sends, ids, strict=True))

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        assert self.store is not None
        ids = data.draw(st.lists(st.sampled_from(sorted(self.flying)), min_size=1, unique=True))
        self.run(self.store.ack(ids))
        for rid in ids:
            self.flying.discard(rid)
            self.delivered.append(self.rows.pop(rid).payload)

    @precondition(lambda self: self.flying)
    @rule(
        data=st.data(),
        delay=st.sampled_from([0, 500, 2_000]),
        outcome=st.sampled_from(["transient", "transient", "capacity"]),
    )
    def nack(self, data: st.DataObject, delay: int, outcome: str) -> None:
        assert self.store is not None
        self.nack_one(data.draw(st.sampled_from(sorted(self.flying))), delay, outcome)

    def nack_one(self, rid: int, delay: int, outcome: str = "transient") -> None:
        assert self.store is not None
        died = self.run(
            self.store.nack(rid, delay_ms=delay, error="nope", outcome=outcome)  # type: ignore[arg-type]
        )
        self.flying.discard(rid)
        row = self.rows[rid]
        if outcome == "transient":  # a busy answer (capacity) spends no attempt
            row.attempts += 1
        row.send_at = self.clock.now_ms() + delay
        if self.superseded(rid):
            assert died is False
            del self.rows[rid]
            return
        assert died == (row.attempts >= MAX_ATTEMPTS)
        row.dead = died

    @rule()
    def fail_everything_ready(self) -> None:
        """A receiver that refuses every message: take all that is ready, nack each at once."""
        assert self.store is not None
        self.take(limit=50)
        for rid in sorted(self.flying):
            self.nack_one(rid, 0)

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        assert self.store is not None
        ids = data.draw(st.lists(st.sampled_from(sorted(self.flying)), min_size=1, unique=True))
        self.run(self.store.release(ids))
        self.flying.difference_update(ids)
        for rid in ids:
            if self.superseded(rid):
                del self.rows[rid]

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0]))
    def advance(self, seconds: float) -> None:
        self.run(self.clock.advance(seconds))

    @rule()
    def crash(self) -> None:
        """Close without acking what is in flight, then reopen: those rows are pending again
        and keep their attempts."""
        assert self.store is not None
        self.run(self.store.close())
        self.store = self.run(
            OutboxStore.open(self.dir / "o.db", clock=self.clock, max_attempts=MAX_ATTEMPTS)
        )
        self.flying.clear()

    @rule()
    def replay(self) -> None:
        assert self.store is not None
        dead = [rid for rid, r in self.rows.items() if r.dead]
        assert self.run(self.store.replay()) == len(dead)
        for rid in dead:
            row = self.rows[rid]
            row.dead, row.attempts, row.send_at = False, 0, self.clock.now_ms()

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def conserved_and_matches_model(self) -> None:
        if self.store is None:
            return
        stats = self.run(assert_conserved(self.store))
        assert stats.pending == sum(1 for r in self.rows.values() if not r.dead)
        assert stats.dead == sum(1 for r in self.rows.values() if r.dead)
        assert stats.in_flight == len(self.flying)
        keys = [self.okey(rid) for rid in self.flying]
        keys = [k for k in keys if k is not None]
        assert len(keys) == len(set(keys)), "two rows of one OVERWRITE key in flight"
        assert stats.delivered == len(self.delivered)


OutboxMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
TestOutboxProperties = OutboxMachine.TestCase
