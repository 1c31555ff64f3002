"""Image chunks from the leader to the devices, with a hard bound on concurrent downloads.

Leader side: `ConfigServerPool` runs `servers` ConfigServer actors, each with a bounded mailbox
of `capacity`. A `ChunkRequest` arriving from a device goes into the first server with room;
when every mailbox is full the device is answered `busy(retry_after_ms)` at once (seed 000,
4.2: a full mailbox is `Capacity`), so at no moment are more than `servers * (capacity + 1)`
requests admitted (queued plus one being served per server). `max_concurrent` records the
high-water mark.

Device side: `ChunkClient` sends a request envelope up and awaits the reply body on its own
reply topic; `RemoteChunkSource` is the updater's `ChunkSource` over it. It prefetches the next
chunks within an AIMD window: every busy answer halves the window (down to one chunk at a
time) and the updater backs off by the answer's `retry_after_ms`; every chunk received widens
it by one. The updater asks for chunk `chunks_done` first, so a download resumes from the
last chunk it wrote and checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.actors import Actor, ActorRef, ActorSystem, Context
from agent.core.clock import Clock
from agent.core.codec import Envelope, Reply, decode, decode_reply, encode
from agent.core.errors import (
    ActorStopped,
    ArtifactError,
    Capacity,
    CodecError,
    MailboxFull,
    Permanent,
    Transient,
    TransportError,
)
from agent.core.ids import IdGenerator
from agent.outbox.limiter import AimdLimiter
from agent.transport import topics
from agent.transport.base import InboundMessage, Transport
from firmware_rollout._fs import in_thread
from firmware_rollout.manifest import Manifest, SignedManifest
from firmware_rollout.messages import KIND_CHUNK_REQUEST, Chunk, ChunkRequest

log = logging.getLogger(__name__)

ArtifactLookup = Callable[[str], tuple[Path, SignedManifest] | None]
SERVE_TIMEOUT_S = 60.0


def _read_range(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as handle:
        handle.seek(offset)
        data = handle.read(length)
    if len(data) != length:
        raise ArtifactError(f"{path}: short read ({len(data)} of {length} bytes at {offset})")
    return data


@dataclass(slots=True)
class _Serve:
    path: Path
    offset: int  # in the artifact file
    length: int
    done: asyncio.Future[bytes]


class ConfigServer(Actor):
    """Serves one request at a time; `rate_bytes_per_s` (0: unlimited) paces the bytes."""

    def __init__(self, pool: ConfigServerPool) -> None:
        self._pool = pool

    async def receive(self, message: object, ctx: Context) -> None:
        assert isinstance(message, _Serve)
        if message.done.done():  # the requester gave up while it was queued
            self._pool._release()
            return
        try:
            data = await in_thread(ctx.clock, _read_range, message.path, message.offset, message.length)
            rate = self._pool.rate_bytes_per_s
            if rate > 0:
                await ctx.clock.sleep(len(data) / rate)
            self._pool.bytes_served += len(data)
            if not message.done.done():
                message.done.set_result(data)
        except (OSError, ArtifactError) as exc:
            if not message.done.done():
                message.done.set_exception(ArtifactError(str(exc)))
        finally:
            self._pool._release()


class ConfigServerPool:
    """`servers` ConfigServer actors in `system`; `handle` answers one `ChunkRequest`."""

    def __init__(
        self,
        system: ActorSystem,
        *,
        lookup: ArtifactLookup,
        clock: Clock,
        servers: int = 2,
        capacity: int = 2,
        rate_bytes_per_s: int = 0,
        name: str = "config-server",
    ) -> None:
        if servers < 1 or capacity < 1:
            raise ValueError("servers and capacity must be >= 1")
        self.lookup = lookup
        self.clock = clock
        self.capacity = capacity
        self.rate_bytes_per_s = rate_bytes_per_s
        self.refs: list[ActorRef] = [
            system.spawn(ConfigServer(self), name=f"{name}-{i}", capacity=capacity, policy="reject")
            for i in range(servers)
        ]
        self._next = 0
        self.in_flight = 0
        self.max_concurrent = 0
        self.served = 0
        self.busy = 0
        self.rejected = 0
        self.bytes_served = 0

    @property
    def bound(self) -> int:
        """The most requests ever admitted at once: a queue of `capacity` plus one in service,
        per server."""
        return len(self.refs) * (self.capacity + 1)

    def _release(self) -> None:
        self.in_flight -= 1

    def statistics(self) -> dict[str, int]:
        return {
            "servers": len(self.refs),
            "capacity": self.capacity,
            "bound": self.bound,
            "max_concurrent": self.max_concurrent,
            "served": self.served,
            "busy": self.busy,
            "rejected": self.rejected,
            "bytes_served": self.bytes_served,
            "mailbox_high_water": max((r.statistics().high_water for r in self.refs), default=0),
        }

    async def handle(self, envelope: Envelope, request: ChunkRequest) -> Reply:
        """Answer a device's request: the bytes in the reply body, `busy` when every server is
        full, `rejected` for an unknown rollout or a range outside the image."""
        found = self.lookup(request.rollout_id)
        if found is None:
            return self._reject(envelope, f"unknown rollout {request.rollout_id!r}")
        path, signed = found
        manifest = signed.manifest
        if request.index >= manifest.chunk_count:
            return self._reject(envelope, f"chunk {request.index} out of range 0..{manifest.chunk_count - 1}")
        chunk_len = manifest.chunk_length(request.index)
        if request.offset >= chunk_len:
            return self._reject(envelope, f"offset {request.offset} beyond chunk {request.index} ({chunk_len} bytes)")
        length = chunk_len - request.offset if request.length == 0 else min(request.length, chunk_len - request.offset)
        done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        job = _Serve(path, signed.size + request.index * manifest.chunk_size + request.offset, length, done)
        retry_after_ms = 0
        n = len(self.refs)
        for i in range(n):
            ref = self.refs[(self._next + i) % n]
            try:
                ref.tell(job)
            except MailboxFull as exc:
                retry_after_ms = max(retry_after_ms, exc.retry_after_ms)
                continue
            except ActorStopped:
                continue
            self._next = (self._next + i + 1) % n
            self.in_flight += 1
            self.max_concurrent = max(self.max_concurrent, self.in_flight)
            break
        else:
            self.busy += 1
            return Reply(
                id=envelope.id, status="busy", retry_after_ms=max(retry_after_ms, 100), reason="config servers are full"
            )
        try:
            data = await self.clock.wait_for(asyncio.shield(done), SERVE_TIMEOUT_S)
        except TimeoutError:
            done.cancel()
            return Reply(id=envelope.id, status="busy", retry_after_ms=1000, reason="chunk not served in time")
        except ArtifactError as exc:
            return self._reject(envelope, f"cannot serve chunk {request.index}: {exc}")
        self.served += 1
        body = encode(Chunk(rollout_id=request.rollout_id, index=request.index, offset=request.offset, data=data))
        return Reply(id=envelope.id, status="accepted", body=body)

    def _reject(self, envelope: Envelope, reason: str) -> Reply:
        self.rejected += 1
        return Reply(id=envelope.id, status="rejected", reason=reason)


class ChunkClient:
    """A device's request/reply channel for chunks: envelopes up, replies with a body back."""

    def __init__(
        self,
        transport: Transport,
        *,
        clock: Clock,
        fleet: str,
        device_id: str,
        ids: IdGenerator,
        timeout_s: float = 30.0,
    ) -> None:
        self._transport = transport
        self._clock = clock
        self._device_id = device_id
        self._ids = ids
        self._timeout_s = timeout_s
        self._up = topics.up(fleet, device_id)
        self._reply_topic = topics.reply(fleet, device_id, "chunks")
        self._pending: dict[bytes, asyncio.Future[Reply | None]] = {}
        self._started = False
        self.requests = 0
        self.busy = 0

    async def start(self) -> None:
        if not self._started:
            self._started = True
            self._transport.connected.add_listener(self._on_gate)
            await self._transport.subscribe(self._reply_topic, self._on_reply)

    async def stop(self) -> None:
        if self._started:
            self._started = False
            self._transport.connected.remove_listener(self._on_gate)
            self._on_gate(False)
            with contextlib.suppress(TransportError):
                await self._transport.unsubscribe(self._reply_topic)

    def _on_gate(self, is_open: bool) -> None:
        if not is_open:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_result(None)

    async def _on_reply(self, message: InboundMessage) -> None:
        fut = self._pending.get(message.correlation or b"")
        if fut is None or fut.done():
            return
        try:
            fut.set_result(decode_reply(message.payload))
        except CodecError:
            fut.set_result(None)

    async def request(self, req: ChunkRequest) -> Chunk:
        """One chunk request; raises Capacity (busy), Permanent (refused) or Transient."""
        if not self._started or not self._transport.connected.is_open:
            raise Transient("not connected")
        env = Envelope(
            id=self._ids.next(),
            kind=KIND_CHUNK_REQUEST,
            sender=self._device_id,
            receiver="leader",
            ts_ms=self._clock.now_ms(),
            payload=encode(req),
        )
        correlation = env.id.encode()
        fut: asyncio.Future[Reply | None] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = fut
        self.requests += 1
        try:
            try:
                await self._transport.publish(
                    self._up, encode(env), qos=1, response_topic=self._reply_topic, correlation=correlation
                )
            except TransportError as exc:
                raise Transient(f"chunk request not sent: {exc}") from None
            try:
                reply = await self._clock.wait_for(fut, self._timeout_s)
            except TimeoutError:
                raise Transient(f"no answer to the chunk request within {self._timeout_s:g}s") from None
        finally:
            self._pending.pop(correlation, None)
        if reply is None:
            raise Transient("connection lost waiting for a chunk")
        if reply.status == "busy":
            self.busy += 1
            raise Capacity(reply.reason or "config servers busy", reply.retry_after_ms)
        if reply.status == "rejected":
            raise Permanent(reply.reason or "chunk request refused")
        try:
            return decode(reply.body, Chunk)
        except CodecError as exc:
            raise Transient(f"undecodable chunk: {exc}") from None


