"""Lean paths through paho for the packets that dominate our traffic. Used by `mqtt.py` only.

paho's generic code costs more than the rest of an agent per message: a PUBLISH is read with
three `recv` calls, its MQTT v5 properties become a `Properties` object, an `MQTTMessage` and
an aiomqtt `Message` are built and matched against callback filters; a PUBACK builds a
`ReasonCode` and a `Properties`; every packet queued for sending pokes a socketpair nobody reads
and is written with its own `send`. `FastPath` installs itself on one paho client (one
connection) and replaces exactly these steps:

* reading: a buffered `_sock_recv` (one `recv` of up to 64 KiB serves many packets) and our own
  reader callback, which can pause reading while the transport's inbound queue is full (the
  broker then holds the rest: backpressure, nothing dropped);
* PUBLISH QoS 0/1 in: parsed here (topic, packet id, ResponseTopic, CorrelationData) and handed
  to `deliver` with the packet id the transport acknowledges later. Anything unusual (QoS 2,
  a property we do not parse, a topic that is not UTF-8) goes through paho's own handler;
* PUBACK in: packet id and reason code read directly, paho's bookkeeping (`_do_on_publish`)
  kept, the reason code passed on as an int;
* writing: queued packets are sent in one `send` where the socket takes them.

Outgoing properties are pre-encoded bytes (`PackedProperties`), which paho only ever `pack()`s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from paho.mqtt.client import Client as PahoClient
from paho.mqtt.client import time_func
from paho.mqtt.enums import MQTTErrorCode

from agent.core.errors import TransportError
from agent.transport.base import InboundMessage

log = logging.getLogger(__name__)

_SUCCESS = MQTTErrorCode.MQTT_ERR_SUCCESS
_AGAIN = MQTTErrorCode.MQTT_ERR_AGAIN
_CONN_LOST = MQTTErrorCode.MQTT_ERR_CONN_LOST
_PUBLISH = 0x30
_PUBACK = 0x40
_DISCONNECT = 0xE0
_RECV_BYTES = 65536
_WRITE_BATCH_BYTES = 256 * 1024
_READS_PER_TURN = 64  # loop_read calls per event-loop turn before yielding to other callbacks
# Every paho internal these paths use (paho-mqtt 2.2), checked on each client before the lean
# paths go in (`unsupported`): a paho that moved one gets aiomqtt's own path instead.
_PAHO_INTERNALS = (
    "_handle_publish", "_handle_pubackcomp", "_sock_recv", "_packet_write", "_packet_queue", "_in_packet",
    "_out_packet", "_out_messages", "_out_message_mutex", "_do_on_publish", "_mid_generate", "_sock",
    "_sock_send", "_sockpairW", "_msgtime_mutex", "_last_msg_out", "_userdata",
)
# The keys of paho's packet dicts read here (`_in_packet`, and the queued `_out_packet` entries,
# which paho builds with the same names).
_PACKET_KEYS = ("command", "packet", "pos", "to_process")

# MQTT v5 PUBLISH properties by identifier: how many bytes follow (or a kind of field).
_FIXED = {0x01: 1, 0x02: 4, 0x23: 2}  # payload format, message expiry, topic alias
_BINARY = {0x03, 0x08, 0x09}  # content type, response topic, correlation data (2-byte length)
_VARINT = {0x0B}  # subscription identifier
_PAIR = {0x26}  # user property


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = n >> 7, n & 0x7F
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


class _Unwatched:
    """Stands in for paho's `MQTTMessageInfo` (a lock and a condition each) on a QoS 0 publish
    nobody waits for."""

    __slots__ = ()

    def _set_as_published(self) -> None:
        return None


UNWATCHED: Any = _Unwatched()


class PackedProperties:
    """MQTT v5 PUBLISH properties already encoded; stands in for paho's `Properties`."""

    __slots__ = ("_packed",)

    def __init__(self, packed: bytes) -> None:
        self._packed = packed

    def pack(self) -> bytes:
        return self._packed

    def __str__(self) -> str:
        return f"[{len(self._packed)} bytes of properties]"


