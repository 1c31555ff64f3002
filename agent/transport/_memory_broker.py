"""The in-process broker behind `MemoryTransport`: topic routing, persistent sessions, retained
messages, wills, shared subscriptions and injected failures, with the semantics described in
`agent.transport.memory`."""

from __future__ import annotations

import itertools
import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.core.clock import Clock
from agent.core.errors import ConnectionLost, NotConnected
from agent.transport import topics
from agent.transport.base import InboundMessage, PayloadTooLarge, Will

if TYPE_CHECKING:
    from agent.transport.memory import MemoryTransport

log = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024
DEFAULT_MAX_QUEUED_PER_SESSION = 10_000
# Topics whose subscribers are remembered (a fleet has a handful per device); past this the
# memo starts over rather than grow without bound on a stream of one-off topics.
_ROUTES_MAX = 200_000


@dataclass(slots=True)
class BrokerStats:
    published: int = 0
    delivered: int = 0
    queued: int = 0  # QoS 1 messages queued for an offline persistent session
    dropped_queue_full: int = 0
    dropped_offline: int = 0  # QoS 0, or a clean session, with nobody to take it
    wills_published: int = 0
    retained: int = 0
    sessions: int = 0
    connected: int = 0


class _Session:
    __slots__ = ("client_id", "persistent", "client", "subs", "pending", "inflight", "will", "dropped")

    def __init__(self, client_id: str, persistent: bool) -> None:
        self.client_id = client_id
        self.persistent = persistent
        self.client: MemoryTransport | None = None
        self.subs: dict[str, _Sub | _Group] = {}  # filter as subscribed -> index entry
        self.pending: deque[tuple[str, InboundMessage]] = deque()
        # Deliveries on their way to a delayed client, in send order. If the client goes away
        # first they return to the head of `pending` (QoS 1 resend on reconnect).
        self.inflight: dict[int, tuple[str, InboundMessage]] = {}
        self.will: Will | None = None
        self.dropped = 0


class _Sub:
    """One plain subscription of one session."""

    __slots__ = ("session", "sub_filter", "inner", "qos")

    def __init__(self, session: _Session, sub_filter: str, qos: int) -> None:
        self.session = session
        self.sub_filter = sub_filter
        self.inner = sub_filter
        self.qos = qos


class _Group:
    """A shared subscription `$share/{group}/{inner}`: one index entry for all its members."""

    __slots__ = ("sub_filter", "inner", "members", "next")

    def __init__(self, sub_filter: str, inner: str) -> None:
        self.sub_filter = sub_filter
        self.inner = inner
        self.members: dict[_Session, int] = {}  # session -> qos, in join order
        self.next = 0

    def pick(self) -> tuple[_Session, int] | None:
        """The next connected member round-robin; else the next persistent one (to queue)."""
        if len(self.members) == 1:  # one leader: no rotation to do
            for session, qos in self.members.items():
                if session.client is not None or session.persistent:
                    self.next = 0
                    return session, qos
            return None
        members = list(self.members.items())
        if not members:
            return None
        count = len(members)
        for wanted_online in (True, False):
            for step in range(count):
                index = (self.next + step) % count
                session, qos = members[index]
                online = session.client is not None
                if (online and wanted_online) or (not wanted_online and session.persistent):
                    self.next = (index + 1) % count
                    return session, qos
        return None


