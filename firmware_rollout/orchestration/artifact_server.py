"""The leader's artifact HTTP server: its content-addressed store over HTTP/1.1 range requests.

    GET /artifacts/{image sha256, 64 hex}.eafw     Range: bytes=START-END   ->  206, the bytes
    HEAD ...                                                                 ->  200, the size

A device fetches the chunks it lacks with one range request per run of chunks and checks every
chunk against its signed manifest, so this server is not trusted with anything: it serves the
leader's verified copies and nothing else (no directory listing, no other path, GET and HEAD
only, one range per request).

It keeps the seed's bound: at most `max_downloads` requests are answered at once; beyond that
it answers `503` with `Retry-After`, which a device treats exactly as a ConfigServer's `busy`
(AIMD halves its window, it backs off at least that long). Connections are bounded too
(`max_connections`; beyond, `503` and close), a request head must arrive within
`header_timeout_s` and fit `MAX_HEAD` bytes, and an idle keep-alive connection is closed after
`idle_timeout_s`. Bodies go out with `sendfile(2)` on plain TCP (the kernel copies; under uvloop,
which has no `loop.sendfile`, through a duplicate of the socket's descriptor) and in 1 MiB blocks
through the TLS layer: a small fraction of the leader's CPU per GB that MQTT chunks cost
(`scripts/bench_delta.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

MAX_HEAD = 8 * 1024  # request line and headers
COPY_BLOCK = 1024 * 1024  # where the loop cannot sendfile
MAX_HEADERS = 32
PATH_RE = re.compile(r"^/artifacts/([0-9a-f]{64})\.eafw$")
RANGE_RE = re.compile(r"^bytes=(\d{1,19})-(\d{0,19})$")

#: image sha256 (hex) -> the store's verified copy of its artifact, or None
ArtifactByImage = Callable[[str], Path | None]


@dataclass
class ServerStats:
    requests: int = 0
    served: int = 0  # 200 and 206 answers
    bytes_served: int = 0
    busy: int = 0  # 503 answers for the concurrency or connection bound
    refused: int = 0  # 4xx answers
    in_flight: int = 0
    max_concurrent: int = 0
    connections: int = 0


class _BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


_REASONS = {200: "OK", 206: "Partial Content", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 416: "Range Not Satisfiable", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}


class ArtifactServer:
    """Serves `lookup`'s artifacts on `host:port` (port 0: any free one, see `port`)."""

    def __init__(self, lookup: ArtifactByImage, *, host: str = "0.0.0.0", port: int = 8093,
                 max_downloads: int = 32, max_connections: int = 0, retry_after_s: int = 2,
                 tls: ssl.SSLContext | None = None, header_timeout_s: float = 10.0,
                 idle_timeout_s: float = 30.0, send_timeout_s: float = 300.0) -> None:
        if max_downloads < 1:
            raise ValueError("max_downloads must be at least 1")
        self._lookup = lookup
        self._host = host
        self._port = port
        self.max_downloads = max_downloads
        self.max_connections = max_connections or 4 * max_downloads
        self.retry_after_s = max(1, retry_after_s)
        self._tls = tls
        self._header_timeout_s = header_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._send_timeout_s = send_timeout_s
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.stats = ServerStats()

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets, "not started"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, self._host, self._port, ssl=self._tls,
                                                  limit=MAX_HEAD, reuse_address=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._handlers):
                task.cancel()
            for task in list(self._handlers):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    # -- one connection ------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.stats.connections += 1
        try:
            if self.stats.connections > self.max_connections:
                self.stats.busy += 1
                await self._answer(writer, 503, f"more than {self.max_connections} connections", close=True,
                                   extra=f"Retry-After: {self.retry_after_s}\r\n")
                return
            await self._serve(reader, writer)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError, OSError):
            pass  # the peer went away or stalled: nothing to answer
        finally:
            self.stats.connections -= 1
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        while True:
            try:
                head = await asyncio.wait_for(self._read_head(reader),
                                              self._header_timeout_s if first else self._idle_timeout_s)
            except TimeoutError:
                return
            except _BadRequest as exc:
                self.stats.requests += 1
                await self._answer(writer, exc.status, str(exc), close=True)
                return
            if head is None:
                return
            first = False
            self.stats.requests += 1
            try:
                method, path, headers = _parse_head(head)
                keep = headers.get("connection", "").lower() != "close"
                await self._respond(writer, method, path, headers, keep)
            except _BadRequest as exc:
                await self._answer(writer, exc.status, str(exc), close=True)
                return
            if not keep:
                return

    async def _read_head(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            return await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _BadRequest(431, f"request head over {MAX_HEAD} bytes") from None
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise _BadRequest(400, "request head cut short") from None
            return None

    async def _respond(self, writer: asyncio.StreamWriter, method: str, path: str, headers: dict[str, str],
                       keep: bool) -> None:
        if method not in ("GET", "HEAD"):
            raise _BadRequest(405, f"method {method} not allowed")
        match = PATH_RE.match(path)
        if match is None:
            await self._answer(writer, 404, "no such artifact", close=not keep)
            return
        artifact = self._lookup(match.group(1))
        if artifact is None:
            await self._answer(writer, 404, "no such artifact", close=not keep)
            return
        if self.stats.in_flight >= self.max_downloads:
            self.stats.busy += 1
            await self._answer(writer, 503, f"{self.max_downloads} downloads at once", close=not keep,
                               extra=f"Retry-After: {self.retry_after_s}\r\n")
            return
        self.stats.in_flight += 1
        self.stats.max_concurrent = max(self.stats.max_concurrent, self.stats.in_flight)
        try:
            await self._send_file(writer, method, artifact, headers.get("range"), keep)
        finally:
            self.stats.in_flight -= 1

    async def _send_file(self, writer: asyncio.StreamWriter, method: str, artifact: Path, range_: str | None,
                         keep: bool) -> None:
        try:
            handle = artifact.open("rb")
        except OSError:
            await self._answer(writer, 404, "no such artifact", close=not keep)
            return
        with handle:
            size = os.fstat(handle.fileno()).st_size
            start, end, status = 0, size, 200
            if range_ is not None:
                parsed = RANGE_RE.match(range_.strip())
                if parsed is None:
                    raise _BadRequest(400, "one range of the form bytes=START-END")
                start = int(parsed.group(1))
                end = min(size, int(parsed.group(2)) + 1) if parsed.group(2) else size
                if start >= size or end <= start:
                    await self._answer(writer, 416, "range outside the artifact", close=not keep,
                                       extra=f"Content-Range: bytes */{size}\r\n")
                    return
                status = 206
            length = end - start
            lines = [f"HTTP/1.1 {status} {_REASONS[status]}", "Content-Type: application/octet-stream",
                     f"Content-Length: {length}", "Accept-Ranges: bytes", "Cache-Control: public, max-age=31536000,"
                     " immutable"]
            if status == 206:
                lines.append(f"Content-Range: bytes {start}-{end - 1}/{size}")
            if not keep:
                lines.append("Connection: close")
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("ascii"))
            if method == "HEAD":
                await writer.drain()
                return
            await asyncio.wait_for(self._body(writer, handle, start, length), self._send_timeout_s)
            self.stats.served += 1
            self.stats.bytes_served += length

    async def _body(self, writer: asyncio.StreamWriter, handle: BinaryIO, start: int, length: int) -> None:
        await writer.drain()
        if self._tls is None and writer.get_extra_info("socket") is not None:
            try:  # the kernel copies the file
                await asyncio.get_running_loop().sendfile(writer.transport, handle, start, length, fallback=False)
                return
            except NotImplementedError:  # uvloop has no loop.sendfile
                await _sendfile_beside(writer, handle, start, length)
                return
        handle.seek(start)  # through TLS: read and write it
        left = length
        while left:
            block = handle.read(min(COPY_BLOCK, left))
            if not block:
                raise ConnectionError("the artifact shrank while it was served")
            writer.write(block)
            left -= len(block)
            await writer.drain()

    async def _answer(self, writer: asyncio.StreamWriter, status: int, reason: str, *, close: bool,
                      extra: str = "") -> None:
        body = (reason + "\n").encode()
        if status >= 400 and status != 503:
            self.stats.refused += 1
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: text/plain\r\n"
                f"Content-Length: {len(body)}\r\n{extra}" + ("Connection: close\r\n" if close else "") + "\r\n")
        writer.write(head.encode("ascii") + body)
        await writer.drain()


