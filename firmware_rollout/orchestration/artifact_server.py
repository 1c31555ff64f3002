"""The leader's artifact HTTP server: its content-addressed store over HTTP/1.1 range requests.

    GET /artifacts/{image sha256, 64 hex}.eafw     Range: bytes=START-END   ->  206, the bytes
    GET /artifacts/{bundle sha256, 64 hex}.eaapp   (an application bundle, the same way)
    HEAD ...                                                                 ->  200, the size

A device fetches the chunks it lacks with one range request per run of chunks and checks every
chunk against its signed manifest, so this server is not trusted with anything: it serves the
leader's verified copies and nothing else (no directory listing, no other path, GET and HEAD
only, one range per request).

It keeps the seed's bound: at most `max_downloads` requests are answered at once, and at most
`max_downloads_per_peer` for one address; beyond that it answers `503` with `Retry-After`,
which a device treats exactly as a ConfigServer's `busy` (AIMD halves its window, it backs off
at least that long). The product's HTTP layer (`agent.service.http`) bounds the rest:
connections (`max_connections`, per address twice its downloads and at least 8; idle ones make
room for new ones, else `503`), a request head within `header_timeout_s` and `MAX_HEAD` bytes, an idle
keep-alive connection closed after `idle_timeout_s`, a body sent within `send_timeout_s` and at
`min_rate_bps` at least: a client that does not read gives its download slot back in seconds.
With `tls` that requires client certificates (`[artifacts] client_ca`), only devices holding a
certificate of the fleet's CA get past the handshake. Bodies
go out with `sendfile(2)` on plain TCP (the kernel copies) and in 1 MiB blocks through TLS: a
small fraction of the leader's CPU per GB that MQTT chunks cost (`scripts/bench_delta.py`).
"""

from __future__ import annotations

import asyncio
import os
import re
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.service.http import FileRange, HttpServer, Limits, Request, Response, text

MAX_HEAD = 8 * 1024  # request line and headers
MAX_HEADERS = 32
MAX_BODY = 64 * 1024  # a request needs none; a small one is read and its method refused (405)
PATH_RE = re.compile(r"^/artifacts/([0-9a-f]{64}\.(?:eafw|eaapp))$")
RANGE_RE = re.compile(r"^bytes=(\d{1,19})-(\d{0,19})$")

#: "{image sha256 hex}.eafw" or "{bundle sha256 hex}.eaapp" -> the store's verified copy, or None
ArtifactByImage = Callable[[str], Path | None]


@dataclass
class ServerStats:
    requests: int = 0
    served: int = 0  # 200 and 206 answers
    bytes_served: int = 0
    busy: int = 0  # 503 answers for the concurrency or connection bound
    slow: int = 0  # downloads ended below the minimum rate
    refused: int = 0  # 4xx answers
    in_flight: int = 0
    max_concurrent: int = 0
    connections: int = 0