class RemoteChunkSource:
    """The updater's `ChunkSource` for one offer, fetching through a `ChunkClient`."""

    def __init__(
        self,
        client: ChunkClient,
        *,
        rollout_id: str,
        manifest: Manifest | None,
        piece_size: int = 0,
        window_initial: int = 2,
        window_max: int = 4,
    ) -> None:
        """Without the `manifest` (a download resumed after a restart) chunks are fetched one at a
        time, each whole."""
        self._client = client
        self._rollout_id = rollout_id
        self._manifest = manifest
        self._piece = piece_size if piece_size > 0 and manifest is not None else 0
        self.limiter = AimdLimiter(initial=window_initial, min=1, max=window_max)
        self._tasks: dict[int, asyncio.Task[bytes]] = {}

    async def fetch(self, index: int) -> bytes:
        for stale in [i for i in self._tasks if i < index]:
            self._tasks.pop(stale).cancel()
        last = index + 1 if self._manifest is None else min(index + self.limiter.limit, self._manifest.chunk_count)
        for i in range(index, last):
            if i not in self._tasks:
                task = asyncio.ensure_future(self._fetch_chunk(i))
                task.add_done_callback(_consume)
                self._tasks[i] = task
        task = self._tasks.pop(index)
        try:
            data = await task
        except Capacity:
            self.limiter.record("capacity")
            self._drop_beyond(index + self.limiter.limit)
            raise
        except Transient:
            self.limiter.record("transient")
            raise
        self.limiter.record("success")
        return data

    def _drop_beyond(self, first: int) -> None:
        for i in [i for i in self._tasks if i >= first]:
            self._tasks.pop(i).cancel()

    async def _fetch_chunk(self, index: int) -> bytes:
        if self._manifest is None or self._piece == 0:
            chunk = await self._client.request(ChunkRequest(rollout_id=self._rollout_id, index=index))
            if chunk.index != index or chunk.offset != 0:
                raise Transient(f"answer for chunk {chunk.index}@{chunk.offset}, asked {index}")
            return chunk.data
        length = self._manifest.chunk_length(index)
        parts = []
        offset = 0
        while offset < length:
            chunk = await self._client.request(
                ChunkRequest(
                    rollout_id=self._rollout_id, index=index, offset=offset, length=min(self._piece, length - offset)
                )
            )
            if chunk.index != index or chunk.offset != offset or not chunk.data:
                raise Transient(f"answer for chunk {chunk.index}@{chunk.offset}, asked {index}@{offset}")
            parts.append(chunk.data)
            offset += len(chunk.data)
        return b"".join(parts)

    def close(self) -> None:
        """Cancel prefetches (the update ended or the process is going down)."""
        self._drop_beyond(0)


def _consume(task: asyncio.Task[bytes]) -> None:
    """A prefetch nobody awaits any more must not log 'exception never retrieved'."""
    if not task.cancelled():
        task.exception()


__all__ = ["ChunkClient", "ConfigServer", "ConfigServerPool", "RemoteChunkSource"]
