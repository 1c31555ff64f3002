"""Chunks from an HTTP(S) mirror: the leader's artifact server, nginx, an S3 bucket, a CDN.

A mirror serves the artifact file as `{mirror}/{image sha256}.eafw`. `MirrorSource` reads its
header once (the image starts after the signed manifest), then fetches each run of consecutive
chunks the updater needs with one `Range` request and cuts the streamed body into chunks: one
request per run, not per chunk, so a delta with scattered chunks costs a request per gap and a
full download a request per `max_run_bytes`.

Nothing a mirror sends is trusted: `FallbackSource` checks every chunk against the signed
manifest. Answers map onto the updater's error kinds: `429`/`503` with `Retry-After` is
`Capacity` (the same as a ConfigServer's busy), a lost connection, a timeout or another `5xx` is
`Transient`, and `404`, `410`, `403`, a server that ignores ranges or a file of another size is
`Permanent` for that mirror.

httpx is imported here and only here, when an update with mirrors starts: an idle worker does
not load it. Chosen over aiohttp because it is pure Python (one wheel for every Pi, armv6 to
arm64, no C extension to build), streams a response body with bounded memory, pools keep-alive
connections per host, and does TLS with the system's CA store; its per-request overhead, higher
than aiohttp's, is paid once per run of chunks.
"""

from __future__ import annotations

import email.utils
import ssl
import time
from collections.abc import AsyncIterator, Sequence

import httpx

from agent.core.errors import Capacity, Permanent, Transient
from firmware_rollout.artifact.manifest import HEADER_SIZE, SIGNATURE_BLOCK_SIZE, ChunkLayout, Manifest, parse_header
from firmware_rollout.errors import ArtifactError

MAX_RUN_BYTES = 8 * 1024 * 1024  # one range request fetches at most this much
DEFAULT_RETRY_AFTER_MS = 1000
MAX_RETRY_AFTER_MS = 600_000


def make_client(*, timeout_s: float = 10.0, ca: str = "", client_cert: str = "",
                client_key: str = "") -> httpx.AsyncClient:
    """One client for every mirror of a download (a keep-alive pool per host); https mirrors are
    checked against the CA bundle `ca` (empty: the system's) and shown `client_cert` when they
    ask for a client certificate."""
    verify: ssl.SSLContext | bool = True
    if ca or client_cert:
        verify = ssl.create_default_context(cafile=ca or None)
        if client_cert:
            verify.load_cert_chain(client_cert, client_key or None)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), verify=verify, follow_redirects=True,
                             limits=httpx.Limits(max_connections=8, max_keepalive_connections=4),
                             headers={"User-Agent": "edge-agent"})


def artifact_url(mirror: str, manifest: Manifest) -> str:
    return f"{mirror.rstrip('/')}/{manifest.sha256.hex()}.eafw"


def retry_after_ms(value: str | None) -> int:
    """`Retry-After` in seconds or as an HTTP date, in ms (absent or unreadable: one second)."""
    if not value:
        return DEFAULT_RETRY_AFTER_MS
    value = value.strip()
    if value.isdigit():
        return min(MAX_RETRY_AFTER_MS, int(value) * 1000)
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER_MS
    return max(0, min(MAX_RETRY_AFTER_MS, int((when - time.time()) * 1000)))


class _Run:
    """An open range response: chunks `next..last` still to be read from it."""

    def __init__(self, response: httpx.Response, first: int, last: int) -> None:
        self.response = response
        self.next = first
        self.last = last
        self._body: AsyncIterator[bytes] = response.aiter_raw()
        self._buffer = bytearray()

    async def read(self, length: int) -> bytes:
        while len(self._buffer) < length:
            try:
                self._buffer += await anext(self._body)
            except StopAsyncIteration:
                raise Transient("the mirror ended the range early") from None
        data = bytes(self._buffer[:length])
        del self._buffer[:length]
        return data

    async def close(self) -> None:
        await self.response.aclose()


