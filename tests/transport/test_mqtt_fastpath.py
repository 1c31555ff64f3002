"""The MQTT transport's lean paths: PUBLISH parsing, pre-encoded properties, the bounded inbound
queue (reading pauses, nothing is dropped), acknowledgement after dispatch, and rate-limited
connection-failure logs."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.core.errors import TransportError
from agent.transport._paho_fast import PropertiesCache, parse_publish, varint
from agent.transport.base import InboundMessage
from agent.transport.mqtt import MqttTransport

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from mosquitto import Mosquitto, free_port  # noqa: E402


def _publish_body(topic: str, payload: bytes, *, qos: int, mid: int = 7, props: bytes = b"\x00") -> bytes:
    data = topic.encode()
    body = len(data).to_bytes(2, "big") + data
    if qos:
        body += mid.to_bytes(2, "big")
    return body + props + payload


# -- parsing ----------------------------------------------------------------------------------


def test_parse_publish_reads_topic_id_and_the_reply_properties() -> None:
    props = PropertiesCache().build("r/t", b"corr-1").pack()
    parsed = parse_publish(0x32 | 0x01, _publish_body("a/b", b"hello", qos=1, mid=513, props=props))
    assert parsed == (InboundMessage("a/b", b"hello", True, "r/t", b"corr-1", 1), 513)
    parsed = parse_publish(0x30, _publish_body("a/b", b"", qos=0))
    assert parsed == (InboundMessage("a/b", b"", False, None, None, 0), 0)


def test_packed_properties_match_what_paho_encodes() -> None:
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = "ea/v1/f/d/reply/relay"
    props.CorrelationData = b"01J-abc"
    ours = PropertiesCache().build("ea/v1/f/d/reply/relay", b"01J-abc").pack()
    assert ours == props.pack()
    assert PropertiesCache().build(None, None).pack() == b"\x00"
    props.MessageExpiryInterval = 600
    ours = PropertiesCache().build("ea/v1/f/d/reply/relay", b"01J-abc", 600).pack()
    assert ours == props.pack()  # paho writes the expiry first, as we do


def test_parse_publish_skips_properties_it_does_not_need() -> None:
    inner = (b"\x01\x01" + b"\x02\x00\x00\x00\x3c" + b"\x0b\x81\x01"
             + b"\x26\x00\x01k\x00\x01v" + b"\x03\x00\x04text" + b"\x08\x00\x01r")
    props = varint(len(inner)) + inner
    parsed = parse_publish(0x32, _publish_body("t", b"p", qos=1, props=props))
    assert parsed is not None
    assert parsed[0].response_topic == "r" and parsed[0].payload == b"p"


@pytest.mark.parametrize(
    ("header", "body"),
    [
        (0x34, _publish_body("t", b"p", qos=2)),  # QoS 2: paho's own handler
        (0x30, _publish_body("t", b"p", qos=0, props=b"\x03\x23\x00\x01")),  # topic alias
        (0x30, _publish_body("t", b"p", qos=0, props=b"\x02\x7f\x00")),  # unknown property
        (0x30, b"\x00\x02\xff\xfe" + b"\x00"),  # topic not UTF-8
        (0x30, b"\x00\x09ab"),  # truncated topic
        (0x32, b"\x00\x01t\x00"),  # truncated packet id
        (0x30, _publish_body("t", b"", qos=0, props=b"\x05\x08\x00\x09r")),  # property overruns
    ],
)
def test_parse_publish_leaves_anything_unusual_to_paho(header: int, body: bytes) -> None:
    assert parse_publish(header, body) is None


def test_properties_cache_stays_bounded() -> None:
    cache = PropertiesCache(limit=4)
    for n in range(20):
        cache.build(f"t/{n}", None)
    assert len(cache._topics) <= 4


# -- against mosquitto ------------------------------------------------------------------------


def _transport(url: str, client_id: str, **kwargs: object) -> MqttTransport:
    return MqttTransport.from_url(url, client_id=client_id, reconnect_min_s=0.05, reconnect_max_s=0.3,
                                  **kwargs)  # type: ignore[arg-type]


async def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait until `condition()` holds (looked at after every loop turn that let I/O in); the
    timeout only bounds a failure."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout_s}s") from None


async def test_a_full_inbound_queue_pauses_reading_and_loses_nothing(mosquitto: Mosquitto) -> None:
    release = asyncio.Event()
    got: list[bytes] = []
    done = asyncio.Event()
    total = 300

    async def slow(message: InboundMessage) -> None:
        await release.wait()
        got.append(message.payload)
        if len(got) == total:
            done.set()

    sub = _transport(mosquitto.url, "fp-sub", inbound_capacity=8)
    pub = _transport(mosquitto.url, "fp-pub")
    await sub.subscribe("fp/t", slow)
    for t in (sub, pub):
        await t.start()
        await asyncio.wait_for(t.connected.wait_open(), 10)
    try:
        await asyncio.gather(*[pub.publish("fp/t", str(n).encode(), qos=1) for n in range(total)])
        await eventually(lambda: sub.inbound_pauses > 0, "the full queue paused reading")
        release.set()
        await asyncio.wait_for(done.wait(), 20)
        assert got == [str(n).encode() for n in range(total)]  # in order, none lost, none twice
        # capacity, plus at most the packets of one read (paho reads up to its in-flight count)
        assert sub.inbound_high_water <= 8 + 100 + 1
    finally:
        await pub.stop()
        await sub.stop()


async def test_a_message_not_yet_dispatched_at_stop_is_redelivered_to_the_session(mosquitto: Mosquitto) -> None:
    """QoS 1 is acknowledged only once dispatched: what was still queued at stop comes back."""
    blocked = asyncio.Event()
    seen: list[bytes] = []

    async def stuck(message: InboundMessage) -> None:
        seen.append(message.payload)
        blocked.set()
        await asyncio.Event().wait()  # never returns: the next messages stay queued

    first = _transport(mosquitto.url, "fp-session")
    pub = _transport(mosquitto.url, "fp-pub2")
    await first.subscribe("fp/s", stuck)
    for t in (first, pub):
        await t.start()
        await asyncio.wait_for(t.connected.wait_open(), 10)
    await pub.publish("fp/s", b"one", qos=1)
    await pub.publish("fp/s", b"two", qos=1)
    await asyncio.wait_for(blocked.wait(), 10)
    await eventually(lambda: len(first._inbound) == 1, '"two" waits in the inbound queue')
    await first.stop()

    again: list[bytes] = []
    arrived = asyncio.Event()

    async def collect(message: InboundMessage) -> None:
        again.append(message.payload)
        if b"two" in again:
            arrived.set()

    second = _transport(mosquitto.url, "fp-session")
    await second.subscribe("fp/s", collect)
    await second.start()
    try:
        await asyncio.wait_for(arrived.wait(), 10)
        assert seen == [b"one"]
        assert b"two" in again
    finally:
        await pub.stop()
        await second.stop()


async def test_unsubscribe_does_not_wait_for_the_broker(mosquitto: Mosquitto) -> None:
    got: list[bytes] = []

    async def handler(message: InboundMessage) -> None:
        got.append(message.payload)

    synced = asyncio.Event()

    async def sync(message: InboundMessage) -> None:
        synced.set()

    t = _transport(mosquitto.url, "fp-unsub")
    await t.subscribe("fp/u", handler)
    await t.subscribe("fp/sync", sync)
    await t.start()
    await asyncio.wait_for(t.connected.wait_open(), 10)
    try:
        await t.publish("fp/u", b"a", qos=1)
        await eventually(lambda: got == [b"a"], "the first message arrived")
        await t.unsubscribe("fp/u")
        await t.publish("fp/u", b"b", qos=1)
        # The broker handles one connection's packets in order: once "sync" (published after
        # "b" on a topic still subscribed) is back, "b" has met the unsubscribe already.
        await t.publish("fp/sync", b"sync", qos=1)
        await asyncio.wait_for(synced.wait(), 30)
        assert got == [b"a"]
    finally:
        await t.stop()


async def test_qos1_publish_fails_with_our_error_when_the_connection_goes(mosquitto: Mosquitto) -> None:
    t = _transport(mosquitto.url, "fp-lost")
    await t.start()
    await asyncio.wait_for(t.connected.wait_open(), 10)
    try:
        mosquitto.stop()
        with pytest.raises(TransportError):
            while True:  # until the transport has seen the connection go (bounded by the test timeout)
                await t.publish("fp/l", b"x", qos=1)
                await asyncio.sleep(0.02)
    finally:
        mosquitto.start()
        await t.stop()


async def test_an_unexpected_paho_falls_back_to_aiomqtt_with_one_warning(
        mosquitto: Mosquitto, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """`fast_path = "auto"` on a paho without one of the internals the lean paths use: the agent
    connects anyway, on aiomqtt's own path, and says so once."""
    from agent.transport import _paho_fast

    monkeypatch.setattr(_paho_fast, "_PAHO_INTERNALS", (*_paho_fast._PAHO_INTERNALS, "_moved_in_a_later_paho"))
    got: list[bytes] = []
    arrived = asyncio.Event()

    async def handler(message: InboundMessage) -> None:
        got.append(message.payload)
        if len(got) == 2:
            arrived.set()

    t = _transport(mosquitto.url, "fp-fallback")
    with caplog.at_level(logging.WARNING, logger="agent.transport.mqtt"):
        await t.subscribe("fp/f", handler)
        await t.start()
        await asyncio.wait_for(t.connected.wait_open(), 10)
        try:
            assert not t.fast_path_active
            await t.publish("fp/f", b"qos1", qos=1)  # waits for its PUBACK through paho's callback
            await t.publish("fp/f", b"qos0", qos=0)
            await asyncio.wait_for(arrived.wait(), 30)
            assert sorted(got) == [b"qos0", b"qos1"]
        finally:
            await t.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "_moved_in_a_later_paho" in warnings[0] and "aiomqtt's own path" in warnings[0]