class MemoryBroker:
    """One in-process broker: a whole simulated world talks through it."""

    def __init__(
        self,
        *,
        clock: Clock,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_queued_per_session: int = DEFAULT_MAX_QUEUED_PER_SESSION,
        rng: random.Random | None = None,
    ) -> None:
        if max_payload_bytes < 1 or max_queued_per_session < 1:
            raise ValueError("max_payload_bytes and max_queued_per_session must be >= 1")
        self.clock = clock
        self.max_payload_bytes = max_payload_bytes
        self.max_queued_per_session = max_queued_per_session
        self.rng = rng if rng is not None else random.Random(0)
        self._sessions: dict[str, _Session] = {}
        self._exact: dict[str, dict[_Sub | _Group, None]] = {}
        self._wild: dict[_Sub | _Group, None] = {}
        # topic -> its index entries (exact ones, then matching wildcards, in subscription
        # order): the subscriptions change rarely, the same topics are published to all the time.
        self._routes: dict[str, tuple[_Sub | _Group, ...]] = {}
        self._valid: dict[str, None] = {}  # topic names already checked by `validate_topic`
        self._groups: dict[str, _Group] = {}
        self._retained: dict[str, tuple[InboundMessage, int]] = {}  # topic -> (message, qos)
        self._delays: dict[str, float] = {}
        self._partitioned: dict[str, None] = {}
        self._down = False
        self._waiting: dict[str, MemoryTransport] = {}  # cut-off clients waiting for heal
        self._tokens = itertools.count()
        self._stats = BrokerStats()
        # Clients with fresh deliveries, handed over by one callback per loop turn.
        self._ready_clients: list[MemoryTransport] = []

    # -- failure injection -----------------------------------------------------------------
    def partition(self, client_id: str | None = None) -> None:
        """Cut `client_id` off (or, with None, take the whole broker down) until `heal`.

        The connection breaks abruptly: the broker publishes the client's will (not when the whole
        broker goes down: a dead broker publishes nothing) and keeps its persistent session; the
        client's gate closes and it reconnects after the heal.
        """
        if client_id is None:
            self._down = True
            victims = [s for s in self._sessions.values() if s.client is not None]
        else:
            self._partitioned[client_id] = None
            session = self._sessions.get(client_id)
            victims = [session] if session is not None and session.client is not None else []
        for session in victims:
            client = session.client
            assert client is not None
            # A broker that goes down publishes nothing; one that loses a client fires its will.
            self._disconnect(client, fire_will=client_id is not None)
            client._lost("broker down" if client_id is None else "partitioned from the broker")

    def heal(self, client_id: str | None = None) -> None:
        """Undo `partition(client_id)`; with None, bring the broker back and heal every client."""
        if client_id is None:
            self._down = False
            self._partitioned.clear()
        else:
            self._partitioned.pop(client_id, None)
        for waiting_id, client in list(self._waiting.items()):
            if self.reachable(waiting_id):
                del self._waiting[waiting_id]
                client._schedule_reconnect()

    def set_delay(self, client_id: str, seconds: float) -> None:
        """One-way latency, in the clock's seconds, on everything to and from `client_id`."""
        if seconds <= 0:
            self._delays.pop(client_id, None)
        else:
            self._delays[client_id] = float(seconds)

    def delay_of(self, client_id: str) -> float:
        return self._delays.get(client_id, 0.0)

    def reachable(self, client_id: str) -> bool:
        return not self._down and client_id not in self._partitioned

    # -- inspection ------------------------------------------------------------------------
    def stats(self) -> BrokerStats:
        s = self._stats
        return BrokerStats(
            published=s.published,
            delivered=s.delivered,
            queued=s.queued,
            dropped_queue_full=s.dropped_queue_full,
            dropped_offline=s.dropped_offline,
            wills_published=s.wills_published,
            retained=len(self._retained),
            sessions=len(self._sessions),
            connected=sum(1 for x in self._sessions.values() if x.client is not None),
        )

    def queued(self, client_id: str) -> int:
        """QoS 1 messages waiting for `client_id`'s offline session."""
        session = self._sessions.get(client_id)
        return len(session.pending) if session is not None else 0

    def dropped(self, client_id: str) -> int:
        """Messages dropped because `client_id`'s session queue was full."""
        session = self._sessions.get(client_id)
        return session.dropped if session is not None else 0

    def retained(self, topic: str) -> bytes | None:
        entry = self._retained.get(topic)
        return entry[0].payload if entry is not None else None

    def is_connected(self, client_id: str) -> bool:
        session = self._sessions.get(client_id)
        return session is not None and session.client is not None

    # -- client side (called by MemoryTransport) -------------------------------------------
    def _connect(self, client: MemoryTransport) -> None:
        client_id = client.client_id
        if not self.reachable(client_id):
            raise NotConnected(f"broker unreachable for {client_id!r}")
        self._waiting.pop(client_id, None)
        session = self._sessions.get(client_id)
        if session is not None and session.client is not None and session.client is not client:
            taken = session.client
            self._disconnect(taken, fire_will=False)
            taken._lost("session taken over by another connection", reconnect=False)
            session = self._sessions.get(client_id)
        if session is not None and (client.clean_start or not session.persistent):
            self._drop_session(session)
            session = None
        if session is None:
            session = self._sessions[client_id] = _Session(client_id, not client.clean_start)
        session.client = client
        session.will = client.will
        while session.pending:  # queued while offline, in order
            sub_filter, message = session.pending.popleft()
            self._stats.delivered += 1
            client._enqueue(sub_filter, message)

    def _ready(self, client: MemoryTransport) -> None:
        """`client` has deliveries for its handlers: hand them over on the next loop turn, in one
        callback for every client that became ready in this one."""
        if not self._ready_clients and client._loop is not None:
            client._loop.call_soon(self._hand_over)
        self._ready_clients.append(client)

    def _hand_over(self) -> None:
        ready, self._ready_clients = self._ready_clients, []
        for client in ready:
            client._hand_over()

    def _disconnect(self, client: MemoryTransport, *, fire_will: bool) -> None:
        session = self._sessions.get(client.client_id)
        if session is None or session.client is not client:
            return
        session.client = None
        will = session.will
        if session.inflight:
            returned = [e for e in session.inflight.values() if session.persistent and e[1].qos >= 1]
            self._stats.dropped_offline += len(session.inflight) - len(returned)
            session.inflight.clear()
            session.pending.extendleft(reversed(returned))
        if not session.persistent:
            self._drop_session(session)
        if fire_will and will is not None:
            self._stats.wills_published += 1
            self._route(InboundMessage(will.topic, will.payload, will.retain, None, None, will.qos))

    def _drop_session(self, session: _Session) -> None:
        for sub_filter in list(session.subs):
            self._unsubscribe(session, sub_filter)
        session.pending.clear()
        session.inflight.clear()
        if self._sessions.get(session.client_id) is session:
            del self._sessions[session.client_id]

    def _subscribe(self, client: MemoryTransport, sub_filter: str, qos: int) -> None:
        session = self._sessions.get(client.client_id)
        if session is None or session.client is not client:
            raise NotConnected(f"{client.client_id!r} is not connected")
        group_name, inner = topics.split_shared(sub_filter)
        entry = session.subs.get(sub_filter)
        if entry is None:
            if group_name is None:
                entry = _Sub(session, sub_filter, qos)
                self._index(entry)
            else:
                entry = self._groups.get(sub_filter)
                if entry is None:
                    entry = self._groups[sub_filter] = _Group(sub_filter, inner)
                    self._index(entry)
                entry.members[session] = qos
            session.subs[sub_filter] = entry
        elif isinstance(entry, _Sub):
            entry.qos = qos
        else:
            entry.members[session] = qos
        if group_name is not None:
            return  # MQTT v5: no retained messages on a shared subscription
        if topics.is_wildcard(inner):
            found = [(t, m) for t, m in self._retained.items() if topics.matches(inner, t)]
        else:
            hit = self._retained.get(inner)
            found = [(inner, hit)] if hit is not None else []
        for _, (message, msg_qos) in found:
            self._deliver(session, sub_filter, message, min(qos, msg_qos))

    def _unsubscribe(self, session: _Session, sub_filter: str) -> None:
        entry = session.subs.pop(sub_filter, None)
        if entry is None:
            return
        if isinstance(entry, _Group):
            entry.members.pop(session, None)
            if entry.members:
                return
            self._groups.pop(sub_filter, None)
        if topics.is_wildcard(entry.inner):
            self._wild.pop(entry, None)
            self._routes.clear()
        else:
            self._routes.pop(entry.inner, None)
            bucket = self._exact.get(entry.inner)
            if bucket is not None:
                bucket.pop(entry, None)
                if not bucket:
                    del self._exact[entry.inner]

    def _index(self, entry: _Sub | _Group) -> None:
        if topics.is_wildcard(entry.inner):
            self._wild[entry] = None
            self._routes.clear()
        else:
            self._routes.pop(entry.inner, None)
            self._exact.setdefault(entry.inner, {})[entry] = None

    def _targets(self, topic: str) -> tuple[_Sub | _Group, ...]:
        """The index entries `topic` goes to: exact subscriptions first, then wildcards."""
        targets = self._routes.get(topic)
        if targets is None:
            found = list(self._exact.get(topic, ()))
            for entry in self._wild:
                if topics.matches(entry.inner, topic):
                    found.append(entry)
            if len(self._routes) >= _ROUTES_MAX:
                self._routes.clear()
            targets = self._routes[topic] = tuple(found)
        return targets

    def check_topic(self, topic: str) -> None:
        """`topics.validate_topic`, remembered per topic name (TopicError when invalid)."""
        if topic not in self._valid:
            topics.validate_topic(topic)
            if len(self._valid) >= _ROUTES_MAX:
                self._valid.clear()
            self._valid[topic] = None

    def _publish(self, client: MemoryTransport, message: InboundMessage) -> None:
        session = self._sessions.get(client.client_id)
        if session is None or session.client is not client:
            raise ConnectionLost(f"{client.client_id!r} lost its connection while publishing")
        if len(message.payload) > self.max_payload_bytes:
            raise PayloadTooLarge(len(message.payload), self.max_payload_bytes)
        self._route(message)

    def _route(self, message: InboundMessage) -> None:
        self._stats.published += 1
        self._fan_out(message)

    def _fan_out(self, message: InboundMessage) -> None:
        """Hand `message` to every subscription of its topic (and keep it when retained)."""
        topic = message.topic
        if message.retain:
            if message.payload:
                self._retained[topic] = (message, message.qos)
            else:
                self._retained.pop(topic, None)
            message = InboundMessage(
                topic,
                message.payload,
                False,
                message.response_topic,
                message.correlation,
                message.qos,
            )
        targets = self._routes.get(topic)
        if targets is None:
            targets = self._targets(topic)
        for entry in targets:
            if isinstance(entry, _Group):
                picked = entry.pick()
                if picked is None:
                    self._stats.dropped_offline += 1
                    continue
                session, qos = picked
            else:
                session, qos = entry.session, entry.qos
            client = session.client
            if client is not None and qos >= message.qos and not self._delays:
                # The common case: a connected client, no downgrade, no latency to add.
                self._stats.delivered += 1
                client._enqueue(entry.sub_filter, message)
                continue
            self._deliver(session, entry.sub_filter, message, min(qos, message.qos))

    def _deliver(self, session: _Session, sub_filter: str, message: InboundMessage, qos: int) -> None:
        if message.qos != qos:
            message = InboundMessage(
                message.topic,
                message.payload,
                message.retain,
                message.response_topic,
                message.correlation,
                qos,
            )
        if session.client is not None:
            delay = self._delays.get(session.client_id)
            if delay:
                token = next(self._tokens)
                session.inflight[token] = (sub_filter, message)
                self.clock.call_later(delay, lambda: self._arrive(session, token))
            else:
                self._stats.delivered += 1
                session.client._enqueue(sub_filter, message)
            return
        self._hold(session, sub_filter, message)

    def _arrive(self, session: _Session, token: int) -> None:
        """A delayed delivery reaches its client (unless the client left and it went back)."""
        entry = session.inflight.pop(token, None)
        if entry is None or session.client is None:
            return
        sub_filter, message = entry
        if sub_filter in session.subs:
            self._stats.delivered += 1
            session.client._enqueue(sub_filter, message)

    def _hold(self, session: _Session, sub_filter: str, message: InboundMessage) -> None:
        if not session.persistent or message.qos < 1:
            self._stats.dropped_offline += 1
            return
        if len(session.pending) >= self.max_queued_per_session:
            session.dropped += 1
            self._stats.dropped_queue_full += 1
            return
        self._stats.queued += 1
        session.pending.append((sub_filter, message))


def _as_message(will: Will) -> InboundMessage:
    return InboundMessage(will.topic, will.payload, will.retain, None, None, will.qos)


__all__ = ["BrokerStats", "MemoryBroker"]