class PropertiesCache:
    """Encodes ResponseTopic/CorrelationData; the response-topic part is built once per topic."""

    def __init__(self, limit: int = 1024) -> None:
        self._limit = limit
        self._topics: dict[str, bytes] = {}

    def build(self, response_topic: str | None, correlation: bytes | None,
              expiry_s: int | None = None) -> PackedProperties:
        body = b"" if expiry_s is None else b"\x02" + expiry_s.to_bytes(4, "big")
        if response_topic is not None:
            part = self._topics.get(response_topic)
            if part is None:
                data = response_topic.encode("utf-8")
                part = b"\x08" + len(data).to_bytes(2, "big") + data
                if len(self._topics) >= self._limit:
                    self._topics.clear()
                self._topics[response_topic] = part
            body += part
        if correlation is not None:
            body += b"\x09" + len(correlation).to_bytes(2, "big") + correlation
        return PackedProperties(varint(len(body)) + body)


def parse_publish(header: int, packet: bytes | bytearray) -> tuple[InboundMessage, int] | None:
    """An inbound PUBLISH (QoS 0/1) as an `InboundMessage` and its packet id, or None for
    anything paho's own handler should see (QoS 2, unknown property, bad UTF-8, truncation)."""
    qos = (header >> 1) & 0x03
    if qos > 1:
        return None
    n = len(packet)
    if n < 2:
        return None
    end_topic = 2 + ((packet[0] << 8) | packet[1])
    if end_topic > n:
        return None
    try:
        topic = packet[2:end_topic].decode("utf-8")
    except UnicodeDecodeError:
        return None
    pos = end_topic
    mid = 0
    if qos:
        if pos + 2 > n:
            return None
        mid = (packet[pos] << 8) | packet[pos + 1]
        pos += 2
    # property length (variable byte integer)
    plen = 0
    shift = 0
    while True:
        if pos >= n or shift > 21:
            return None
        byte = packet[pos]
        pos += 1
        plen |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    end = pos + plen
    if end > n:
        return None
    response_topic: str | None = None
    correlation: bytes | None = None
    while pos < end:
        ident = packet[pos]
        pos += 1
        if ident in _BINARY:
            if pos + 2 > end:
                return None
            size = (packet[pos] << 8) | packet[pos + 1]
            pos += 2
            if pos + size > end:
                return None
            if ident == 0x08:
                try:
                    response_topic = packet[pos:pos + size].decode("utf-8")
                except UnicodeDecodeError:
                    return None
            elif ident == 0x09:
                correlation = bytes(packet[pos:pos + size])
            pos += size
        elif ident in _FIXED:
            if ident == 0x23:
                return None  # a topic alias needs paho's alias table
            pos += _FIXED[ident]
        elif ident in _VARINT:
            while pos < end and packet[pos] & 0x80:
                pos += 1
            pos += 1
        elif ident in _PAIR:
            for _ in range(2):
                if pos + 2 > end:
                    return None
                pos += 2 + ((packet[pos] << 8) | packet[pos + 1])
        else:
            return None
    if pos != end:
        return None
    message = InboundMessage(topic, bytes(packet[end:]), bool(header & 0x01), response_topic, correlation, qos)
    return message, mid


Deliver = Callable[[InboundMessage, int], None]  # (message, packet id; 0 for QoS 0)
Acked = Callable[[int, int], None]  # (packet id, reason code) of a PUBACK for `publish_qos1`


def unsupported(paho: PahoClient) -> str | None:
    """Why the lean paths cannot go into `paho` (the internals it lacks), or None."""
    missing = [name for name in _PAHO_INTERNALS if not hasattr(paho, name)]
    in_packet = getattr(paho, "_in_packet", None)
    if isinstance(in_packet, dict):
        missing += [f"_in_packet[{key!r}]" for key in _PACKET_KEYS if key not in in_packet]
    elif "_in_packet" not in missing:
        missing.append("_in_packet (a dict)")
    return f"no {', '.join(missing)}" if missing else None


