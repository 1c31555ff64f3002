"""Property test: for any sequence of puts and gets, every message is accounted for exactly once.

A stateful machine drives a real Mailbox and a plain-list model side by side under each policy,
with and without coalescing keys. After every step: each offered message is exactly one of
gotten, still queued, rejected, dropped or coalesced; the counters match those fates; FIFO order
holds; depth never exceeds capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from agent.actors import Mailbox
from agent.core.clock import VirtualClock
from agent.core.errors import MailboxFull


@dataclass
class Msg:
    id: int
    key: str | None
    seq: int


class MailboxMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.box: Mailbox | None = None
        self.model: list[Msg] = []  # what should be queued, oldest first
        self.next_id = 0
        self.fate: dict[int, str] = {}  # id -> gotten | rejected | dropped | coalesced
        self.discarded: list[tuple[int, str]] = []
        self.gotten: list[int] = []
        self.keys: dict[int, str | None] = {}

    @initialize(
        capacity=st.integers(min_value=1, max_value=5),
        policy=st.sampled_from(["reject", "drop_oldest", "drop_newest"]),
    )
    def make(self, capacity: int, policy: str) -> None:
        self.capacity = capacity
        self.policy = policy
        self.box = Mailbox(
            capacity,
            policy,  # type: ignore[arg-type]
            name="prop",
            clock=VirtualClock(),
            on_discard=lambda item, reason: self.discarded.append((item.id, reason)),  # type: ignore[attr-defined]
        )

    def _fate(self, msg_id: int, fate: str) -> None:
        assert msg_id not in self.fate, f"message {msg_id} met two fates"
        self.fate[msg_id] = fate

    @rule(key=st.one_of(st.none(), st.sampled_from(["a", "b", "c"])), seq=st.integers(0, 6))
    def put(self, key: str | None, seq: int) -> None:
        assert self.box is not None
        msg = Msg(self.next_id, key, seq)
        self.next_id += 1
        self.keys[msg.id] = key
        before = len(self.discarded)
        # The model: what must happen to this message.
        queued = next((m for m in self.model if key is not None and m.key == key), None)
        try:
            self.box.put_nowait(msg, coalesce_key=key, seq=seq)
        except MailboxFull:
            assert queued is None and len(self.model) == self.capacity
            assert self.policy == "reject"
            self._fate(msg.id, "rejected")
            return
        new = self.discarded[before:]
        if queued is not None:
            if seq > queued.seq:
                assert new == [(queued.id, "coalesced")]
                self._fate(queued.id, "coalesced")
                self.model[self.model.index(queued)] = msg
            else:
                assert new == [(msg.id, "coalesced")]
                self._fate(msg.id, "coalesced")
        elif len(self.model) == self.capacity:
            assert self.policy != "reject"
            if self.policy == "drop_newest":
                assert new == [(msg.id, "dropped")]
                self._fate(msg.id, "dropped")
            else:
                oldest = self.model.pop(0)
                assert new == [(oldest.id, "dropped")]
                self._fate(oldest.id, "dropped")
                self.model.append(msg)
        else:
            assert new == []
            self.model.append(msg)

    @precondition(lambda self: self.box is not None and self.model)
    @rule()
    def get(self) -> None:
        assert self.box is not None
        got = self.box.get_nowait()
        self.box.task_done()
        expected = self.model.pop(0)
        assert got is expected  # FIFO, with coalesced messages at their first position
        self.gotten.append(expected.id)
        self._fate(expected.id, "gotten")

    @invariant()
    def accounted(self) -> None:
        if self.box is None:
            return
        s = self.box.statistics()
        queued_ids = [m.id for m in self.model]
        assert s.depth == len(self.model) <= self.capacity
        assert s.high_water <= self.capacity
        # Every offered message is gotten, queued, or counted, and only one of these.
        assert set(self.fate) | set(queued_ids) == set(range(self.next_id))
        assert not set(self.fate) & set(queued_ids)
        counts = {f: sum(1 for v in self.fate.values() if v == f) for f in
                  ("gotten", "rejected", "dropped", "coalesced")}
        assert s.processed == counts["gotten"]
        assert s.rejected == counts["rejected"]
        assert s.dropped == counts["dropped"]
        assert s.coalesced == counts["coalesced"]
        assert self.next_id == s.enqueued + s.rejected
        assert s.enqueued == s.processed + s.depth + s.dropped + s.coalesced + s.drained
        # FIFO among messages that kept their identity: ids come out in increasing order,
        # except that a coalescing replacement inherits the position of the one it replaced.
        plain = [i for i in self.gotten if self.keys[i] is None]
        assert plain == sorted(plain)

    def teardown(self) -> None:
        if self.box is None:
            return
        rest = self.box.drain()
        assert [m.id for m in rest] == [m.id for m in self.model]  # type: ignore[attr-defined]


TestMailboxProperties = MailboxMachine.TestCase
TestMailboxProperties.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)


@pytest.mark.parametrize("policy", ["reject", "drop_oldest", "drop_newest"])
def test_plain_messages_keep_fifo_order_under_every_policy(policy: str) -> None:
    box = Mailbox(3, policy, name="fifo", clock=VirtualClock())  # type: ignore[arg-type]
    out: list[int] = []
    for i in range(50):
        try:
            box.put_nowait(i)
        except MailboxFull:
            pass
        if i % 3 == 2:
            out.append(box.get_nowait())  # type: ignore[arg-type]
            box.task_done()
    while not box.empty():
        out.append(box.get_nowait())  # type: ignore[arg-type]
        box.task_done()
    assert out == sorted(out)