async def _sendfile_beside(writer: asyncio.StreamWriter, handle: BinaryIO, start: int, length: int) -> None:
    """`sendfile(2)` of `length` bytes at `start` to the connection's socket, through a duplicate
    of its descriptor (the transport keeps the original and has nothing buffered: drained), waiting
    for the socket to take more with `add_writer` on the duplicate: a loop without `loop.sendfile`
    (uvloop) still lets the kernel copy."""
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
                raise ConnectionError("the artifact ended early or the peer went away")
            if sent > 0:
                offset += sent
                left -= sent
                continue
            writable: asyncio.Future[None] = loop.create_future()

            def ready(waiter: asyncio.Future[None] = writable) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            loop.add_writer(fd, ready)
            try:
                await writable
            finally:
                loop.remove_writer(fd)
    finally:
        os.close(fd)


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise _BadRequest(400, "request head is not ASCII") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequest(400, "bad request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "bad header line")
        if len(headers) >= MAX_HEADERS:
            raise _BadRequest(431, f"more than {MAX_HEADERS} headers")
        headers[name.lower()] = value.strip()
    if parts[2] == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
        headers["connection"] = "close"
    return parts[0], parts[1].split("?", 1)[0], headers


__all__ = ["ArtifactByImage", "ArtifactServer", "ServerStats"]
