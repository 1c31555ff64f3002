"""One HTTP/1.1 layer for every server of the product: the health endpoint, the local API, the
artifact server and the console. h11 parses and frames (bytes in, events out); this module owns
the sockets, the limits and the timeouts, so each server is a handler and nothing else:

    server = HttpServer(handler, limits=Limits(max_body_bytes=4096), name="console")
    await asyncio.start_server(server.connection, host, port, backlog=server.backlog)

    async def handler(request: Request) -> Response: ...

Limits, one set per server (`Limits`):

    head        `max_head_bytes` for the request line and headers (431), at most `max_headers`
                headers (431), all within `head_timeout_s` of the first byte (408)
    body        a Content-Length over `max_body_bytes` is answered 413 before a byte of it is
                read; a chunked body is 411 unless `chunked_bodies` (then counted as it comes);
                the whole body within `body_timeout_s`. A server that takes uploads says which
                requests may send a large body (`Spool`, asked with the head, before a byte of
                the body is read): that body goes to a file (`Request.body_file`, removed when
                the handler returns), at most the size the spool allows, each read within
                `body_timeout_s`
    idle        a connection waiting for its first request, or for the next one on a kept-alive
                connection, is closed after `idle_timeout_s` (the first: `head_timeout_s`)
    connections at most `max_connections` at once and `max_per_peer` from one peer (its
                uid on a Unix socket, its address on TCP); when a new one comes at a bound, the
                connection that has waited longest without sending a byte (at least
                `evict_after_s`: a new client's request may be on its way) is closed to make
                room (at the peer's bound: one of that peer's; at the total: one of the peer
                holding most), and only when there is none is the newcomer answered 503: one
                client opening idle or slow connections cannot lock the others out. (A
                kept-alive connection between two requests is not closed for it: its client
                may be sending its next request right then; `idle_timeout_s` ends it.)
    sending     every response within `send_timeout_s`; a file body also at `min_send_bps`
                at least in every window of `send_grace_s` (`Pace`): a client that stops
                reading gives its slot back in seconds, not at the timeout

A malformed request is answered with its 4xx and the connection closed; a peer that goes away is
nothing to answer. Neither is logged with a traceback; a handler's own failure is a 500 and one
rate-limited line. A file body (`FileRange`) goes out with `sendfile(2)` on plain sockets (under
uvloop, which has no `loop.sendfile`, through a duplicate of the socket's descriptor) and in
1 MiB blocks through TLS. h11 is imported with the first connection: an agent nobody asks
anything loads none of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import logging
import os
import socket
import ssl
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast
from urllib.parse import parse_qs, unquote, urlsplit

from agent.core.peercred import peer_credentials

if TYPE_CHECKING:
    import h11

log = logging.getLogger(__name__)

COPY_BLOCK = 1024 * 1024  # where the loop cannot sendfile
READ_BLOCK = 64 * 1024
SPOOL_BLOCK = 256 * 1024  # reads of a body going to a file
ERROR_LOG_INTERVAL_S = 60.0
LINGER_S, LINGER_BYTES = 1.0, 64 * 1024  # how long and how much a refused connection is read before it closes
NO_CHUNKED = "send a Content-Length (no Transfer-Encoding is taken)"


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_head_bytes: int = 16 * 1024
    max_headers: int = 64
    max_body_bytes: int = 0  # 0: no request body is taken
    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 30.0
    send_timeout_s: float = 60.0
    max_connections: int = 32
    keep_alive: bool = True  # False: one request per connection
    chunked_bodies: bool = False
    evict_after_s: float = 1.0  # a connection this long without a byte may make room for a new one
    max_per_peer: int = 0  # connections from one uid or address; 0: a quarter of max_connections (at least 1)
    min_send_bps: int = 0  # a file body slower than this (bytes a second) is ended; 0: only send_timeout_s
    send_grace_s: float = 10.0  # the window that rate is measured over

    @property
    def per_peer(self) -> int:
        return self.max_per_peer or max(1, self.max_connections // 4)


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str
    path: str  # percent-decoded, without the query
    query: dict[str, list[str]]
    headers: dict[str, str]  # names in lower case; a repeated header: its last value
    body: bytes
    peer: str = ""  # `peer_of` its connection
    body_file: Path | None = None  # a spooled body (`Spool`): removed when the handler returns


@dataclass(frozen=True, slots=True)
class FileRange:
    """`length` bytes of an open file from `start`: a response body sent by the kernel."""

    handle: BinaryIO
    start: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: Sequence[tuple[str, str]] = ()
    file: FileRange | None = None  # instead of `body`
    close: bool = False  # close the connection after this response
    # told whether the response went out whole (a file body: the download's own bookkeeping)
    sent: Callable[[bool], None] | None = None


def text(status: int, message: str, *, headers: Sequence[tuple[str, str]] = (), close: bool = False) -> Response:
    return Response(status, (message + "\n").encode(), headers=headers, close=close)


Handler = Callable[[Request], Awaitable[Response]]
#: Decides on a new connection before anything is read: None admits it, a Response refuses it.
Admit = Callable[[asyncio.StreamWriter], Response | None]
#: How a server words the refusals this layer makes (status, reason): text by default.
Refusal = Callable[[int, str], Response]
#: Asked with a request's head (its body `b""`, not read yet): where its body may be written and
#: how large it may be, or None (the body is held in memory within `max_body_bytes`); it raises
#: `RefuseBody` to answer the request before a byte of its body is read.
Spool = Callable[[Request], "tuple[Path, int] | None"]


@dataclass
class HttpStats:
    connections: int = 0  # open now
    requests: int = 0
    bad_requests: int = 0  # answered 4xx by this layer (malformed, too large, too slow)
    busy: int = 0  # answered 503 at the connection bound
    evicted: int = 0  # idle connections closed to make room for a new one
    peer_busy: int = 0  # of `busy`: answered 503 at the bound of one peer
    slow: int = 0  # file bodies ended below the minimum rate
    errors: int = 0  # handlers that raised (answered 500)


@dataclass(eq=False)
class _Slot:
    writer: asyncio.StreamWriter
    peer: str  # `peer_of`
    idle: bool = True  # no byte of the next request yet
    fresh: bool = True  # no request yet: evictable while idle
    since: float = field(default_factory=time.monotonic)
    fed: int = 0  # bytes handed to h11 since this request began


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class RefuseBody(_Refused):
    """Raised by a `Spool`: the request is answered `status` with `reason` (and its connection
    closed) before its body is read."""


class HttpServer:
    def __init__(self, handler: Handler, *, limits: Limits, name: str, admit: Admit | None = None,
                 refusal: Refusal = text, spool: Spool | None = None) -> None:
        self._handler = handler
        self._spool = spool
        self.limits = limits
        self.name = name
        self._admit = admit
        self._refusal = refusal
        self._slots: set[_Slot] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._last_error_log = -ERROR_LOG_INTERVAL_S
        self.stats = HttpStats()

    @property
    def backlog(self) -> int:
        """The listen backlog to give the socket: a burst of connections queues instead of
        being refused by the kernel, and this layer answers each."""
        return max(128, 2 * self.limits.max_connections)

    async def close(self) -> None:
        """End every connection (after the listening socket was closed)."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- one connection ------------------------------------------------------------------------
    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The `client_connected_cb` of `asyncio.start_server` / `start_unix_server`."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        slot: _Slot | None = None
        try:
            refusal = self._admit(writer) if self._admit is not None else None
            if refusal is not None:
                await self._send_alone(reader, writer, refusal)
                return
            peer = peer_of(writer)
            busy = self._no_room(peer)
            if busy:
                self.stats.busy += 1
                refusal = self._refusal(503, busy)
                refusal.headers = (*refusal.headers, ("Retry-After", "1"))
                await self._send_alone(reader, writer, refusal)
                return
            slot = _Slot(writer, peer)
            self._slots.add(slot)
            self.stats.connections = len(self._slots)
            await self._serve(reader, writer, slot)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError, OSError):
            pass  # the peer went away or stalled: nothing to answer
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # ended by `close`: the task ends as done, not cancelled, so asyncio's stream
            # callback (3.11) does not log the cancellation as an error
        except Exception:
            self._log_error("connection failed")
        finally:
            if slot is not None:
                self._slots.discard(slot)
                self.stats.connections = len(self._slots)
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _no_room(self, peer: str) -> str:
        """Why a new connection of `peer` finds no room ("" when it has one, maybe made by
        closing an idle connection)."""
        lim = self.limits
        mine = [s for s in self._slots if s.peer == peer]
        if len(mine) >= lim.per_peer and not self._evict_idle(mine):
            self.stats.peer_busy += 1
            return f"more than {lim.per_peer} connections from one client"
        if len(self._slots) >= lim.max_connections and not self._evict_idle(self._slots):
            return f"more than {lim.max_connections} connections"
        return ""

    def _evict_idle(self, among: Collection[_Slot]) -> bool:
        """Close the connection of `among` that has waited longest without a byte of a first
        request, of the peer holding most connections; False when there is none."""
        quiet_since = time.monotonic() - self.limits.evict_after_s
        idle = [s for s in among if s.idle and s.fresh and s.since <= quiet_since]
        if not idle:
            return False
        held = Counter(s.peer for s in self._slots)
        victim = min(idle, key=lambda s: (-held[s.peer], s.since))
        self._slots.discard(victim)
        self.stats.evicted += 1
        victim.writer.transport.abort()  # its task sees the connection end and cleans up
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: _Slot) -> None:
        import h11

        lim = self.limits
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=lim.max_head_bytes)
        first = True
        while True:
            slot.idle, slot.since, slot.fed = True, time.monotonic(), len(conn.trailing_data[0])
            try:
                event = await self._next(conn, reader, slot, idle_s=lim.head_timeout_s if first else lim.idle_timeout_s,
                                         busy_s=lim.head_timeout_s, block=lim.max_head_bytes)
                if event is None or isinstance(event, h11.ConnectionClosed):
                    return
                if not isinstance(event, h11.Request):
                    raise _Refused(400, "expected a request")
                if slot.fed - len(conn.trailing_data[0]) > lim.max_head_bytes:
                    raise _Refused(431, f"a request head over {lim.max_head_bytes} bytes")
                request = await self._request(conn, reader, slot, event)
            except TimeoutError:
                if not slot.idle:
                    await self._refuse(conn, writer, 408, "the request did not arrive in time")
                return
            except h11.RemoteProtocolError as exc:
                status, reason = exc.error_status_hint, str(exc) or "malformed request"
                if status == 501 and not lim.chunked_bodies:  # a transfer coding h11 does not know
                    status, reason = 411, NO_CHUNKED
                await self._refuse(conn, writer, status, reason)
                return
            except _Refused as exc:
                await self._refuse(conn, writer, exc.status, str(exc))
                return
            first = slot.fresh = False
            self.stats.requests += 1
            response = await self._answer(request)
            keep = lim.keep_alive and not response.close
            await self._send(conn, writer, response, head_only=request.method == "HEAD", keep=keep)
            if not keep or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _next(self, conn: h11.Connection, reader: asyncio.StreamReader, slot: _Slot, *, idle_s: float,
                    busy_s: float, block: int = READ_BLOCK) -> Any:
        """The next h11 event, reading `block` bytes at a time as it needs: within `idle_s` while
        no byte of it came, then within `busy_s` of the first one. None when the peer closed
        before a request."""
        import h11

        loop = asyncio.get_running_loop()
        deadline = loop.time() + (idle_s if slot.idle else busy_s)
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):  # (not wait_for: no task per read)
                data = await reader.read(block)
            if not data and slot.idle and conn.their_state is h11.IDLE:
                return None  # closed between requests: nothing to answer
            if slot.idle:
                slot.idle = False
                deadline = loop.time() + busy_s
            slot.fed += len(data)
            conn.receive_data(data)

    async def _request(self, conn: h11.Connection, reader: asyncio.StreamReader, slot: _Slot,
                       event: h11.Request) -> Request:
        import h11

        lim = self.limits
        if len(event.headers) > lim.max_headers:
            raise _Refused(431, f"more than {lim.max_headers} headers")
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
        if "transfer-encoding" in headers and not lim.chunked_bodies:
            raise _Refused(411, NO_CHUNKED)
        length_text = headers.get("content-length")
        target = event.target.decode("latin-1")
        url = urlsplit(target)
        head = Request(event.method.decode("latin-1"), target, unquote(url.path), parse_qs(url.query), headers,
                       b"", slot.peer)
        spool = self._spool(head) if self._spool is not None and length_text not in (None, "0") else None
        if spool is not None:
            return await self._spooled(conn, reader, slot, head, int(length_text or 0), *spool)
        if length_text is not None and int(length_text) > lim.max_body_bytes:
            raise _Refused(413, f"a body of {length_text} bytes, over {lim.max_body_bytes}")
        body = bytearray()
        while True:
            part = await self._next(conn, reader, slot, idle_s=lim.body_timeout_s, busy_s=lim.body_timeout_s)
            if part is None or isinstance(part, h11.ConnectionClosed):
                raise ConnectionError("closed in the middle of a request")
            if isinstance(part, h11.EndOfMessage):
                break
            if isinstance(part, h11.Data):
                body += part.data
                if len(body) > lim.max_body_bytes:
                    raise _Refused(413, f"a body over {lim.max_body_bytes} bytes")
        return dataclasses.replace(head, body=bytes(body))

    async def _spooled(self, conn: h11.Connection, reader: asyncio.StreamReader, slot: _Slot, head: Request,
                       length: int, directory: Path, most: int) -> Request:
        """`head` with its body written to a new file in `directory` (at most `most` bytes)."""
        import h11

        if length > most:
            raise _Refused(413, f"a body of {length} bytes, over {most}")
        fd, name = tempfile.mkstemp(dir=directory, prefix=".upload-", suffix=".part")
        path = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                while True:
                    part = await self._next(conn, reader, slot, idle_s=self.limits.body_timeout_s,
                                            busy_s=self.limits.body_timeout_s, block=SPOOL_BLOCK)
                    if part is None or isinstance(part, h11.ConnectionClosed):
                        raise ConnectionError("closed in the middle of a request")
                    if isinstance(part, h11.EndOfMessage):
                        break
                    if isinstance(part, h11.Data):
                        out.write(part.data)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return dataclasses.replace(head, body_file=path)

    async def _answer(self, request: Request) -> Response:
        try:
            return await self._handler(request)
        except Exception:
            self.stats.errors += 1
            self._log_error(f"{request.method} {request.path[:80]} failed")
            failed = self._refusal(500, "internal error")
            failed.close = True
            return failed
        finally:
            if request.body_file is not None:
                request.body_file.unlink(missing_ok=True)

    async def _refuse(self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int, reason: str) -> None:
        import h11

        self.stats.requests += 1
        self.stats.bad_requests += 1
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            refusal = self._refusal(status, reason)
            refusal.close = True
            with contextlib.suppress(h11.LocalProtocolError):
                await self._send(conn, writer, refusal, head_only=False, keep=False)

    async def _send_alone(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          response: Response) -> None:
        """A response before any request was read (a refused peer, the connection bound), then
        a lingering close: what the client sent meanwhile is read and dropped (a little, for a
        moment), so the kernel does not answer it with a reset that would destroy the response."""
        import h11

        conn = h11.Connection(h11.SERVER)
        conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # h11 answers requests only
        conn.next_event()
        response.close = True
        await self._send(conn, writer, response, head_only=False, keep=False)
        if writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_S):
                left = LINGER_BYTES
                while left > 0 and (data := await reader.read(left)):
                    left -= len(data)

    async def _send(self, conn: h11.Connection, writer: asyncio.StreamWriter, response: Response, *,
                    head_only: bool, keep: bool) -> None:
        import h11

        body: bytes | FileRange = response.file if response.file is not None else response.body
        headers = [("Content-Type", response.content_type), ("Content-Length", str(len(body))),
                   *response.headers]
        if not keep:
            headers.append(("Connection", "close"))
        ok = False
        try:
            writer.write(conn.send(h11.Response(status_code=response.status, headers=headers,
                                                reason=_reason(response.status))))
            if body and not head_only:
                if isinstance(body, FileRange):
                    async with asyncio.timeout(self.limits.send_timeout_s):
                        await self._send_file(conn, writer, body)
                else:
                    writer.write(conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            async with asyncio.timeout(self.limits.send_timeout_s):
                await writer.drain()
            ok = True
        finally:
            if response.sent is not None:
                response.sent(ok)

    async def _send_file(self, conn: h11.Connection, writer: asyncio.StreamWriter, body: FileRange) -> None:
        import h11

        # h11 frames what it is handed without reading it (its "passthrough"): the range comes
        # back as itself, for the kernel to send
        for piece in conn.send_with_data_passthrough(h11.Data(data=cast("bytes", body))) or ():
            if isinstance(piece, FileRange):
                await self._send_range(writer, piece)
            else:
                writer.write(piece)

    async def _send_range(self, writer: asyncio.StreamWriter, body: FileRange) -> None:
        """The range, at `min_send_bps` at least when that is set (`Pace`)."""
        lim = self.limits
        try:
            await send_file(writer, body, pace=Pace(lim.min_send_bps, lim.send_grace_s) if lim.min_send_bps else None)
        except TooSlow:
            self.stats.slow += 1
            raise

    def _log_error(self, what: str) -> None:
        """One line with the traceback at most once a minute: a client that makes a handler fail
        on purpose must not flood the journal."""
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.exception("%s: %s", self.name, what)


def peer_of(writer: asyncio.StreamWriter) -> str:
    """Who a connection is from, for the per-peer bound: `uid:N` on a Unix socket (its owner's
    processes are one client), the address on TCP (its ports are one client)."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        return f"uid:{peer_credentials(sock).uid}"
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class Pace:
    """A minimum sending rate: every window of `window_s` seconds must see `min_bps x window_s`
    bytes go out. Measured per window, not since the start: a client cannot bank the megabytes
    the kernel's buffers took at once and then stop reading."""

    def __init__(self, min_bps: int, window_s: float) -> None:
        self._need = min_bps * window_s
        self._window_s = window_s
        self._began = time.monotonic()
        self._sent = 0

    def sent(self, n: int) -> None:
        self._sent += n

    def wait_s(self) -> float:
        """How long the sender may wait for the socket now; `TooSlow` when a window ended short."""
        now = time.monotonic()
        if now - self._began >= self._window_s:
            if self._sent < self._need:
                raise TooSlow(f"{self._sent} bytes in {now - self._began:.1f}s, under the minimum rate")
            self._began, self._sent = now, 0
        return self._began + self._window_s - now


class TooSlow(TimeoutError):
    """A body went out below the minimum rate: its client stopped reading."""


async def send_file(writer: asyncio.StreamWriter, body: FileRange, *, pace: Pace | None = None) -> None:
    """Send a file range on the connection: the kernel copies it on a plain socket, blocks go
    through TLS; with `pace`, a client reading below its rate ends it (`TooSlow`)."""
    await writer.drain()
    if writer.get_extra_info("sslcontext") is None and writer.get_extra_info("socket") is not None:
        if pace is None:
            try:
                await asyncio.get_running_loop().sendfile(writer.transport, body.handle, body.start, body.length,
                                                          fallback=False)
                return
            except (NotImplementedError, asyncio.SendfileNotAvailableError):
                pass  # uvloop has no loop.sendfile; a first sendfile(2) that failed (the peer went away)
        await _sendfile_beside(writer, body.handle, body.start, body.length, pace)
        return
    body.handle.seek(body.start)
    left = body.length
    while left:
        block = body.handle.read(min(COPY_BLOCK, left))
        if not block:
            raise ConnectionError("the file shrank while it was sent")
        writer.write(block)
        left -= len(block)
        if pace is None:
            await writer.drain()
            continue
        while True:
            try:
                async with asyncio.timeout(pace.wait_s()):
                    await writer.drain()
                break
            except TooSlow:
                raise
            except TimeoutError:
                continue  # a window ended: `wait_s` judges it
        pace.sent(len(block))


async def _sendfile_beside(writer: asyncio.StreamWriter, handle: BinaryIO, start: int, length: int,
                           pace: Pace | None = None) -> None:
    """`sendfile(2)` of `length` bytes at `start` to the connection's socket, through a duplicate
    of its descriptor (the transport keeps the original and has nothing buffered: drained), waiting
    for the socket to take more with `add_writer` on the duplicate: a loop without `loop.sendfile`
    (uvloop) still lets the kernel copy, and every call's progress is seen (`pace`)."""
    loop = asyncio.get_running_loop()
    fd = os.dup(writer.get_extra_info("socket").fileno())
    try:
        offset, left = start, length
        while left:
            try:
                sent = os.sendfile(fd, handle.fileno(), offset, min(left, 1 << 30))
            except BlockingIOError:
                sent = -1
            if sent == 0:
                raise ConnectionError("the file ended early or the peer went away")
            if sent > 0:
                offset += sent
                left -= sent
                if pace is not None:
                    pace.sent(sent)
                continue
            writable: asyncio.Future[None] = loop.create_future()

            def ready(waiter: asyncio.Future[None] = writable) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            loop.add_writer(fd, ready)
            try:
                if pace is None:
                    await writable
                    continue
                while not writable.done():
                    try:
                        async with asyncio.timeout(pace.wait_s()):
                            await asyncio.shield(writable)
                    except TooSlow:
                        raise
                    except TimeoutError:
                        continue  # a window ended: `wait_s` judges it
            finally:
                loop.remove_writer(fd)
    finally:
        os.close(fd)


__all__ = ["Admit", "FileRange", "Handler", "HttpServer", "HttpStats", "Limits", "Pace", "Refusal", "Request",
           "RefuseBody", "Response", "Spool", "TooSlow", "peer_of", "send_file", "text"]
