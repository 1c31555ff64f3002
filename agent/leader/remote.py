"""The leader's side of remote sessions (docs/remote.md): the operator socket, each operator's right
to each operation, the relay to the device over the broker, the audit record.

    operator's CLI ──► operator.sock (0660): who it is, the kernel says (SO_PEERCRED -> a user name)
        Open{device, op, ...}
          ├─ refused, recorded: no right (`[remote] shell_operators`, `forward_operators`), an
          │  unknown, revoked or offline device, too many sessions of this operator
          └─► Open{sid, operator, leader} on the device's session/down; its answer within
              `open_timeout_s`, then frames both ways until either side closes, the operator's
              connection ends, the device is gone (nothing for `GONE_AFTER_S`) or revoked; a side
              that sends more than its window, or frames out of order, ends the session
    CloseSession{sid} (`devices close`): ends a session this leader holds

Every session asked for is a row of `SessionLog` (refused ones too), with its bytes each way and
how it ended; with `record_input` the operator's input to a shell as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import secrets
import time
from typing import Any

import msgspec

from agent.core.config import RemoteSection, resolve
from agent.core.errors import StoreError, TransportError
from agent.core.peercred import peer_credentials
from agent.leader.agent import LeaderAgent
from agent.leader.env import GatewayEnv
from agent.leader.session_log import INPUT_MAX_BYTES, SessionLog
from agent.remote.flow import FlowError, RelayWindow
from agent.remote.frames import (
    FRAME_DATA_MAX,
    GONE_AFTER_S,
    KEEPALIVE_S,
    Accepted,
    Ack,
    Close,
    CloseSession,
    Data,
    Exit,
    Frame,
    FrameError,
    Open,
    Ping,
    Refused,
    decode,
    encode,
    framed,
    read_framed,
)
from agent.service.parts import PartBase
from agent.transport import topics
from agent.transport.base import InboundMessage

log = logging.getLogger(__name__)

FIRST_FRAME_S = 10.0  # an operator connection says what it wants within this
CONNECTIONS_PER_USER = 8  # operator connections of one user at once (open sessions and waiting ones)
SESSIONS_MAX = 64  # sessions this leader relays at once


class _Relay:
    """One session: the operator's connection on one side, the device on the other."""

    def __init__(self, sid: str, open_: Open, writer: asyncio.StreamWriter, user: str) -> None:
        self.sid = sid
        self.open = open_
        self.user = user  # the operator on the socket, as the kernel said
        self.device = open_.device
        self.writer = writer
        self.answer: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self.to_operator: asyncio.Queue[Frame | None] = asyncio.Queue()
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.to_device = RelayWindow()  # the operator's data bytes, acknowledged by the device
        self.from_device = RelayWindow()  # the device's, acknowledged by the operator
        self.exit_code: int | None = None
        self.heard = time.monotonic()
        self.said = time.monotonic()
        self.input_kept = 0
        self.input_seq = 0

    def end(self, reason: str) -> None:
        if not self.done.done():
            self.done.set_result(reason)


