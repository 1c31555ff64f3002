"""One credentialed device sends the leader whatever it likes: random and boundary envelopes of
every kind (integers at 2^63 - 1, 2^63 and 2^64 - 1, negative, huge and unicode strings, maps
and lists, garbage bytes, duplicates, floods). After each sequence another device must still be
served, every leader actor must still run (what `/healthz` reports as `actors`), and every
refusal must be answered and recorded with its reason."""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import leader, stop_all, until

from agent.core.clock import VirtualClock
from agent.core.codec import Envelope, decode_reply, encode
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker, MemoryTransport

KINDS = ["heartbeat", "telemetry", "job.submit", "job.demand", "job.result", "job.offer", "presence",
         "status.request", "firmware.report", "firmware.chunk", "nonsense", ""]
BOUNDARY_INTS = [0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
FIELDS = ["device_id", "worker", "seq", "ts_ms", "uptime_s", "name", "value", "values", "job_id", "epoch",
          "kind", "payload", "window", "incarnation", "ok", "tags", "firmware_version", "sample", "boot",
          "rollout_id", "index", "offset", "length", "state", "phase", "version", "detail"]

ints = st.sampled_from(BOUNDARY_INTS) | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack carries
texts = st.text(max_size=40) | st.sampled_from(["x" * 5000, "\u0000", "é🙂", "rogue", "pi-0001", "+/#"])
leaves = ints | texts | st.floats() | st.booleans() | st.none() | st.binary(max_size=64)
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                      max_leaves=8)
payloads = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)


@st.composite
def messages(draw: st.DrawFn) -> tuple[str, bytes]:
    """(kind, raw bytes of an MQTT payload on the rogue's own up topic)."""
    if draw(st.integers(0, 9)) == 0:
        return "garbage", draw(st.binary(max_size=200))
    kind = draw(st.sampled_from(KINDS) | texts)
    payload = draw(payloads)
    if draw(st.booleans()):
        payload.setdefault("device_id", "rogue")
    envelope: dict[str, Any] = {"id": draw(st.sampled_from(["e1", "e2"]) | st.text(min_size=1, max_size=70)),
                                "kind": kind, "sender": "rogue", "receiver": "leader",
                                "payload": msgspec.msgpack.encode(payload)}
    for field in ("seq", "ts_ms", "ttl_ms", "v"):
        if draw(st.booleans()):
            envelope[field] = draw(ints)
    return kind, msgspec.msgpack.encode(envelope)


async def _run(sequence: list[tuple[str, bytes]], repeat: int, work: Path, *, all_refused: bool = False) -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock, rng=random.Random(0))
    gw = await leader(clock, work, broker=broker, mqtt={"max_payload_bytes": 4096},
                      leader={"process_interval_s": 0.5})
    rogue = MemoryTransport(broker, "rogue", max_payload_bytes=1 << 20)
    honest = MemoryTransport(broker, "pi-0001")
    replies: dict[str, list[InboundMessage]] = {"rogue": [], "pi-0001": []}

    def collector(device: str):
        async def collect(message: InboundMessage) -> None:
            replies[device].append(message)
        return collect

    for device, transport in (("rogue", rogue), ("pi-0001", honest)):
        await transport.subscribe(topics.reply("t", device, "r"), collector(device))
        await transport.start()
    try:
        sent = 0
        for _ in range(repeat):  # a flood repeats the sequence, duplicates included
            for _, raw in sequence:
                await rogue.publish(topics.up("t", "rogue"), raw, response_topic=topics.reply("t", "rogue", "r"),
                                    correlation=str(sent).encode())
                sent += 1
        await until(clock, lambda: len(replies["rogue"]) == sent, step_s=0.1, limit_s=60, what="every message answered")
        statuses = [decode_reply(m.payload) for m in replies["rogue"]]
        assert {r.status for r in statuses} <= {"accepted", "busy", "rejected"}
        refused = [r for r in statuses if r.status == "rejected"]
        assert all(r.reason for r in refused)  # every refusal says why
        if all_refused:  # nothing out of bounds is taken, or answered anything but a refusal
            assert len(refused) == len(statuses), [r for r in statuses if r.status != "rejected"]
        assert gw.rejects.total() >= min(len(refused), 100)  # and is recorded (capped per sender)
        # another device is still served: its heartbeat is answered and applied
        beat = Envelope(id="honest-1", kind="heartbeat", sender="pi-0001", receiver="leader",
                        payload=msgspec.msgpack.encode({"device_id": "pi-0001", "seq": 7, "uptime_s": 1.0}))
        await honest.publish(topics.up("t", "pi-0001"), encode(beat), response_topic=topics.reply("t", "pi-0001", "r"),
                             correlation=b"h")
        await until(clock, lambda: bool(replies["pi-0001"]), step_s=0.1, limit_s=60, what="the honest device answered")
        assert decode_reply(replies["pi-0001"][0].payload).status == "accepted"
        await until(clock, lambda: (d := gw.registry.device("pi-0001")) is not None and d.hb_seq == 7,
                    step_s=0.1, limit_s=60, what="the honest heartbeat applied")
        assert gw.system.failures == []  # every leader actor still running
    finally:
        await rogue.stop()
        await honest.stop()
        await stop_all(gw, clock=clock)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sequence=st.lists(messages(), min_size=1, max_size=12), repeat=st.integers(min_value=1, max_value=3))
def test_whatever_one_device_sends_the_leader_keeps_serving_the_fleet(sequence: list[tuple[str, bytes]],
                                                                      repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_run(sequence, repeat, Path(tmp)))


def test_boundary_integers_in_every_counted_field_are_refused_not_fatal() -> None:
    """The fixed cases the fuzzer may not draw: every seq/ts/epoch-like field at 2^63 and 2^64 - 1."""
    cases: list[tuple[str, bytes]] = []
    for value in (2**63, 2**64 - 1):
        for kind, body in (
            ("heartbeat", {"device_id": "rogue", "seq": value, "uptime_s": 1.0}),
            ("telemetry", {"device_id": "rogue", "seq": value, "name": "t", "ts_ms": 1, "value": 1.0}),
            ("telemetry", {"device_id": "rogue", "seq": 1, "name": "t", "ts_ms": value, "value": 1.0}),
            ("job.result", {"job_id": "j", "epoch": value, "worker": "rogue", "ok": True}),
            ("firmware.report", {"device": "rogue", "rollout_id": "r", "version": "1", "state": "failed",
                                 "phase": "failed", "ts_ms": 1, "seq": value}),
        ):
            env = {"id": f"{kind}-{value}", "kind": kind, "sender": "rogue", "receiver": "leader",
                   "payload": msgspec.msgpack.encode(body)}
            cases.append((kind, msgspec.msgpack.encode(env)))
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_run(cases, 2, Path(tmp), all_refused=True))
