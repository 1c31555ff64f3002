"""Image chunks from the leader to the devices, with a hard bound on concurrent downloads.

`ConfigServerPool` runs `servers` ConfigServer actors, each with a bounded mailbox
of `capacity`. A `ChunkRequest` arriving from a device goes into the first server with room;
when every mailbox is full the device is answered `busy(retry_after_ms)` at once (seed 000,
4.2: a full mailbox is `Capacity`), so at no moment are more than `servers * (capacity + 1)`
requests admitted (queued plus one being served per server). `max_concurrent` records the
high-water mark.

The device side is `firmware_rollout.device.chunk_client`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.actors import Actor, ActorRef, ActorSystem, Context
from agent.core.clock import Clock
from agent.core.codec import Envelope, Reply, encode
from agent.core.errors import (
    ActorStopped,
    ArtifactError,
    MailboxFull,
)
from agent.core.tasks import in_thread
from firmware_rollout.artifact.manifest import ChunkLayout, SignedManifest
from firmware_rollout.messages import Chunk, ChunkRequest

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
            self._pool.release()
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
            self._pool.release()


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
        self._layouts: dict[bytes, ChunkLayout] = {}  # image sha256 -> where its chunks lie
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

    def release(self) -> None:
        """One admitted request is done (served, failed or given up)."""
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
        layout = self._layouts.get(manifest.sha256)
        if layout is None:
            layout = self._layouts[manifest.sha256] = manifest.layout()
        chunk_len = layout.length(request.index)
        if request.offset >= chunk_len:
            return self._reject(envelope, f"offset {request.offset} beyond chunk {request.index} ({chunk_len} bytes)")
        length = chunk_len - request.offset if request.length == 0 else min(request.length, chunk_len - request.offset)
        done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        job = _Serve(path, signed.size + layout.offset(request.index) + request.offset, length, done)
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


__all__ = ["ArtifactLookup", "ConfigServer", "ConfigServerPool"]