class RemoteRelay(PartBase):
    name = "remote sessions"

    def __init__(self, leader: LeaderAgent, log_: SessionLog, settings: RemoteSection) -> None:
        self.leader = leader
        self.sessions_log = log_
        self.settings = settings
        self.fleet = leader.fleet
        self.leader_id = leader.device_id
        self.path = resolve(leader.data_dir, settings.socket)
        self.relays: dict[str, _Relay] = {}
        self.connections: dict[int, int] = {}  # uid -> operator connections open
        self.refused = 0
        self.dropped = 0  # device frames of no session of theirs
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._keepalive: asyncio.Task[None] | None = None

    # -- the part ------------------------------------------------------------------------------
    async def start(self) -> None:
        with contextlib.suppress(StoreError):
            stale = self.sessions_log.close_stale(self.leader_id)
            if stale:
                log.info("%d remote sessions were open when this leader stopped: recorded closed", stale)
        await self.leader.transport.subscribe(topics.sessions_up_filter(self.fleet, self.leader_id),
                                              self._on_device_frame, qos=0)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        old = os.umask(0o117)
        try:
            self._server = await asyncio.start_unix_server(self._on_operator, path=str(self.path),
                                                           limit=FRAME_DATA_MAX * 4)
        finally:
            os.umask(old)
        self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive())
        log.info("operator socket listening", extra={"kv": {"socket": str(self.path)}})

    async def stop(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self._server is not None:
            self._server.close()
        for relay in list(self.relays.values()):
            relay.end("the leader is stopping")
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 10.0)
        with contextlib.suppress(TransportError):
            await self.leader.transport.unsubscribe(topics.sessions_up_filter(self.fleet, self.leader_id))
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.sessions_log.close()

    # -- the operator's side -------------------------------------------------------------------
    async def _on_operator(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        uid = -1
        try:
            uid = peer_credentials(writer.get_extra_info("socket")).uid
            if self.connections.get(uid, 0) >= CONNECTIONS_PER_USER:
                writer.write(framed(Refused(sid="", reason=f"{CONNECTIONS_PER_USER} connections of this user are"
                                                           " open on the operator socket")))
                return
            self.connections[uid] = self.connections.get(uid, 0) + 1
            await self._serve_operator(_user_name(uid), reader, writer)
        except (OSError, FrameError, asyncio.IncompleteReadError) as exc:
            log.info("operator connection ended: %s", exc)
        finally:
            if uid in self.connections:
                self.connections[uid] -= 1
                if not self.connections[uid]:
                    del self.connections[uid]
            with contextlib.suppress(OSError, ConnectionError):
                writer.close()
                await writer.wait_closed()
            if task is not None:
                self._tasks.discard(task)

    async def _serve_operator(self, user: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await asyncio.wait_for(read_framed(reader), FIRST_FRAME_S)
        except TimeoutError:
            return
        if isinstance(first, CloseSession):
            writer.write(framed(self._close_request(user, first.sid)))
            await writer.drain()
            return
        who = f"{user} for {first.operator}" if isinstance(first, Open) and first.operator else user
        if not isinstance(first, Open):
            writer.write(framed(Refused(sid="", reason="a session starts with an open")))
            return
        sid = secrets.token_hex(16)
        target = first.target
        why = self._refusal(user, first)
        if why:
            self.refused += 1
            log.warning("remote %s on %s by %s refused: %s", first.op, first.device, user, why)
            self._record(lambda: self.sessions_log.opened(sid=sid, leader=self.leader_id, device_id=first.device,
                                                          operator=who, op=first.op, target=target,
                                                          state="refused", reason=why))
            writer.write(framed(Refused(sid=sid, reason=why[:512])))
            await writer.drain()
            return
        relay = _Relay(sid, first, writer, user)
        self.relays[sid] = relay
        self._record(lambda: self.sessions_log.opened(sid=sid, leader=self.leader_id, device_id=first.device,
                                                      operator=who, op=first.op, target=target))
        state, reason = "closed", ""
        try:
            reason = await self._relay(relay, who, reader, writer)
            state = "refused" if relay.answer.done() and isinstance(relay.answer.result(), Refused) else "closed"
        finally:
            self.relays.pop(sid, None)
            self._record(lambda: self.sessions_log.ended(
                sid, state=state, bytes_to_device=relay.to_device.passed,
                bytes_from_device=relay.from_device.passed,
                exit_code=relay.exit_code, reason=reason or "ended"))
            log.info("remote %s %s on %s by %s %s: %s (%d bytes to the device, %d from it)", first.op, sid,
                     first.device, user, state, reason, relay.to_device.passed, relay.from_device.passed)

    def _refusal(self, user: str, open_: Open) -> str:
        s = self.settings
        key = f"{open_.op}_operators"
        if user not in getattr(s, key):
            return f"operator {user} has no right to {open_.op} (the leader's remote.{key})"
        if open_.device in self.leader.revoked:
            return f"{open_.device} is revoked"
        record = self.leader.registry.device(open_.device)
        if record is None:
            return f"no device {open_.device} in this fleet"
        if not record.online:
            return f"{open_.device} is offline"
        facts = dict(record.facts)
        if facts:  # (what its newest full heartbeat said it takes; none said: an older agent, it answers itself)
            takes = [op for op in facts.get("remote", "").split(",") if op]
            if open_.op not in takes:
                return (f"{open_.device} takes no remote sessions: its config's [remote] turns none on" if not takes
                        else f"{open_.device} does not take {open_.op}: its config's [remote] turns on"
                             f" {', '.join(takes)}")
        if len(self.relays) >= SESSIONS_MAX:
            return f"{SESSIONS_MAX} sessions are open on this leader"
        mine = sum(1 for r in self.relays.values() if r.user == user)
        if mine >= s.max_sessions:
            return f"operator {user} has {mine} sessions open (the leader's remote.max_sessions)"
        return ""

    def _close_request(self, user: str, sid: str) -> Frame:
        relay = self.relays.get(sid)
        if relay is None:
            return Refused(sid=sid, reason=f"no open session {sid} on this leader ({self.leader_id})")
        s = self.settings
        if user not in s.shell_operators + s.forward_operators + s.logs_operators:
            return Refused(sid=sid, reason=f"operator {user} has no right to close sessions")
        relay.end(f"closed by {user}")
        return Close(sid=sid, reason=f"closed by {user}")

    async def _relay(self, relay: _Relay, user: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> str:
        sid, o = relay.sid, relay.open
        opened = msgspec.structs.replace(o, sid=sid, operator=user[:128], leader=self.leader_id)
        try:
            self._to_device(relay, opened)
        except (TransportError, topics.TopicError) as exc:
            writer.write(framed(Refused(sid=sid, reason=f"not sent to {o.device}: {exc}"[:512])))
            return f"not sent: {exc}"
        try:
            answer = await asyncio.wait_for(asyncio.shield(relay.answer), self.settings.open_timeout_s)
        except TimeoutError:
            why = (f"{o.device} did not answer within {self.settings.open_timeout_s:g} s: its config's [remote] may"
                   " turn none on (an agent that has not said), or it is unreachable")
            writer.write(framed(Refused(sid=sid, reason=why)))
            with contextlib.suppress(TransportError, topics.TopicError):
                self._to_device(relay, Close(sid=sid, reason=why))
            return why
        writer.write(framed(answer))
        await writer.drain()
        if isinstance(answer, Refused):
            return f"refused by the device: {answer.reason}"
        self._record(lambda: self.sessions_log.accepted(sid))
        pump_out = asyncio.get_running_loop().create_task(self._pump_to_operator(relay))
        pump_in = asyncio.get_running_loop().create_task(self._pump_to_device(relay, reader))
        try:
            reason = await relay.done
        finally:
            pump_in.cancel()
            relay.to_operator.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError, OSError, ConnectionError):
                await asyncio.wait_for(pump_out, 5.0)
            pump_out.cancel()
        if not reason.startswith("the device closed it"):
            with contextlib.suppress(TransportError, topics.TopicError):
                self._to_device(relay, Close(sid=sid, reason=reason[:512]))
        with contextlib.suppress(OSError, ConnectionError):
            writer.write(framed(Close(sid=sid, reason=reason[:512])))
            await writer.drain()
        return reason

    async def _pump_to_device(self, relay: _Relay, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                frame = await read_framed(reader)
                if frame is None:
                    relay.end("the operator's connection ended")
                    return
                if isinstance(frame, Close):
                    relay.end(f"closed by the operator{': ' + frame.reason if frame.reason else ''}")
                    return
                if isinstance(frame, Open | CloseSession | Accepted | Refused | Exit):
                    relay.end(f"the operator sent a {type(frame).__name__.lower()} inside a session")
                    return
                frame = _with_sid(frame, relay.sid)
                try:
                    if isinstance(frame, Data):
                        relay.to_device.pass_on(frame)
                        self._keep_input(relay, frame.data)
                    elif isinstance(frame, Ack):
                        relay.from_device.ack(frame)
                except FlowError as exc:
                    relay.end(f"the operator {exc}")
                    return
                self._to_device(relay, frame)
        except (FrameError, OSError, asyncio.IncompleteReadError) as exc:
            relay.end(f"the operator's connection: {exc}")
        except (TransportError, topics.TopicError) as exc:
            relay.end(f"the broker: {exc}")

    def _keep_input(self, relay: _Relay, data: bytes) -> None:
        if not (self.settings.record_input and relay.open.op == "shell") or relay.input_kept >= INPUT_MAX_BYTES:
            return
        kept = data[:INPUT_MAX_BYTES - relay.input_kept]
        relay.input_kept += len(kept)
        relay.input_seq += 1
        seq = relay.input_seq
        self._record(lambda: self.sessions_log.input(relay.sid, seq, kept))

    async def _pump_to_operator(self, relay: _Relay) -> None:
        while True:
            frame = await relay.to_operator.get()
            if frame is None:
                return
            relay.writer.write(framed(frame))
            await relay.writer.drain()

    def _to_device(self, relay: _Relay, frame: Frame) -> None:
        relay.said = time.monotonic()
        self.leader.transport.publish_nowait(topics.session_down(self.fleet, relay.device), encode(frame))

    # -- the device's side ---------------------------------------------------------------------
    def _on_device_frame(self, message: InboundMessage) -> None:
        device = topics.session_device(message.topic)
        payload = bytes(message.payload)
        try:
            frame = decode(payload)
        except FrameError as exc:
            self._drop(message.topic, device, f"a malformed session frame: {exc}", payload)
            return
        relay = self.relays.get(frame.sid)
        if relay is None or relay.device != device:
            if not isinstance(frame, Close | Ping):  # (the end of a session this leader has let go)
                self._drop(message.topic, device, f"a session frame of no session of {device}", payload)
            return
        relay.heard = time.monotonic()
        if isinstance(frame, Accepted | Refused):
            if not relay.answer.done():
                relay.answer.set_result(frame)
            return
        if isinstance(frame, Open | CloseSession):
            relay.end(f"the device sent a {type(frame).__name__.lower()}")
            return
        if isinstance(frame, Close):
            relay.end(f"the device closed it: {frame.reason}" if frame.reason else "the device closed it")
            return
        if isinstance(frame, Exit):
            relay.exit_code = frame.code
        elif isinstance(frame, Data | Ack):
            try:
                if isinstance(frame, Data):
                    relay.from_device.pass_on(frame)
                else:
                    relay.to_device.ack(frame)
            except FlowError as exc:
                relay.end(f"the device {exc}")
                return
        elif isinstance(frame, Ping):
            return
        relay.to_operator.put_nowait(frame)

    def _drop(self, topic: str, device: str | None, reason: str, payload: bytes) -> None:
        self.dropped += 1
        if self.dropped <= 100 or self.dropped % 1000 == 0:  # a flood costs one row per 1000 after the first
            self.leader.record_reject(topic=topic, reason=reason, payload=payload, sender=device)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            now = time.monotonic()
            for relay in list(self.relays.values()):
                if relay.device in self.leader.revoked:
                    relay.end(f"{relay.device} was revoked")
                elif relay.answer.done() and now - relay.heard > GONE_AFTER_S:
                    relay.end(f"nothing from {relay.device} for {GONE_AFTER_S:.0f} s: it is gone")
                elif relay.answer.done() and now - relay.said >= KEEPALIVE_S:
                    with contextlib.suppress(TransportError, topics.TopicError):
                        self._to_device(relay, Ping(sid=relay.sid))

    def _record(self, write: Any) -> None:
        try:
            write()
        except StoreError as exc:
            log.error("the session record was not written: %s", exc)


def _with_sid(frame: Frame, sid: str) -> Frame:
    """The operator's frame, under the session's id whatever it said."""
    return frame if getattr(frame, "sid", sid) == sid else msgspec.structs.replace(frame, sid=sid)  # type: ignore[type-var]


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid:{uid}"


async def remote_part(leader: LeaderAgent, env: GatewayEnv) -> RemoteRelay | None:
    """The operator socket and the sessions' relay; None when no operator has a right to any."""
    settings = leader.config.remote
    if not settings.shell_operators and not settings.forward_operators and not settings.logs_operators:
        return None
    return RemoteRelay(leader, SessionLog.open(leader.shared, clock=leader.clock), settings)


__all__ = ["RemoteRelay", "remote_part"]
