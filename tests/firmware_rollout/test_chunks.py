"""ConfigServers: a hard bound on admitted downloads, busy beyond it; the device-side chunk source
(pieces, AIMD prefetch window, resume from any chunk) over the in-memory broker."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from agent.actors import ActorSystem
from agent.core.clock import VirtualClock
from agent.core.codec import Envelope, Reply, decode
from agent.core.errors import Capacity, Permanent
from agent.core.ids import IdGenerator
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.endpoint import EnvelopeInbox
from agent.transport.memory import MemoryBroker, MemoryTransport
from firmware_rollout.artifact.files import read_image_chunk, read_signed_manifest
from firmware_rollout.artifact.fixture import make_artifact
from firmware_rollout.device.chunk_client import ChunkClient, RemoteChunkSource
from firmware_rollout.messages import Chunk, ChunkRequest
from firmware_rollout.orchestration.chunk_server import ConfigServerPool

CHUNK = 1024


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    path, _ = make_artifact(tmp_path, chunk_size=CHUNK, size=6 * CHUNK + 300)
    return path


def envelope(n: int, req: ChunkRequest) -> Envelope:
    return Envelope(id=f"e{n}", kind="firmware.chunk", sender="d", receiver="leader")


async def stop(system: ActorSystem, clock: VirtualClock) -> None:
    """Stop the system while moving virtual time (its stop waits on the clock)."""
    task = asyncio.ensure_future(system.stop())
    while not task.done():
        await clock.advance(1)
    await task


async def test_the_pool_admits_at_most_its_bound_and_answers_busy_beyond(artifact: Path) -> None:
    clock = VirtualClock()
    signed = read_signed_manifest(artifact)
    system = ActorSystem(clock=clock)
    await system.start()
    try:
        pool = ConfigServerPool(system, lookup=lambda rid: (artifact, signed) if rid == "r" else None, clock=clock,
                                servers=2, capacity=1, rate_bytes_per_s=CHUNK)  # one second per chunk
        assert pool.bound == 4
        requests = [ChunkRequest(rollout_id="r", index=i % 7) for i in range(10)]
        tasks = [asyncio.ensure_future(pool.handle(envelope(i, r), r)) for i, r in enumerate(requests[:2])]
        await clock.advance(0)  # both servers busy serving
        tasks += [asyncio.ensure_future(pool.handle(envelope(i, r), r)) for i, r in enumerate(requests[2:], 2)]
        await clock.advance(0)
        busy = [t.result() for t in tasks if t.done()]
        assert len(busy) == 6 and all(r.status == "busy" and r.retry_after_ms > 0 for r in busy)
        assert pool.in_flight == pool.max_concurrent == pool.bound  # a full queue behind each server
        await clock.advance(3)
        replies: list[Reply] = [t.result() for t in tasks]
        served = [(req, rep) for req, rep in zip(requests, replies, strict=True) if rep.status == "accepted"]
        assert len(served) == 4 and pool.in_flight == 0 and pool.max_concurrent == 4
        for req, rep in served:
            chunk = decode(rep.body, Chunk)
            assert chunk.data == read_image_chunk(artifact, signed, req.index)
        assert pool.statistics()["mailbox_high_water"] <= 1

        unknown = await pool.handle(envelope(99, requests[0]), ChunkRequest(rollout_id="x", index=0))
        out_of_range = await pool.handle(envelope(98, requests[0]), ChunkRequest(rollout_id="r", index=7))
        bad_offset = await pool.handle(envelope(97, requests[0]), ChunkRequest(rollout_id="r", index=6, offset=300))
        assert [r.status for r in (unknown, out_of_range, bad_offset)] == ["rejected"] * 3
        assert "unknown rollout" in unknown.reason and "out of range" in out_of_range.reason
    finally:
        await stop(system, clock)


async def test_remote_source_fetches_pieces_prefetches_and_halves_its_window_on_busy(artifact: Path) -> None:
    clock = VirtualClock()
    signed = read_signed_manifest(artifact)
    broker = MemoryBroker(clock=clock)
    leader_t = MemoryTransport(broker, "leader")
    device_t = MemoryTransport(broker, "dev")
    system = ActorSystem(clock=clock)
    await system.start()
    pool = ConfigServerPool(system, lookup=lambda rid: (artifact, signed), clock=clock, servers=1, capacity=1,
                            rate_bytes_per_s=4 * CHUNK)
    from agent.core.codec import decode
    from firmware_rollout.messages import ChunkRequest

    async def handler(env: Envelope, _m: InboundMessage) -> Reply:
        return await pool.handle(env, decode(env.payload, ChunkRequest))

    inbox = EnvelopeInbox(leader_t, topic_filter=topics.fleet_filter("f", "up"), handler=handler, concurrency=8)
    await inbox.start()
    await leader_t.start()
    client = ChunkClient(device_t, clock=clock, fleet="f", device_id="dev", ids=IdGenerator(clock, random.Random(1)))
    await client.start()
    await device_t.start()
    try:
        source = RemoteChunkSource(client, rollout_id="r", manifest=signed.manifest, piece_size=300,
                                   window_initial=4, window_max=4)
        got: list[bytes] = []
        saw_busy = False
        index = 0
        while index < signed.manifest.chunk_count:
            fetch = asyncio.ensure_future(source.fetch(index))
            while not fetch.done():
                await clock.advance(0.1)
            try:
                got.append(fetch.result())
                index += 1
            except Capacity:
                saw_busy = True
                await clock.advance(0.5)
        assert saw_busy and source.limiter.capacity_rejections >= 1
        assert got == [read_image_chunk(artifact, signed, i) for i in range(signed.manifest.chunk_count)]
        assert pool.max_concurrent <= pool.bound == 2
        source.close()

        resumed = RemoteChunkSource(client, rollout_id="r", manifest=None)  # after a restart: whole chunks
        fetch = asyncio.ensure_future(resumed.fetch(5))
        while not fetch.done():
            await clock.advance(0.1)
        assert fetch.result() == read_image_chunk(artifact, signed, 5)
        resumed.close()

        refused = asyncio.ensure_future(RemoteChunkSource(client, rollout_id="r", manifest=None).fetch(9))
        while not refused.done():
            await clock.advance(0.1)
        with pytest.raises(Permanent, match="out of range"):
            refused.result()
    finally:
        await client.stop()
        await inbox.stop()
        await device_t.stop()
        await leader_t.stop()
        await stop(system, clock)


def test_the_mqtt_prefetch_window_stays_within_the_updaters_plan(artifact: Path) -> None:
    """A delta plans the chunks it downloads: the window fetches ahead only within them, also
    when the plan is one chunk; without a plan it fetches ahead chunk after chunk."""
    clock = VirtualClock()
    signed = read_signed_manifest(artifact)
    client = ChunkClient(MemoryTransport(MemoryBroker(clock=clock), "dev"), clock=clock, fleet="f",
                         device_id="dev", ids=IdGenerator(clock, random.Random(1)))
    source = RemoteChunkSource(client, rollout_id="r", manifest=signed.manifest, window_initial=4, window_max=4)
    assert source._ahead(2) == [2, 3, 4, 5]
    source.plan([1, 4, 5])
    assert source._ahead(1) == [1, 4, 5]
    source.plan([3])
    assert source._ahead(3) == [3]
    assert source._ahead(5) == [5]  # a chunk outside the plan (a copy that failed its check): alone