class MirrorSource:
    """The `ChunkSource` of one mirror for one image."""

    def __init__(self, client: httpx.AsyncClient, mirror: str, manifest: Manifest, layout: ChunkLayout, *,
                 max_run_bytes: int = MAX_RUN_BYTES) -> None:
        self.mirror = mirror
        self.url = artifact_url(mirror, manifest)
        self._client = client
        self._manifest = manifest
        self._layout = layout
        self._max_run = max_run_bytes
        self._wanted: list[bool] | None = None
        self._image_offset: int | None = None
        self._run: _Run | None = None
        self.requests = 0
        self.bytes_received = 0

    def __str__(self) -> str:
        return self.mirror

    def plan(self, indices: Sequence[int]) -> None:
        wanted = [False] * self._manifest.chunk_count
        for i in indices:
            wanted[i] = True
        self._wanted = wanted

    async def fetch(self, index: int) -> bytes:
        run = self._run
        if run is None or run.next != index:
            await self._close_run()
            run = self._run = await self._open(index)
        try:
            data = await run.read(self._layout.length(index))
        except httpx.HTTPError as exc:
            await self._close_run()
            raise Transient(f"mirror {self.mirror}: {type(exc).__name__}: {exc}") from None
        except Transient:
            await self._close_run()
            raise
        run.next += 1
        self.bytes_received += len(data)
        if run.next > run.last:
            await self._close_run()
        return data

    async def close(self) -> None:
        await self._close_run()

    async def _close_run(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            try:
                await run.close()
            except httpx.HTTPError:
                pass

    def _run_end(self, first: int) -> int:
        """The last chunk of the run that starts at `first`: consecutive wanted chunks within
        `max_run_bytes`."""
        last = first
        total = self._layout.length(first)
        wanted = self._wanted
        while last + 1 < self._manifest.chunk_count and (wanted is None or wanted[last + 1]):
            total += self._layout.length(last + 1)
            if total > self._max_run:
                break
            last += 1
        return last

    async def _image_start(self) -> int:
        if self._image_offset is None:
            response = await self._get(0, HEADER_SIZE - 1)
            try:
                header = await response.aread()
            except httpx.HTTPError as exc:
                raise Transient(f"mirror {self.mirror}: {type(exc).__name__}: {exc}") from None
            finally:
                await response.aclose()
            try:
                length = parse_header(header)
            except ArtifactError as exc:
                raise Permanent(f"mirror {self.mirror} does not serve an artifact at {self.url}: {exc}") from None
            self._image_offset = HEADER_SIZE + length + SIGNATURE_BLOCK_SIZE
        return self._image_offset

    async def _open(self, first: int) -> _Run:
        base = await self._image_start()
        last = self._run_end(first)
        start, end = self._layout.span(first, last)
        response = await self._get(base + start, base + end - 1)
        expected = f"bytes {base + start}-{base + end - 1}/"
        if not response.headers.get("content-range", "").startswith(expected):
            await response.aclose()
            raise Permanent(f"mirror {self.mirror} answered another range than bytes {base + start}-{base + end - 1}"
                            f" ({response.headers.get('content-range', 'none')}): the file is not this artifact")
        return _Run(response, first, last)

    async def _get(self, start: int, end: int) -> httpx.Response:
        self.requests += 1
        request = self._client.build_request("GET", self.url, headers={"Range": f"bytes={start}-{end}",
                                                                       "Accept-Encoding": "identity"})
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise Transient(f"mirror {self.mirror}: {type(exc).__name__}: {exc}") from None
        status = response.status_code
        if status == 206:
            return response
        await response.aclose()
        if status in (429, 503):
            raise Capacity(f"mirror {self.mirror} is busy ({status})",
                           retry_after_ms(response.headers.get("retry-after")))
        if status == 200:
            raise Permanent(f"mirror {self.mirror} ignores Range requests (200 for a range)")
        if status in (403, 404, 410, 416):
            raise Permanent(f"mirror {self.mirror}: {status} for {self.url}")
        if status >= 500:
            raise Transient(f"mirror {self.mirror}: {status}")
        raise Permanent(f"mirror {self.mirror}: unexpected {status} for {self.url}")


__all__ = ["MAX_RUN_BYTES", "MirrorSource", "artifact_url", "make_client", "retry_after_ms"]
