"""A device's side of the MQTT chunk download: requests to the leader's ConfigServers.

`ChunkClient` sends a request envelope up and awaits the reply body on its own reply topic;
`RemoteChunkSource` is the updater's `ChunkSource` over it. It prefetches the next chunks
within an AIMD window: every busy answer halves the window (down to one chunk at a time) and
the updater backs off by the answer's `retry_after_ms`; every chunk received widens it by one.
The updater asks for chunk `chunks_done` first, so a download resumes from the last chunk it
wrote and checked. The leader's side is `firmware_rollout.orchestration.chunk_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence

from agent.core.clock import Clock
from agent.core.codec import Envelope, Reply, decode, decode_reply, encode
from agent.core.errors import Capacity, CodecError, Permanent, Transient, TransportError
from agent.core.ids import IdGenerator
from agent.outbox.limiter import AimdLimiter
from agent.transport import topics
from agent.transport.base import InboundMessage, Transport
from firmware_rollout.artifact.manifest import DEFAULT_CHUNK_SIZE, Manifest
from firmware_rollout.messages import KIND_CHUNK_REQUEST, Chunk, ChunkRequest

MQTT_PIECE_SIZE = DEFAULT_CHUNK_SIZE  # the largest piece of a chunk one request asks for


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
        if manifest is not None and piece_size <= 0 and manifest.chunk_size > MQTT_PIECE_SIZE:
            piece_size = MQTT_PIECE_SIZE  # a large content-defined chunk travels in pieces that fit MQTT
        self._piece = piece_size if piece_size > 0 and manifest is not None else 0
        self.limiter = AimdLimiter(initial=window_initial, min=1, max=window_max)
        self._tasks: dict[int, asyncio.Task[bytes]] = {}
        # planned chunk -> the next planned one (a delta skips the rest); None: no plan, every chunk
        self._after: dict[int, int] | None = None

    def plan(self, indices: Sequence[int]) -> None:
        self._after = dict(itertools.pairwise(indices))

    def _ahead(self, index: int) -> list[int]:
        """`index` and the chunks to prefetch after it, within the window."""
        if self._manifest is None:
            return [index]
        out = [index]
        while len(out) < self.limiter.limit:
            following = self._after.get(out[-1]) if self._after is not None else out[-1] + 1
            if following is None or following >= self._manifest.chunk_count:
                break
            out.append(following)
        return out

    async def fetch(self, index: int) -> bytes:
        for stale in [i for i in self._tasks if i < index]:
            self._tasks.pop(stale).cancel()
        for i in self._ahead(index):
            if i not in self._tasks:
                task = asyncio.ensure_future(self._fetch_chunk(i))
                task.add_done_callback(_consume)
                self._tasks[i] = task
        task = self._tasks.pop(index)
        try:
            data = await task
        except Capacity:
            self.limiter.record("capacity")
            keep = set(self._ahead(index))  # the halved window
            for i in [i for i in self._tasks if i not in keep]:
                self._tasks.pop(i).cancel()
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


__all__ = ["ChunkClient", "RemoteChunkSource"]
