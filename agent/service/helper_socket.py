"""A root helper's Unix socket: framed requests of the agent, answered one by one.

A device's root helpers (the firmware install helper, the application helper) each keep the
agent unprivileged: they run as root behind a socket, check what they are asked, and answer. This
is their shared transport, the same both ways:

    frame     a 4-byte big-endian length, then the payload (msgpack of the helper's own types)

`HelperSocketServer` takes connections on a listening socket: only root and the allowed uids (the
agent's) may ask, a refused peer reads the reason as the answer to its first request, at most
`MAX_PER_PEER` connections per uid (a newcomer at the bound closes that uid's longest-idle one, so
idle connections cannot lock the agent out), a connection idle for `IDLE_TIMEOUT_S` is closed,
and a request over `max_frame` bytes ends the connection. `HelperConnection` is the agent's side:
one kept connection, a request resent once on a new connection when the helper closed the kept
one meanwhile (each helper's steps are idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.core.clock import SystemClock
from agent.core.errors import EdgeAgentError
from agent.core.peercred import peer_credentials
from agent.core.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

LENGTH = struct.Struct(">I")
MAX_PER_PEER = 4  # connections per uid: the agent needs one
IDLE_TIMEOUT_S = 60.0  # a connection that sends no request for this long is closed (the agent reconnects)
FRAME_TIMEOUT_S = 30.0  # the rest of a request, once its first bytes came


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


def stranger(uid: int, allowed_uids: frozenset[int], *, helper: str) -> str:
    """Why `uid` may not ask the helper at all ("" when it may: root, or an allowed uid)."""
    if allowed_uids and uid != 0 and uid not in allowed_uids:
        return f"refused: uid {uid} is not the agent's user: only it and root may ask the {helper}"
    return ""


async def answer_refusal(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: bytes,
                         max_frame: int) -> None:
    """`reply` as the answer to the peer's first request (read first, so its client reads the
    answer instead of a reset)."""
    with contextlib.suppress(asyncio.IncompleteReadError, TimeoutError):
        head = await asyncio.wait_for(reader.readexactly(LENGTH.size), FRAME_TIMEOUT_S)
        (length,) = LENGTH.unpack(head)
        if length <= max_frame:
            await asyncio.wait_for(reader.readexactly(length), FRAME_TIMEOUT_S)
    writer.write(frame(reply))
    await writer.drain()


@dataclass(eq=False)
class _Peer:
    """One open connection: whose it is, and whether a request of it is being read or run."""

    uid: int
    writer: asyncio.StreamWriter
    busy: bool = False
    since: float = field(default_factory=time.monotonic)


class HelperSocketServer:
    """The connections of one helper: `handle(payload, uid)` answers each request of the peer
    running as `uid` (an encoded reply), `refusal(reason)` encodes a refusal in the helper's own
    reply type."""

    def __init__(self, handle: Callable[[bytes, int], Awaitable[bytes]], refusal: Callable[[str], bytes], *,
                 helper: str, max_frame: int, allowed_uids: frozenset[int] = frozenset()) -> None:
        self._handle = handle
        self._refusal = refusal
        self.helper = helper
        self.max_frame = max_frame
        self.allowed_uids = allowed_uids
        self._peers: set[_Peer] = set()
        self._refusals = RateLimitedLog(log, SystemClock(), interval_s=60.0)
        self.refused = 0
        self.evicted = 0

    async def serve(self, sock: socket.socket) -> None:
        server = await asyncio.start_unix_server(self._connection, sock=sock)
        async with server:
            await server.serve_forever()

    def _admit(self, uid: int) -> str:
        """Why a connection of `uid` is refused ("" when it is taken)."""
        refusal = stranger(uid, self.allowed_uids, helper=self.helper)
        if refusal:
            return refusal
        mine = [p for p in self._peers if p.uid == uid]
        if len(mine) < MAX_PER_PEER:
            return ""
        idle = [p for p in mine if not p.busy]
        if not idle:
            return f"refused: uid {uid} has {MAX_PER_PEER} connections with requests under way"
        oldest = min(idle, key=lambda p: p.since)
        self._peers.discard(oldest)
        self.evicted += 1
        oldest.writer.transport.abort()  # its task sees the connection end
        return ""

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer: _Peer | None = None
        try:
            pid, uid, _gid = peer_credentials(writer.get_extra_info("socket"))
            refusal = self._admit(uid)
            if refusal:
                self.refused += 1
                self._refusals.warning(f"uid-{uid}", f"{self.helper}: {refusal} (pid {pid})")
                await answer_refusal(reader, writer, self._refusal(refusal), self.max_frame)
                return
            peer = _Peer(uid, writer)
            self._peers.add(peer)
            while True:
                peer.busy, peer.since = False, time.monotonic()
                try:
                    head = await asyncio.wait_for(reader.readexactly(LENGTH.size), IDLE_TIMEOUT_S)
                except (asyncio.IncompleteReadError, TimeoutError):
                    return
                peer.busy = True
                (length,) = LENGTH.unpack(head)
                if length > self.max_frame:
                    writer.write(frame(self._refusal(f"request of {length} bytes is over the {self.max_frame} limit")))
                    await writer.drain()
                    return
                reply = await self._handle(await asyncio.wait_for(reader.readexactly(length), FRAME_TIMEOUT_S), uid)
                writer.write(frame(reply))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            return
        finally:
            if peer is not None:
                self._peers.discard(peer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def serve_unavailable(sock: socket.socket, reply: bytes, *, helper: str, refusal: Callable[[str], bytes],
                            max_frame: int, allowed_uids: frozenset[int], linger_s: float) -> None:
    """The helper cannot do its work (a service not answering yet, a device missing): every
    request of the agent is answered with `reply` for `linger_s`, then this returns. The agent
    logs the real cause instead of a refused connection, and the next request after the helper
    ended starts it again (socket activation) and tries afresh."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            _pid, uid, _gid = peer_credentials(writer.get_extra_info("socket"))
            why = stranger(uid, allowed_uids, helper=helper)
            await answer_refusal(reader, writer, refusal(why) if why else reply, max_frame)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(answer, sock=sock)
    async with server:
        await asyncio.sleep(linger_s)


