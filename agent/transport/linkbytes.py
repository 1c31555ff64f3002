"""What a broker connection costs on the air: from the kernel's own counters (Linux TCP_INFO) on a
device, from a model of MQTT v5 over TLS in the simulator (`AirModel`).

`read_tcp(sock)` gives the bytes the kernel sent and received on one TCP connection (TLS
records included: it counts what left the socket) and its segments each way. `LinkCounters`
adds them up over a transport's connections. On the air each segment also carries the IP and
TCP headers: `TCP_IP_HEADER_BYTES` (IPv4 20 + TCP 20 + the timestamp option 12), which is what
`ss -ti` counts as well. Elsewhere than Linux `read_tcp` returns None and nothing is counted.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

TCP_IP_HEADER_BYTES = 52

# struct tcp_info (linux/tcp.h): the offsets of the counters used here
_BYTES_ACKED = 120  # u64, since Linux 4.1
_BYTES_RECEIVED = 128  # u64
_SEGS_OUT = 136  # u32, since 4.2
_SEGS_IN = 140  # u32
_BYTES_SENT = 200  # u64, since 4.19 (retransmissions included; before: bytes acked)
_INFO_LEN = 232


@dataclass(frozen=True, slots=True)
class TcpCounters:
    bytes_sent: int = 0
    bytes_received: int = 0
    segs_out: int = 0
    segs_in: int = 0

    def __add__(self, other: TcpCounters) -> TcpCounters:
        return TcpCounters(self.bytes_sent + other.bytes_sent, self.bytes_received + other.bytes_received,
                           self.segs_out + other.segs_out, self.segs_in + other.segs_in)

    @property
    def on_air(self) -> int:
        """Bytes on the wire both ways: payload (TLS included) plus the IP/TCP headers."""
        return self.bytes_sent + self.bytes_received + TCP_IP_HEADER_BYTES * (self.segs_out + self.segs_in)


def read_tcp(sock: object) -> TcpCounters | None:
    """The kernel's counters of an open TCP socket; None when it is closed or not TCP, or the
    system does not keep them."""
    getsockopt = getattr(sock, "getsockopt", None)
    option = getattr(socket, "TCP_INFO", None)
    if getsockopt is None or option is None:
        return None
    try:
        info = getsockopt(socket.IPPROTO_TCP, option, _INFO_LEN)
    except (OSError, ValueError):
        return None
    if len(info) < _SEGS_IN + 4:
        return None
    sent = struct.unpack_from("=Q", info, _BYTES_SENT if len(info) >= _BYTES_SENT + 8 else _BYTES_ACKED)[0]
    received = struct.unpack_from("=Q", info, _BYTES_RECEIVED)[0]
    segs_out, segs_in = struct.unpack_from("=II", info, _SEGS_OUT)
    return TcpCounters(int(sent), int(received), int(segs_out), int(segs_in))


class LinkCounters:
    """The counters of every connection a transport made: the ended ones as last read, plus
    the current one. A connection is read when it is replaced, when it ends (if its socket is
    still open then) and whenever `total()` is asked, so what an ended connection moved after
    its last reading is not counted."""

    def __init__(self) -> None:
        self._ended = TcpCounters()
        self._sock: object | None = None
        self._last = TcpCounters()

    def attach(self, sock: object | None) -> None:
        """A new connection's socket (None: the connection ended)."""
        if sock is self._sock:
            return
        self._read()
        self._ended = self._ended + self._last
        self._sock, self._last = sock, TcpCounters()
        self._read()

    def _read(self) -> None:
        if self._sock is not None:
            found = read_tcp(self._sock)
            if found is not None:
                self._last = found

    def total(self) -> TcpCounters:
        self._read()
        return self._ended + self._last


# -- the simulator's model of the same counters -------------------------------------------------
TLS_RECORD_BYTES = 29  # TLS 1.2 AES-GCM: 5 header + 8 explicit nonce + 16 tag (the shipped broker's)
PUBACK_BYTES = 4  # MQTT v5, success without properties
PING_BYTES = 2  # PINGREQ, PINGRESP
# A connection's start: the TLS 1.2 handshake, CONNECT and CONNACK, the subscriptions, the birth,
# the first heartbeat: 4,615 bytes on the air by scripts/bench_air.py on the shipped broker (ECDSA
# P-256 certificates; an RSA chain adds about 2 KB), taken here as 20 segments and their payload.
CONNECT_SEGMENTS = 20
CONNECT_BYTES = 4_600 - TCP_IP_HEADER_BYTES * CONNECT_SEGMENTS


