"""One hostile device against a real leader process (`edge-agent run` on a real mosquitto): a
flood of refused integers, payloads at the size limit, new telemetry names, job submissions and
garbage. Afterwards the leader's memory is under the unit's MemoryHigh, `/healthz` is 200 with
every actor running, and another device is still served."""

from __future__ import annotations

import asyncio
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import aiomqtt
import msgspec
import psutil
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import REPO, kill, spawn_agent
from mosquitto import free_port

from agent.core.codec import Envelope, decode_reply, encode
from agent.transport import topics

pytestmark = pytest.mark.mqtt

ROUNDS = 400
PAYLOAD_LIMIT = 256 * 1024  # mqtt.max_payload_bytes, the default


def memory_high_bytes() -> int:
    unit = (REPO / "systemd" / "edge-agent.service").read_text()
    match = re.search(r"^MemoryHigh=(\d+)M$", unit, re.MULTILINE)
    assert match, "the shipped unit sets MemoryHigh in MiB"
    return int(match.group(1)) * 1024 * 1024


def healthz(port: int) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def hostile_round(n: int) -> list[bytes]:
    """What the rogue sends in one round, each an envelope (or not) on its own up topic."""
    def envelope(kind: str, body: object) -> bytes:
        return encode(Envelope(id=f"r{n}-{kind}", kind=kind, sender="rogue", receiver="leader",
                               payload=msgspec.msgpack.encode(body)))

    sent = [
        envelope("heartbeat", {"device_id": "rogue", "seq": 2**63 + n, "uptime_s": 1.0}),
        envelope("telemetry", {"device_id": "rogue", "seq": n + 1, "name": f"n{n}", "ts_ms": 1, "value": 1.0}),
        envelope("job.submit", {"job_id": f"j{n}", "payload": b"x" * 100}),
        b"\xc1" * (n % 64 + 1),  # not msgpack
    ]
    # at the size limit: an envelope of junk the leader must read before refusing it (100 MiB in all)
    sent.append(envelope("telemetry", {"device_id": "rogue", "junk": "x" * (PAYLOAD_LIMIT - 400)}))
    return sent


STALL_S = 120.0  # the longest the leader may go without answering the flood


@pytest.mark.timeout(1800)  # its own waits bound it: a stall of the answers, the health checks (60 s each)
async def test_a_hostile_device_leaves_the_leader_process_within_its_memory_and_serving(
        mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    proc = spawn_agent(tmp_path, "leader", "gw", mosquitto.url, metrics={"listen": f"127.0.0.1:{port}"})
    try:
        async def until_healthy() -> bytes:
            while True:
                status, body = await asyncio.to_thread(healthz, port)
                if status == 200:
                    return body
                assert proc.poll() is None, (tmp_path / "gw.log").read_text()
                await asyncio.sleep(0.1)

        await asyncio.wait_for(until_healthy(), 60)
        reply_topic = topics.reply("t", "rogue", "r")
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="rogue",
                                  protocol=aiomqtt.ProtocolVersion.V5, max_queued_outgoing_messages=0) as rogue:
            # /healthz answers before the leader's MQTT session is up: the flood goes once its
            # retained `online` birth says it has subscribed (what went before would be lost)
            await rogue.subscribe(topics.presence("t", "gw"), qos=1)
            async with asyncio.timeout(60):
                async for message in rogue.messages:
                    if bytes(message.payload).startswith(b"online"):  # type: ignore[arg-type]
                        break
            await rogue.unsubscribe(topics.presence("t", "gw"))
            await rogue.subscribe(reply_topic, qos=1)
            sent = 0
            for n in range(ROUNDS):
                for payload in hostile_round(n):
                    props = Properties(PacketTypes.PUBLISH)
                    props.ResponseTopic = reply_topic
                    props.CorrelationData = str(sent).encode()
                    await rogue.publish(topics.up("t", "rogue"), payload, qos=1, properties=props)
                    sent += 1
            statuses: dict[str, int] = {}
            answered = 0
            replies = aiter(rogue.messages)
            while answered < sent - ROUNDS:  # garbage without an envelope id gets no answer
                # the leader keeps answering, however slowly a loaded machine lets it: a stall
                # of STALL_S without one answer fails, a slow flood does not
                message = await asyncio.wait_for(anext(replies), STALL_S)
                reply = decode_reply(message.payload)  # type: ignore[arg-type]
                statuses[reply.status] = statuses.get(reply.status, 0) + 1
                answered += 1
        assert set(statuses) <= {"rejected", "busy", "accepted"}
        assert statuses.get("accepted", 0) <= 256  # the telemetry names within the device's cap
        assert sum(statuses.values()) == 4 * ROUNDS
        rss = psutil.Process(proc.pid).memory_info().rss
        assert rss < memory_high_bytes(), f"leader RSS {rss / 2**20:.1f} MiB after the flood"
        body = await asyncio.wait_for(until_healthy(), 60)
        assert b"all actors running" in body
        # another device is still served
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="pi-0001",
                                  protocol=aiomqtt.ProtocolVersion.V5) as honest:
            mine = topics.reply("t", "pi-0001", "r")
            await honest.subscribe(mine, qos=1)
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = mine
            props.CorrelationData = b"h"
            beat = Envelope(id="h1", kind="heartbeat", sender="pi-0001", receiver="leader",
                            payload=msgspec.msgpack.encode({"device_id": "pi-0001", "seq": 1, "uptime_s": 1.0}))
            await honest.publish(topics.up("t", "pi-0001"), encode(beat), qos=1, properties=props)
            async with asyncio.timeout(60):
                async for message in honest.messages:
                    assert decode_reply(message.payload).status == "accepted"  # type: ignore[arg-type]
                    break
    finally:
        kill(proc)