class HelperClosed(Exception):
    """The helper closed the connection before answering."""


class HelperUnreachable(EdgeAgentError):
    """The helper's socket cannot be opened, or it answered something unreadable."""


class HelperConnection:
    """The agent's side of a helper: blocking calls on one kept connection (run them in a thread)."""

    def __init__(self, path: str | Path, *, helper: str, max_frame: int, timeout_s: float,
                 hint: Callable[[OSError], str]) -> None:
        self.path = str(path)
        self.helper = helper
        self.max_frame = max_frame
        self.timeout_s = timeout_s
        self._hint = hint
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise HelperUnreachable(f"the {self.helper} at {self.path} does not answer "
                                        f"({exc.strerror or exc}): {self._hint(exc)}") from None
            self._sock = sock
        return self._sock

    def call(self, payload: bytes, *, timeout_s: float | None = None) -> bytes:
        """One request and its reply. A kept connection the helper closed meanwhile (idle, or to
        make room) is opened again and the request sent once more."""
        reused = self._sock is not None
        try:
            return self.exchange(payload, timeout_s)
        except HelperClosed as exc:
            if not reused:
                raise HelperUnreachable(f"{self.helper} at {self.path}: {exc}") from None
            try:
                return self.exchange(payload, timeout_s)
            except HelperClosed as again:
                raise HelperUnreachable(f"{self.helper} at {self.path}: {again}") from None

    def exchange(self, payload: bytes, timeout_s: float | None) -> bytes:
        """One request and its reply on the kept connection; `HelperClosed` when the helper ended
        it before answering (the connection is dropped either way on an error)."""
        sock = self._connect()
        try:
            sock.settimeout(timeout_s or self.timeout_s)
            try:
                sock.sendall(frame(payload))
                head = self._recv_exact(sock, LENGTH.size)
            except (BrokenPipeError, ConnectionResetError, HelperClosed) as exc:
                raise HelperClosed(str(exc) or f"the {self.helper} closed the connection") from None
            (length,) = LENGTH.unpack(head)
            if length > self.max_frame:
                raise HelperUnreachable(f"the {self.helper} answered {length} bytes")
            return self._recv_exact(sock, length)
        except HelperClosed:
            self.close()
            raise
        except (OSError, HelperUnreachable) as exc:
            self.close()
            raise HelperUnreachable(f"{self.helper} at {self.path}: {exc}") from None

    def _recv_exact(self, sock: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = sock.recv(n - len(buf))
            if not part:
                raise HelperClosed(f"the {self.helper} closed the connection")
            buf += part
        return bytes(buf)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


def listening_socket(path: str | Path | None) -> socket.socket | None:
    """systemd's socket (LISTEN_FDS, fd 3) when activated by it, else a new one bound at `path`
    (mode 0660: the group decides who may ask); None when neither."""
    if os.environ.get("LISTEN_PID") == str(os.getpid()) and int(os.environ.get("LISTEN_FDS", "0")) >= 1:
        return socket.socket(fileno=3)
    if path is None:
        return None
    target = Path(path)
    with contextlib.suppress(FileNotFoundError):
        target.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(target))
    os.chmod(target, 0o660)
    sock.listen(8)
    return sock


__all__ = ["FRAME_TIMEOUT_S", "IDLE_TIMEOUT_S", "LENGTH", "MAX_PER_PEER", "HelperClosed", "HelperConnection",
           "HelperSocketServer", "HelperUnreachable", "frame", "listening_socket", "serve_unavailable"]