class FastPath:
    """The lean paths on one paho client (one connection). Create it before connecting, and only
    on a client `unsupported` finds nothing wrong with."""

    def __init__(
        self,
        paho: PahoClient,
        *,
        loop: asyncio.AbstractEventLoop,
        deliver: Deliver,
        acked: Acked,
        on_read_error: Callable[[BaseException], None],
    ) -> None:
        problem = unsupported(paho)
        if problem is not None:
            raise TransportError(f"unsupported paho-mqtt version: {problem}")
        self._paho = paho
        self._loop = loop
        self._deliver = deliver
        self._acked = acked
        self._on_read_error = on_read_error
        self._buf = bytearray()
        self._eagain = False
        self._fd = -1
        self._open = False
        self.paused = False
        self.pauses = 0
        p: Any = paho
        self._stock_publish: Callable[[], MQTTErrorCode] = p._handle_publish
        self._stock_puback: Callable[[str], MQTTErrorCode] = p._handle_pubackcomp
        self._stock_recv = p._sock_recv
        self._stock_write: Callable[[], MQTTErrorCode] = p._packet_write
        p._handle_publish = self._handle_publish
        p._handle_pubackcomp = self._handle_pubackcomp
        p._sock_recv = self._recv
        p._packet_write = self._packet_write
        stock_open = paho.on_socket_open
        stock_close = paho.on_socket_close

        def on_socket_open(client: Any, userdata: Any, sock: Any) -> None:
            if stock_open is not None:
                stock_open(client, userdata, sock)  # aiomqtt: its reader, its misc task
            loop.call_soon_threadsafe(self._take_over_reading, sock.fileno())

        def on_socket_close(client: Any, userdata: Any, sock: Any) -> None:
            self._open = False
            if stock_close is not None:
                stock_close(client, userdata, sock)

        paho.on_socket_open = on_socket_open
        paho.on_socket_close = on_socket_close

    # -- reading ---------------------------------------------------------------------------
    def _take_over_reading(self, fd: int) -> None:
        """Runs on the loop after aiomqtt registered its reader: replace it with ours."""
        paho: Any = self._paho
        if paho._sock is None or fd < 0:
            return
        writer = paho._sockpairW  # only wakes paho's own threaded loop, which we never run
        if writer is not None:
            paho._sockpairW = None
            writer.close()
        self._fd = fd
        self._open = True
        if not self.paused:
            self._loop.add_reader(fd, self._on_readable)
        self._loop.call_soon(self._on_readable)  # anything aiomqtt's reader left in our buffer

    def pause(self) -> None:
        if self.paused:
            return
        self.paused = True
        self.pauses += 1
        if self._open:
            self._loop.remove_reader(self._fd)

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        if self._open:
            self._loop.add_reader(self._fd, self._on_readable)
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        if not self._open or self.paused:
            return
        paho = self._paho
        try:
            for _ in range(_READS_PER_TURN):
                self._eagain = False
                if paho.loop_read() != _SUCCESS:
                    return  # paho closed the connection and told aiomqtt
                if self._eagain or not self._open or self.paused:
                    return
        except Exception as exc:  # what aiomqtt's own reader does: end the connection
            self._on_read_error(exc)
            return
        self._loop.call_soon(self._on_readable)  # more ready: let other callbacks run first

    def _recv(self, bufsize: int) -> bytes:
        buf = self._buf
        if not buf:
            try:
                data = self._stock_recv(_RECV_BYTES)
            except BlockingIOError:
                self._eagain = True
                raise
            if len(data) <= bufsize:
                return data
            buf += data
        if len(buf) <= bufsize:
            data = bytes(buf)
            buf.clear()
            return data
        data = bytes(buf[:bufsize])
        del buf[:bufsize]
        return data

    # -- inbound packets -------------------------------------------------------------------
    def _handle_publish(self) -> MQTTErrorCode:
        paho: Any = self._paho
        packet = paho._in_packet
        parsed = parse_publish(packet["command"], packet["packet"])
        if parsed is None:
            return self._stock_publish()
        message, mid = parsed
        self._deliver(message, mid)  # acknowledged by the transport once dispatched
        return _SUCCESS

    def _handle_pubackcomp(self, cmd: str) -> MQTTErrorCode:
        paho: Any = self._paho
        packet = paho._in_packet["packet"]
        if cmd != "PUBACK" or len(packet) < 2:
            return self._stock_puback(cmd)
        mid = (packet[0] << 8) | packet[1]
        reason = packet[2] if len(packet) > 2 else 0
        with paho._out_message_mutex:
            if mid in paho._out_messages:  # published through paho (aiomqtt's birth message)
                done: MQTTErrorCode = paho._do_on_publish(mid, reason, None)
                return done
        self._acked(mid, reason)
        return _SUCCESS

    # -- writing ---------------------------------------------------------------------------
    def publish(self, topic: str, payload: bytes, qos: int, retain: bool,
                properties: PackedProperties | None) -> int | None:
        """Queue a QoS 0 or 1 PUBLISH built here (no `MQTTMessage`, no `MQTTMessageInfo`).
        Returns the packet id (0 for QoS 0; a QoS 1 PUBACK comes back through `acked`), or None
        if the connection is gone. The caller validated the topic and keeps the in-flight
        count within the broker's receive maximum."""
        paho: Any = self._paho
        if paho._sock is None:
            return None
        data = topic.encode("utf-8")
        props = properties.pack() if properties is not None else b"\x00"
        remaining = 2 + len(data) + len(props) + len(payload)
        header = _PUBLISH | (qos << 1) | (1 if retain else 0)
        parts: tuple[bytes, ...]
        if qos:
            mid = paho._mid_generate()
            parts = (bytes((header,)), varint(remaining + 2), len(data).to_bytes(2, "big"), data,
                     mid.to_bytes(2, "big"), props, payload)
        else:
            mid = 0
            parts = (bytes((header,)), varint(remaining), len(data).to_bytes(2, "big"), data, props, payload)
        paho._packet_queue(_PUBLISH, b"".join(parts), mid, qos, UNWATCHED)
        return int(mid)

    def _packet_write(self) -> MQTTErrorCode:
        """paho's `_packet_write`, but consecutive PUBLISH/PUBACK packets go in one `send`."""
        paho: Any = self._paho
        out = paho._out_packet
        while out:
            parts: list[bytes] = []
            size = 0
            for packet in out:
                if packet["command"] & 0xF0 not in (_PUBLISH, _PUBACK) or size >= _WRITE_BATCH_BYTES:
                    break
                data = packet["packet"]
                parts.append(data[packet["pos"]:] if packet["pos"] else data)
                size += packet["to_process"]
            if not parts:
                return self._stock_write()
            try:
                written = paho._sock_send(b"".join(parts))
            except (AttributeError, ValueError):
                return _SUCCESS
            except BlockingIOError:
                return _AGAIN
            except OSError as exc:
                log.debug("send failed: %s", exc)
                return _CONN_LOST
            if written <= 0:
                break
            on_publish = paho.on_publish
            while written > 0 and out:
                packet = out[0]
                step = min(written, packet["to_process"])
                packet["to_process"] -= step
                packet["pos"] += step
                written -= step
                if packet["to_process"]:
                    break  # partly written: the rest goes first next time
                out.popleft()
                if packet["command"] & 0xF0 == _PUBLISH and packet["qos"] == 0:
                    info = packet["info"]
                    if info is not UNWATCHED:
                        if on_publish is not None:
                            on_publish(paho, paho._userdata, packet["mid"], 0, None)
                        info._set_as_published()
            if out and out[0]["pos"]:
                break  # the socket took part of a packet: it is full for now
        with paho._msgtime_mutex:
            paho._last_msg_out = time_func()
        return _SUCCESS


__all__ = ["FastPath", "PackedProperties", "PropertiesCache", "parse_publish", "varint"]