class ArtifactServer:
    """Serves `lookup`'s artifacts on `host:port` (port 0: any free one, see `port`)."""

    def __init__(self, lookup: ArtifactByImage, *, host: str = "127.0.0.1", port: int = 8093,
                 max_downloads: int = 32, max_downloads_per_peer: int = 0, max_connections: int = 0,
                 retry_after_s: int = 2, tls: ssl.SSLContext | None = None, header_timeout_s: float = 10.0,
                 idle_timeout_s: float = 30.0, send_timeout_s: float = 300.0, min_rate_bps: int = 8 * 1024,
                 stall_grace_s: float = 10.0) -> None:
        if max_downloads < 1:
            raise ValueError("max_downloads must be at least 1")
        self._lookup = lookup
        self._host = host
        self._port = port
        self.max_downloads = max_downloads
        self.max_downloads_per_peer = max_downloads_per_peer or max(1, max_downloads // 4)
        self._downloads: Counter[str] = Counter()  # address -> downloads under way
        self.max_connections = max_connections or 4 * max_downloads
        self.retry_after_s = max(1, retry_after_s)
        self._tls = tls
        self._http = HttpServer(self._handle, name="artifact server", limits=Limits(
            max_head_bytes=MAX_HEAD, max_headers=MAX_HEADERS, max_body_bytes=MAX_BODY, head_timeout_s=header_timeout_s,
            idle_timeout_s=idle_timeout_s, send_timeout_s=send_timeout_s, max_connections=self.max_connections,
            # room for a device's keep-alive pool and for the 503s of its downloads beyond its share
            max_per_peer=min(self.max_connections, max(8, 2 * self.max_downloads_per_peer)),
            min_send_bps=min_rate_bps, send_grace_s=stall_grace_s))
        self._server: asyncio.Server | None = None
        self._stats = ServerStats()

    @property
    def stats(self) -> ServerStats:
        """What it answered, with the HTTP layer's part (requests, bounds, refusals) in."""
        layer = self._http.stats
        own = self._stats
        return ServerStats(requests=layer.requests, served=own.served, bytes_served=own.bytes_served,
                           busy=own.busy + layer.busy, slow=layer.slow, refused=own.refused + layer.bad_requests,
                           in_flight=own.in_flight, max_concurrent=own.max_concurrent, connections=layer.connections)

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets, "not started"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._http.connection, self._host, self._port, ssl=self._tls,
                                                  reuse_address=True, backlog=self._http.backlog)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._http.close()
            await self._server.wait_closed()
            self._server = None

    # -- one request ---------------------------------------------------------------------------
    async def _handle(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return self._refuse(405, f"method {request.method} not allowed", headers=(("Allow", "GET, HEAD"),))
        match = PATH_RE.match(request.path)
        artifact = self._lookup(match.group(1)) if match is not None else None
        if artifact is None:
            return self._refuse(404, "no such artifact")
        stats = self._stats
        if stats.in_flight >= self.max_downloads:
            stats.busy += 1
            return text(503, f"{self.max_downloads} downloads at once",
                        headers=(("Retry-After", str(self.retry_after_s)),))
        peer = request.peer
        if self._downloads[peer] >= self.max_downloads_per_peer:
            stats.busy += 1
            return text(503, f"{self.max_downloads_per_peer} downloads at once from one address",
                        headers=(("Retry-After", str(self.retry_after_s)),))
        try:
            handle = artifact.open("rb")
        except OSError:
            return self._refuse(404, "no such artifact")
        size = os.fstat(handle.fileno()).st_size
        start, end, status = 0, size, 200
        range_ = request.headers.get("range")
        if range_ is not None:
            parsed = RANGE_RE.match(range_.strip())
            if parsed is None:
                handle.close()
                return self._refuse(400, "one range of the form bytes=START-END", close=True)
            start = int(parsed.group(1))
            end = min(size, int(parsed.group(2)) + 1) if parsed.group(2) else size
            if start >= size or end <= start:
                handle.close()
                return self._refuse(416, "range outside the artifact", headers=(("Content-Range", f"bytes */{size}"),))
            status = 206
        headers = [("Accept-Ranges", "bytes"), ("Cache-Control", "public, max-age=31536000, immutable")]
        if status == 206:
            headers.append(("Content-Range", f"bytes {start}-{end - 1}/{size}"))
        stats.in_flight += 1
        self._downloads[peer] += 1
        stats.max_concurrent = max(stats.max_concurrent, stats.in_flight)
        length = end - start
        head_only = request.method == "HEAD"

        def sent(whole: bool) -> None:
            handle.close()
            stats.in_flight -= 1
            self._downloads[peer] -= 1
            if not self._downloads[peer]:
                del self._downloads[peer]
            if whole and not head_only:
                stats.served += 1
                stats.bytes_served += length

        return Response(status, content_type="application/octet-stream", headers=headers,
                        file=FileRange(handle, start, length), sent=sent)

    def _refuse(self, status: int, reason: str, *, headers: tuple[tuple[str, str], ...] = (),
                close: bool = False) -> Response:
        self._stats.refused += 1
        return text(status, reason, headers=headers, close=close)


__all__ = ["ArtifactByImage", "ArtifactServer", "ServerStats"]
