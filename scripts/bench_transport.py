#!/usr/bin/env python3
"""Transport throughput against a local mosquitto this script starts (and stops by pid).

Three paths, QoS 1, messages delivered per second:
  raw_aiomqtt          aiomqtt publisher + subscriber, publishes pipelined by --in-flight workers
                       (stock clients; and again with TCP_NODELAY, which MqttTransport sets)
  transport_pubsub     our MqttTransport.publish -> MqttTransport.subscribe handler, same shape
  request_reply        EnvelopeSender.deliver -> EnvelopeInbox -> Reply, --in-flight in flight
and, for the simulator, the same two of ours over the in-memory broker.

Prints progress to stderr and, as the last line on stdout, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import aiomqtt  # noqa: E402
from mosquitto import Mosquitto  # noqa: E402

from agent.core.clock import SystemClock  # noqa: E402
from agent.core.codec import Envelope, Reply  # noqa: E402
from agent.transport import topics  # noqa: E402
from agent.transport.base import InboundMessage, Transport  # noqa: E402
from agent.transport.endpoint import EnvelopeInbox, EnvelopeSender  # noqa: E402
from agent.transport.memory import MemoryBroker, MemoryTransport  # noqa: E402
from agent.transport.mqtt import MqttTransport  # noqa: E402

PAYLOAD = b"x" * 200


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def pipelined(count: int, workers: int, send: Callable[[int], Awaitable[None]]) -> None:
    """Run `send(i)` for i in range(count) with `workers` sends in flight."""
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            index = next_index
            next_index += 1
            await send(index)

    await asyncio.gather(*(worker() for _ in range(workers)))


async def bench_raw(port: int, count: int, in_flight: int, *, nodelay: bool = False) -> float:
    received = 0
    done = asyncio.Event()
    options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)] if nodelay else []
    async with (
        aiomqtt.Client(
            "127.0.0.1", port, identifier="raw-sub", protocol=aiomqtt.ProtocolVersion.V5, socket_options=options
        ) as sub,
        aiomqtt.Client(
            "127.0.0.1",
            port,
            identifier="raw-pub",
            protocol=aiomqtt.ProtocolVersion.V5,
            max_inflight_messages=100,
            socket_options=options,
        ) as pub,
    ):
        pub.pending_calls_threshold = 1 << 30
        await sub.subscribe("bench/raw/#", qos=1)

        async def consume() -> None:
            nonlocal received
            async for _ in sub.messages:
                received += 1
                if received >= count:
                    done.set()
                    return

        consumer = asyncio.create_task(consume())
        start = time.perf_counter()
        await pipelined(count, in_flight, lambda i: pub.publish("bench/raw/t", PAYLOAD, qos=1))
        await asyncio.wait_for(done.wait(), 120)
        elapsed = time.perf_counter() - start
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
    return count / elapsed


async def bench_pubsub(make: Callable[[str], Transport], count: int, in_flight: int) -> tuple[float, int]:
    received = 0
    done = asyncio.Event()

    async def handler(message: InboundMessage) -> None:
        nonlocal received
        received += 1
        if received >= count:
            done.set()

    sub, pub = make("ours-sub"), make("ours-pub")
    await sub.subscribe("bench/ours/#", handler)
    for t in (sub, pub):
        await t.start()
        await asyncio.wait_for(t.connected.wait_open(), 10)
    start = time.perf_counter()
    await pipelined(count, in_flight, lambda i: pub.publish("bench/ours/t", PAYLOAD))
    await asyncio.wait_for(done.wait(), 120)
    elapsed = time.perf_counter() - start
    for t in (pub, sub):
        await t.stop()
    return count / elapsed, count - received


async def bench_request_reply(
    make: Callable[[str], Transport], count: int, in_flight: int, inbox_concurrency: int
) -> tuple[float, int]:
    fleet = "bench"
    accepted: set[str] = set()

    async def answer(envelope: Envelope, message: InboundMessage) -> Reply:
        accepted.add(envelope.id)
        return Reply(id=envelope.id, status="accepted")

    leader, device = make("leader"), make("dev-1")
    inbox = EnvelopeInbox(leader, topic_filter=topics.leaders_up(fleet), handler=answer, concurrency=inbox_concurrency)
    sender = EnvelopeSender(device, clock=SystemClock(), reply_topic=topics.reply(fleet, "dev-1"), timeout_s=30)
    await inbox.start()
    await sender.start()
    for t in (leader, device):
        await t.start()
        await asyncio.wait_for(t.connected.wait_open(), 10)
    await asyncio.sleep(0.05)
    topic = topics.up(fleet, "dev-1")

    async def send(index: int) -> None:
        envelope = Envelope(id=f"m{index:08d}", kind="bench", sender="dev-1", receiver="leader", payload=PAYLOAD)
        await sender.deliver(envelope, topic)

    start = time.perf_counter()
    await pipelined(count, in_flight, send)
    elapsed = time.perf_counter() - start
    await sender.stop()
    await inbox.stop()
    for t in (device, leader):
        await t.stop()
    return count / elapsed, count - len(accepted)


async def main(args: argparse.Namespace) -> dict[str, object]:
    count = 5_000 if args.quick else args.messages
    result: dict[str, object] = {"messages": count, "in_flight": args.in_flight}
    with tempfile.TemporaryDirectory(prefix="bench-mosquitto-") as workdir:
        broker = Mosquitto(workdir).start()
        try:
            note(f"mosquitto pid {broker.pid} on port {broker.port}")

            def mqtt(client_id: str) -> Transport:
                return MqttTransport(host="127.0.0.1", port=broker.port, client_id=client_id, clean_start=True)

            raw = await bench_raw(broker.port, count, args.in_flight)
            note(f"raw aiomqtt: {raw:,.0f} msg/s")
            raw_nodelay = await bench_raw(broker.port, count, args.in_flight, nodelay=True)
            note(f"raw aiomqtt with TCP_NODELAY on the clients: {raw_nodelay:,.0f} msg/s")
            ours, lost_ps = await bench_pubsub(mqtt, count, args.in_flight)
            note(f"MqttTransport publish/subscribe: {ours:,.0f} msg/s")
            rr, lost_rr = await bench_request_reply(mqtt, count, args.in_flight, args.inbox_concurrency)
            note(f"EnvelopeSender/Inbox request-reply: {rr:,.0f} msg/s")
        finally:
            broker.stop()
    world = MemoryBroker(clock=SystemClock())

    def memory(client_id: str) -> Transport:
        return MemoryTransport(world, client_id)

    mem_ps, lost_mps = await bench_pubsub(memory, count * 4, args.in_flight)
    note(f"MemoryTransport publish/subscribe: {mem_ps:,.0f} msg/s")
    world = MemoryBroker(clock=SystemClock())
    mem_rr, lost_mrr = await bench_request_reply(memory, count * 4, args.in_flight, 1)
    note(f"MemoryTransport request-reply: {mem_rr:,.0f} msg/s")
    result.update(
        raw_aiomqtt_msgs_per_s=round(raw),
        raw_aiomqtt_nodelay_msgs_per_s=round(raw_nodelay),
        transport_pubsub_msgs_per_s=round(ours),
        request_reply_msgs_per_s=round(rr),
        ratio_pubsub_vs_raw=round(ours / raw, 3),
        ratio_request_reply_vs_raw=round(rr / raw, 3),
        memory_pubsub_msgs_per_s=round(mem_ps),
        memory_request_reply_msgs_per_s=round(mem_rr),
        inbox_concurrency=args.inbox_concurrency,
        loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
        lost=lost_ps + lost_rr + lost_mps + lost_mrr,
    )
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000, help="messages per MQTT path")
    parser.add_argument("--quick", action="store_true", help="5,000 messages per MQTT path")
    parser.add_argument("--in-flight", type=int, default=64, help="publishes / deliveries in flight")
    parser.add_argument("--inbox-concurrency", type=int, default=8, help="EnvelopeInbox workers (MQTT)")
    parser.add_argument("--no-uvloop", action="store_true", help="use the stock asyncio loop")
    return parser.parse_args()


if __name__ == "__main__":
    options = parse_args()
    runner = asyncio.run
    if not options.no_uvloop:
        try:
            import uvloop

            runner = uvloop.run  # type: ignore[assignment]
        except ImportError:
            pass
    print(json.dumps(runner(main(options))))