def _varint_len(n: int) -> int:
    size = 1
    while n >= 128:
        n >>= 7
        size += 1
    return size


def publish_bytes(topic: str, payload: int, *, qos: int, response_topic: str | None = None,
                  correlation: bytes | None = None, expiry: bool = False) -> int:
    """The size of one MQTT v5 PUBLISH packet."""
    props = 0
    if response_topic is not None:
        props += 3 + (len(response_topic) if response_topic.isascii() else len(response_topic.encode()))
    if correlation is not None:
        props += 3 + len(correlation)
    if expiry:
        props += 5
    topic_len = len(topic) if topic.isascii() else len(topic.encode())
    rest = 2 + topic_len + (2 if qos else 0) + (1 if props < 128 else _varint_len(props)) + props + payload
    return 1 + _varint_len(rest) + rest


class AirModel:
    """What one client's broker connection would cost over TLS: every MQTT packet a TLS record
    in a segment of its own, a pure ACK closing each exchange, a PINGREQ/PINGRESP pair for every
    `keepalive_s` the connection stays silent, and `CONNECT_BYTES` a reconnection. A model (the
    simulator has no sockets), checked against the kernel's counters by scripts/bench_air.py."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
        self.sent = 0
        self.received = 0
        self.segs_out = 0
        self.segs_in = 0
        self.pings = 0
        self.connects = 0
        self._last: float | None = None  # the last packet either way, while connected

    def _pings_until(self, now: float) -> int:
        """The keep-alive pings of the silence since the last packet, up to `now`."""
        if self._last is None or self.keepalive_s <= 0:
            return 0
        return int((now - self._last) // self.keepalive_s)

    @staticmethod
    def _ping_counters(pings: int) -> TcpCounters:
        """What `pings` PINGREQ/PINGRESP exchanges cost: the request, the response, the ACK of it."""
        size = pings * (PING_BYTES + TLS_RECORD_BYTES)
        return TcpCounters(size, size, pings * 2, pings)

    def _quiet_until(self, now: float) -> None:
        pings = self._pings_until(now)
        if pings > 0:
            cost = self._ping_counters(pings)
            self.pings += pings
            self.sent += cost.bytes_sent
            self.received += cost.bytes_received
            self.segs_out += cost.segs_out
            self.segs_in += cost.segs_in
        self._last = now

    def connected(self, now: float) -> None:
        """A connection's start; the first one is not counted (paid once a boot: a figure per
        day extrapolated from a short run would be mostly that)."""
        self._last = now
        self.connects += 1
        if self.connects == 1:
            return
        self.sent += CONNECT_BYTES // 3
        self.received += CONNECT_BYTES - CONNECT_BYTES // 3
        self.segs_out += CONNECT_SEGMENTS // 2
        self.segs_in += CONNECT_SEGMENTS - CONNECT_SEGMENTS // 2

    def ended(self, now: float) -> None:
        self._quiet_until(now)
        self._last = None

    def publish_out(self, now: float, size: int, qos: int) -> None:
        self._quiet_until(now)
        self.sent += size + TLS_RECORD_BYTES
        self.segs_out += 1
        if qos:
            self.received += PUBACK_BYTES + TLS_RECORD_BYTES
            self.segs_in += 1

    def publish_in(self, now: float, size: int, qos: int) -> None:
        self._quiet_until(now)
        self.received += size + TLS_RECORD_BYTES
        self.segs_in += 1
        if qos:  # our PUBACK, and the broker's ACK of it
            self.sent += PUBACK_BYTES + TLS_RECORD_BYTES
            self.segs_out += 1
            self.segs_in += 1
        else:  # our ACK
            self.segs_out += 1

    def total(self, now: float) -> TcpCounters:
        """The counters as of `now`, the pings of a silence still running included. A reading
        changes nothing: the silence goes on from the last packet (reading it every few seconds
        must not lose the pings of the keep-alive)."""
        return (TcpCounters(self.sent, self.received, self.segs_out, self.segs_in)
                + self._ping_counters(self._pings_until(now)))


__all__ = ["CONNECT_BYTES", "TCP_IP_HEADER_BYTES", "TLS_RECORD_BYTES", "AirModel", "LinkCounters", "TcpCounters",
           "publish_bytes", "read_tcp"]