async def test_connection_failures_are_logged_once_then_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    t = MqttTransport(host="127.0.0.1", port=free_port(), client_id="fp-nobody",
                      reconnect_min_s=0.005, reconnect_max_s=0.01)
    with caplog.at_level(logging.DEBUG, logger="agent.transport.mqtt"):
        await t.start()
        for _ in range(500):
            debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "fp-nobody" in r.getMessage()]
            if len(debug) >= 5:
                break
            await asyncio.sleep(0.02)
        await t.stop()
    loud = [r for r in caplog.records if r.levelno >= logging.INFO and "fp-nobody" in r.getMessage()]
    quiet = [r for r in caplog.records if r.levelno == logging.DEBUG and "fp-nobody" in r.getMessage()]
    assert len(quiet) >= 5
    assert len(loud) == 1


async def _silent_broker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accepts the CONNECT, then reads everything and answers nothing (no PUBACK)."""
    await reader.read(4096)
    writer.write(b"\x20\x03\x00\x00\x00")  # CONNACK v5: success, no properties
    await writer.drain()
    try:
        while await reader.read(4096):
            pass
    finally:
        writer.close()


async def test_a_publish_without_puback_fails_after_the_operation_timeout() -> None:
    server = await asyncio.start_server(_silent_broker, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    t = MqttTransport(host="127.0.0.1", port=port, client_id="fp-silent", operation_timeout_s=0.3)
    try:
        await t.start()
        await asyncio.wait_for(t.connected.wait_open(), 10)
        with pytest.raises(TransportError, match="no PUBACK"):
            await asyncio.wait_for(t.publish("fp/silent", b"x", qos=1), 10)
        await t.publish("fp/silent", b"y", qos=0)  # QoS 0 needs no answer
    finally:
        await t.stop()
        server.close()
        await server.wait_closed()


async def test_qos1_publishes_stay_within_max_inflight(mosquitto: Mosquitto) -> None:
    t = _transport(mosquitto.url, "fp-window", max_inflight=3)
    await t.start()
    await asyncio.wait_for(t.connected.wait_open(), 10)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(t._pubacks))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(asyncio.gather(*[t.publish("fp/w", b"x", qos=1) for _ in range(60)]), 20)
        assert 0 < peak <= 3
    finally:
        watcher.cancel()
        await t.stop()


async def test_stop_under_a_backlog_does_not_wait_for_the_broker(mosquitto: Mosquitto) -> None:
    """Reading is paused behind a stuck handler: unsubscribe and stop must still finish (they
    used to wait for an UNSUBACK and a PUBACK queued behind thousands of messages)."""
    entered = asyncio.Event()

    async def stuck(message: InboundMessage) -> None:
        entered.set()
        await asyncio.Event().wait()

    sub = _transport(mosquitto.url, "fp-backlog", inbound_capacity=4, operation_timeout_s=30.0)
    pub = _transport(mosquitto.url, "fp-flood")
    await sub.subscribe("fp/b", stuck)
    for t in (sub, pub):
        await t.start()
        await asyncio.wait_for(t.connected.wait_open(), 10)
    try:
        await asyncio.gather(*[pub.publish("fp/b", b"x" * 100, qos=1) for _ in range(2000)])
        await asyncio.wait_for(entered.wait(), 10)
        assert sub.inbound_pauses > 0
        await asyncio.wait_for(sub.unsubscribe("fp/b"), 5)
        await asyncio.wait_for(sub.stop(), 5)
    finally:
        await pub.stop()
        await sub.stop()


async def test_a_publish_the_broker_refuses_is_counted_not_raised(
    mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path
) -> None:
    acl = tmp_path / "acl"
    acl.write_text("topic readwrite fp/ok\n")
    broker = mosquitto_factory(extra_config=f"acl_file {acl}")
    t = _transport(broker.url, "fp-acl")
    await t.start()
    await asyncio.wait_for(t.connected.wait_open(), 10)
    try:
        await t.publish("fp/ok", b"fine", qos=1)
        assert t.publishes_refused == 0
        await t.publish("fp/denied", b"refused", qos=1)  # PUBACK 0x87 (not authorized)
        assert t.publishes_refused == 1
    finally:
        await t.stop()


def test_a_paho_without_the_internals_we_use_is_refused_loudly() -> None:
    from agent.transport._paho_fast import FastPath

    with pytest.raises(TransportError, match="unsupported paho-mqtt version"):
        FastPath(object(), loop=None, deliver=lambda m, mid: None,  # type: ignore[arg-type]
                 acked=lambda mid, reason: None, on_read_error=lambda exc: None)


class _RecordingTransport:
    max_payload_bytes = 1024

    def __init__(self) -> None:
        from agent.core.gate import Gate

        self.published: list[tuple[str, bytes, int]] = []
        self.connected = Gate(is_open=True)

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                      response_topic: str | None = None, correlation: bytes | None = None) -> None:
        self.published.append((topic, payload, qos))

    def publish_nowait(self, topic: str, payload: bytes, *, correlation: bytes | None = None) -> None:
        self.published.append((topic, payload, 0))


async def test_forged_senders_are_each_answered_but_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    from agent.core.clock import VirtualClock
    from agent.core.codec import Envelope, decode_reply, encode
    from agent.transport.endpoint import EnvelopeInbox

    async def never(env: Envelope, message: InboundMessage) -> object:
        raise AssertionError("a forged envelope must not reach the handler")

    wire = _RecordingTransport()
    inbox = EnvelopeInbox(wire, topic_filter="ea/v1/f/+/up", handler=never, clock=VirtualClock())  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="agent.transport.endpoint"):
        for n in range(5):
            env = Envelope(id=f"m{n}", kind="telemetry", sender="mallory", receiver="leader")
            await inbox.handle(InboundMessage("ea/v1/f/alice/up", encode(env), False, "ea/v1/f/alice/reply/r", b"c", 1))
    assert [decode_reply(p).status for _, p, _ in wire.published] == ["rejected"] * 5
    assert all(qos == 0 for _, _, qos in wire.published)  # replies go at QoS 0 by default
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "rejected" in r.getMessage()]
    assert len(warnings) == 1
    assert inbox.stats.rejected == 5


def test_every_paho_internal_the_lean_paths_use_is_in_the_startup_check() -> None:
    """A paho that moved any of them must get aiomqtt's own path, never a half-working one."""
    import re

    from agent.transport import _paho_fast

    source = Path(_paho_fast.__file__).read_text()
    used = set(re.findall(r"\b(?:paho|p)\.(_[A-Za-z]\w*)", source))
    assert used == set(_paho_fast._PAHO_INTERNALS)
