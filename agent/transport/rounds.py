"""The broker of a fleet simulated in several processes: one `RoundBroker` per process, delivering
in rounds.

Each process holds its own devices' sessions (and the leader's, in the leader's process). A message
published during a round (`round_s` of fleet time) is held; at the end of the NEXT round every
process routes that round's messages, its own and those the others sent it, in one order: by
publish time, then by the publishing process, then as published. In the network model this is the
broker's delivery latency, between `round_s` and twice that; its least value is the lookahead: no
message can arrive in another process's past, and a process may run a round ahead of the others
while their messages are on their way (`agent.sim.processes`).

Which messages cross: each process tells the others the topic filters its sessions subscribe to
(once per filter, and again when the last session drops it); a held message goes to every other
process with a matching filter, and a retained one to every process (each keeps it for its own
later subscribers). A shared subscription is advertised by its topic filter; the process of its
members picks among them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from agent.core.clock import Clock
from agent.transport import topics
from agent.transport._memory_broker import _ROUTES_MAX, MemoryBroker, _Group, _Session, _Sub
from agent.transport.base import InboundMessage

# One message on the wire between processes: (time, process, seq, topic, payload, retain,
# response topic, correlation, qos).
WireMessage = tuple[float, int, int, str, bytes, bool, "str | None", "bytes | None", int]
# A subscription change: (process, True when added / False when dropped, topic filter).
FilterChange = tuple[int, bool, str]


@dataclass(slots=True)
class RoundOutput:
    """What one process hands over at the end of a round."""

    local: list[WireMessage] = field(default_factory=list)  # routed here
    outbound: dict[int, list[WireMessage]] = field(default_factory=dict)  # process -> its share
    changes: list[FilterChange] = field(default_factory=list)  # this process's filters, added or dropped


class RoundBroker(MemoryBroker):
    """A `MemoryBroker` for one process `rank` of a fleet spread over processes (see the module)."""

    def __init__(self, *, rank: int, clock: Clock, rng: random.Random, max_queued_per_session: int) -> None:
        super().__init__(clock=clock, rng=rng, max_queued_per_session=max_queued_per_session)
        self.rank = rank
        self._held: list[WireMessage] = []
        self._seq = 0
        self._local_filters: dict[str, int] = {}  # inner filter -> index entries using it here
        self._changes: list[FilterChange] = []
        self._remote_exact: dict[str, set[int]] = {}
        self._remote_wild: dict[str, set[int]] = {}
        self._remote_routes: dict[str, tuple[int, ...]] = {}
        self.crossed = 0  # messages sent to another process
        self.arrived = 0  # messages received from another process

    # -- holding -------------------------------------------------------------------------------
    def _route(self, message: InboundMessage) -> None:
        """Hold what is published (and the wills fired) here until the round ends."""
        self._stats.published += 1
        self._seq += 1
        self._held.append((self.clock.monotonic(), self.rank, self._seq, message.topic, message.payload,
                           message.retain, message.response_topic, message.correlation, message.qos))

    def end_round(self, processes: int) -> RoundOutput:
        """Take the round's held messages: those routed here, and each other process's share."""
        out = RoundOutput(changes=self._changes)
        self._changes = []
        held, self._held = self._held, []
        everyone = tuple(r for r in range(processes) if r != self.rank)
        for wire in held:
            out.local.append(wire)
            for rank in (everyone if wire[5] else self._remote_targets(wire[3])):
                out.outbound.setdefault(rank, []).append(wire)
        self.crossed += sum(len(batch) for batch in out.outbound.values())
        return out

    def deliver_round(self, local: list[WireMessage], arrived: list[WireMessage]) -> None:
        """Route the round's messages here, in the one order every process uses."""
        self.arrived += len(arrived)
        batch = local + arrived if arrived else local
        batch.sort(key=_order)
        fan_out = self._fan_out
        for _, _, _, topic, payload, retain, response_topic, correlation, qos in batch:
            fan_out(InboundMessage(topic, payload, retain, response_topic, correlation, qos))

    # -- filters, here and elsewhere -------------------------------------------------------
    def _index(self, entry: _Sub | _Group) -> None:
        super()._index(entry)
        count = self._local_filters.get(entry.inner, 0)
        self._local_filters[entry.inner] = count + 1
        if count == 0:
            self._changes.append((self.rank, True, entry.inner))

    def _unsubscribe(self, session: _Session, sub_filter: str) -> None:
        entry = session.subs.get(sub_filter)
        super()._unsubscribe(session, sub_filter)
        if entry is None or (isinstance(entry, _Group) and entry.members):
            return
        count = self._local_filters.get(entry.inner, 0) - 1
        if count > 0:
            self._local_filters[entry.inner] = count
            return
        self._local_filters.pop(entry.inner, None)
        self._changes.append((self.rank, False, entry.inner))

    def apply_changes(self, changes: list[FilterChange]) -> None:
        """The other processes' filters, added or dropped since the last round."""
        for rank, added, sub_filter in changes:
            if rank == self.rank:
                continue
            index = self._remote_wild if topics.is_wildcard(sub_filter) else self._remote_exact
            ranks = index.setdefault(sub_filter, set())
            if added:
                ranks.add(rank)
            else:
                ranks.discard(rank)
                if not ranks:
                    del index[sub_filter]
        if changes:
            self._remote_routes.clear()

    def _remote_targets(self, topic: str) -> tuple[int, ...]:
        targets = self._remote_routes.get(topic)
        if targets is None:
            found = set(self._remote_exact.get(topic, ()))
            for sub_filter, ranks in self._remote_wild.items():
                if topics.matches(sub_filter, topic):
                    found |= ranks
            if len(self._remote_routes) >= _ROUTES_MAX:
                self._remote_routes.clear()
            targets = self._remote_routes[topic] = tuple(sorted(found))
        return targets


def _order(wire: WireMessage) -> tuple[float, int, int]:
    return wire[0], wire[1], wire[2]


__all__ = ["FilterChange", "RoundBroker", "RoundOutput", "WireMessage"]
