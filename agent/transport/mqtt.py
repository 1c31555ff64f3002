"""`MqttTransport`: the `Transport` protocol on aiomqtt 2.x, MQTT v5, QoS 1.

One supervisor task owns the connection: connect (TLS, credentials, persistent session with a
session expiry interval, last will `offline` retained), re-subscribe every recorded filter,
publish the retained `online` birth message, open the `connected` gate, and wait for the
connection to end; then close the gate, fail publishes still waiting for their PUBACK with
`ConnectionLost`, and reconnect after an exponential backoff with full jitter.

Hot paths go around aiomqtt's per-message machinery (`_paho_fast.FastPath` on the paho client
of each connection): inbound PUBLISH packets are parsed into `InboundMessage`s and appended to a
bounded queue drained by one long-lived dispatch task; a publish goes straight to paho with
pre-encoded properties, and a QoS 1 publish waits on a future its PUBACK resolves
(`_mqtt_acks.PubackTracker`; a refusal by the broker is counted in `publishes_refused`).
aiomqtt still owns connecting, subscribing, the will, the keepalive and disconnects; its
message iterator is only used to learn that the connection ended.

`fast_path` ("auto", the default) checks each new paho client for every internal the lean
paths use (`_paho_fast.unsupported`); a paho that differs (a distribution's package, a new
release) gets aiomqtt's own path instead, with one WARNING, and the agent connects as usual.
`fast_path="off"` always takes that path: paho's own parser and `publish`, PUBACKs through its
`on_publish` callback, and no read pause (QoS 1 messages waiting for dispatch are then bounded
by the broker's in-flight window for the session, since they are acknowledged only once
dispatched). The only private names used on the stock path are aiomqtt's `Client._client` (its
paho client; `_AIOMQTT_INTERNALS`, checked at connect) and, for the lean paths' read errors,
`Client._disconnected`.

The inbound queue holds `inbound_capacity` messages (plus at most one read's worth): when it is
full the transport stops reading the socket until the dispatcher has drained half of it, so the
broker holds the rest (QoS 1 in the session; nothing is dropped here and nothing is acked that
was not queued). Connection failures are logged once, then at most every
`FAILURE_LOG_INTERVAL_S` with the number of attempts in between; the rest go to DEBUG.

No aiomqtt or paho type or exception leaves this module: failures surface as `NotConnected`,
`ConnectionLost`, `TransportError` or `ConfigError`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections import deque
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import urlsplit

import aiomqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.core.clock import Clock, SystemClock
from agent.core.config import MqttSection
from agent.core.errors import ConfigError, ConnectionLost, NotConnected, TransportError
from agent.core.gate import Gate
from agent.transport import topics
from agent.transport._mqtt_acks import FAILURE as _FAILURE
from agent.transport._mqtt_acks import PubackTracker
from agent.transport._mqtt_failures import classify, no_connack
from agent.transport._mqtt_settings import TlsSettings, backoff_delay, broker_address, credentials, read_password
from agent.transport._paho_fast import FastPath, PackedProperties, PropertiesCache, unsupported
from agent.transport.base import Handler, InboundMessage, PayloadTooLarge, Will
from agent.transport.linkbytes import LinkCounters, TcpCounters

log = logging.getLogger(__name__)


class _ConnectionEndsAtInfo(logging.Filter):
    """paho logs a connection the broker or the network ended ("failed to receive on socket:
    Connection reset by peer") at ERROR; the transport logs that same end as "connection ended"
    at INFO and reconnects, so paho's line is INFO too. Its other errors stay errors."""

    ENDS = ("failed to receive on socket", "timeout on socket", "failed to send")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and isinstance(record.msg, str) and record.msg.startswith(self.ENDS):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


#: The logger aiomqtt and paho write to: the product's name, the product's levels.
PAHO_LOG = logging.getLogger(f"{__name__}.paho")
PAHO_LOG.addFilter(_ConnectionEndsAtInfo())
_CONNECT_TIMED_OUT = "Operation timed out"  # aiomqtt's error when no CONNACK came in time

DEFAULT_SESSION_EXPIRY_S = 7 * 24 * 3600
FAILURE_LOG_INTERVAL_S = 60.0
# A connection the broker ends sooner than this after accepting it did not really work: the
# reconnect backoff goes on growing, and several in a row are reported (another client with the
# same client id takes the session over each time; mosquitto 2.0 says nothing about it).
SHORT_LIVED_S = 10.0
SHORT_LIVED_BEFORE_WARNING = 3
DEFAULT_INBOUND_CAPACITY = 1024
_ROUTE_CACHE = 65536  # topic -> handlers entries kept before the cache starts over
FastPathMode = Literal["auto", "off"]
PACKET_OVERHEAD_BYTES = 1024  # fixed header, topic and properties around a payload
# aiomqtt internals used on either path (aiomqtt 2.x), checked on every client made.
_PAHO_LOG_ERR = 8  # paho's MQTT_LOG_ERR
_AIOMQTT_INTERNALS = ("_client", "_disconnected")


class _Handoff(asyncio.Queue):  # type: ignore[type-arg]
    """Stands in for aiomqtt's incoming-message queue: each message goes straight to `sink`.

    Nothing is ever stored, so aiomqtt's message iterator waits on it only for the disconnect.
    """

    def __init__(self, sink: Any, maxsize: int = 0) -> None:
        super().__init__(maxsize=0)
        self._sink = sink

    def put_nowait(self, item: Any) -> None:
        self._sink(item)


class MqttTransport:
    """A reconnecting MQTT v5 client implementing the `Transport` protocol."""

    def __init__(
        self,
        *,
        host: str,
        port: int = 1883,
        client_id: str,
        clock: Clock | None = None,
        tls: TlsSettings | None = None,
        username: str | None = None,
        password: str | None = None,
        keepalive_s: int = 30,
        clean_start: bool = False,
        session_expiry_s: int = DEFAULT_SESSION_EXPIRY_S,
        will: Will | None = None,
        birth: Will | None = None,
        reconnect_min_s: float = 1.0,
        reconnect_max_s: float = 60.0,
        max_payload_bytes: int = 256 * 1024,
        operation_timeout_s: float = 10.0,
        max_inflight: int = 100,
        inbound_capacity: int = DEFAULT_INBOUND_CAPACITY,
        rng: random.Random | None = None,
        fast_path: FastPathMode = "auto",
    ) -> None:
        if fast_path not in ("auto", "off"):
            raise ConfigError("mqtt", "fast_path", f'must be "auto" or "off", got {fast_path!r}')
        if not client_id:
            raise ValueError("client_id must not be empty")
        if inbound_capacity < 1:
            raise ValueError("inbound_capacity must be >= 1")
        if not 0 < reconnect_min_s <= reconnect_max_s:
            raise ValueError("need 0 < reconnect_min_s <= reconnect_max_s")
        self._host = host
        self._port = port
        self._client_id = client_id
        self._clock = clock if clock is not None else SystemClock()
        self._tls_context = tls.context() if tls is not None else None
        self._username = username
        self._password = password
        self._keepalive_s = keepalive_s
        self._clean_start = clean_start
        self._session_expiry_s = session_expiry_s
        self.will = will
        self.birth = birth
        self._reconnect_min_s = reconnect_min_s
        self._reconnect_max_s = reconnect_max_s
        self._max_payload = max_payload_bytes
        self._timeout_s = operation_timeout_s
        self._max_inflight = max_inflight
        self._rng = rng if rng is not None else random.Random()
        self._gate = Gate()
        self._subs: dict[str, tuple[Handler, int]] = {}
        self._client: aiomqtt.Client | None = None
        self._paho: Any = None  # the connected client's paho client (while the gate is open)
        self._wire: Any = None  # the paho client of the newest connection (messages arrive on it)
        self._fast: FastPath | None = None
        self.link = LinkCounters()  # bytes and segments on the broker connections, from the kernel
        self._supervisor: asyncio.Task[None] | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        # (message, packet id to acknowledge or 0, the connection it came on)
        self._inbound: deque[tuple[InboundMessage, int, Any]] = deque()
        self._inbound_capacity = inbound_capacity
        self._wakeup: asyncio.Future[None] | None = None
        self._pubacks = PubackTracker(clock=self._clock, timeout_s=operation_timeout_s, max_inflight=max_inflight,
                                      name=repr(client_id))
        self._unsubscribes: set[int] = set()  # packet ids of UNSUBSCRIBEs nobody waits for
        self._props = PropertiesCache()
        self._routes: dict[str, tuple[Handler, ...]] = {}
        self._failures = 0  # consecutive failed connection attempts
        self._failures_held = 0  # failures logged at DEBUG since the last reported one
        self._failure_logged_at = float("-inf")
        self._short_lived = 0  # connections in a row the broker ended within SHORT_LIVED_S
        self._short_lived_logged_at = float("-inf")
        self.inbound_pauses = 0
        self.inbound_high_water = 0
        self._stopping = False
        self._connecting = False
        self._entered = False
        self._connect_done = asyncio.Event()
        self.connects = 0
        self.last_error: str | None = None
        self._fast_path_mode = fast_path
        self._fallback_warned = False
        self.fast_path_active = False  # whether the current connection runs the lean paths
        self._disconnect_code: int | None = None  # reason code of the broker's DISCONNECT
        self._socket_error: str | None = None  # the TLS error paho's read saw on this attempt

    # -- construction helpers --------------------------------------------------------------
    @classmethod
    def from_url(cls, url: str, *, client_id: str, **kwargs: Any) -> MqttTransport:
        """`mqtt://host[:port]` or `mqtts://host[:port]`; a username may be in the URL, never a
        password."""
        address = broker_address(url)
        parts = urlsplit(url)
        if parts.password is not None:
            raise ConfigError("mqtt", "url", "no password in the URL: use mqtt.password_file")
        if address.tls and kwargs.get("tls") is None:
            kwargs["tls"] = TlsSettings()
        if parts.username and kwargs.get("username") is None:
            kwargs["username"] = parts.username
        return cls(host=address.host, port=address.port, client_id=client_id, **kwargs)

    @classmethod
    def from_config(
        cls,
        section: MqttSection,
        *,
        client_id: str,
        will: Will | None = None,
        birth: Will | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        url: str | None = None,
    ) -> MqttTransport:
        """Build from the `[mqtt]` config section; `url` overrides `section.url` (--broker)."""
        target = url or section.url
        return cls.from_url(
            target,
            client_id=client_id,
            clock=clock,
            **credentials(target, username=section.username, password_file=section.password_file,
                          tls_ca=section.tls_ca, tls_cert=section.tls_cert, tls_key=section.tls_key),
            keepalive_s=section.keepalive_s,
            will=will,
            birth=birth,
            reconnect_min_s=section.reconnect_min_s,
            reconnect_max_s=section.reconnect_max_s,
            max_payload_bytes=section.max_payload_bytes,
            rng=rng,
            fast_path=section.fast_path,
        )

    # -- Transport protocol ----------------------------------------------------------------
    @property
    def client_id(self) -> str:
        return self._client_id

    @property
    def connected(self) -> Gate:
        return self._gate

    @property
    def publishes_refused(self) -> int:
        """QoS 1 publishes the broker answered with a failure reason code (an ACL, say)."""
        return self._pubacks.refused

    @property
    def max_payload_bytes(self) -> int:
        return self._max_payload

    async def start(self) -> None:
        if self._supervisor is not None:
            return
        self._stopping = False
        loop = asyncio.get_running_loop()
        self._dispatcher = loop.create_task(self._dispatch_loop(), name=f"mqtt-dispatch:{self._client_id}")
        self._supervisor = loop.create_task(self._run(), name=f"mqtt-connection:{self._client_id}")

    async def stop(self) -> None:
        """Clean disconnect: publish the will's message ourselves, then DISCONNECT (no will)."""
        if self._supervisor is None:
            return
        self._stopping = True
        paho = self._paho
        if paho is not None and self._gate.is_open and self.will is not None:
            # Written before the DISCONNECT on the same connection, so the broker has it first;
            # its PUBACK is not awaited (reading may be paused under a backlog).
            info = paho.publish(self.will.topic, self.will.payload, self.will.qos, self.will.retain)
            if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                log.debug("%s: goodbye not published: %s", self._client_id, info.rc)
        if self._connecting:
            self._connect_done.clear()
            try:
                await self._clock.wait_for(self._connect_done.wait(), self._timeout_s + 5.0)
            except TimeoutError:
                log.warning("%s: still connecting at stop", self._client_id)
        supervisor, self._supervisor = self._supervisor, None
        dispatcher, self._dispatcher = self._dispatcher, None
        for task in (supervisor, dispatcher):
            if task is not None:
                task.cancel()
                await _join(task)
        self._gate.close()
        self._inbound.clear()
        self._routes.clear()

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        expiry_s: int | None = None,
    ) -> None:
        if expiry_s is not None and not 0 < expiry_s < 2**32:
            raise TransportError(f"{self._client_id!r}: expiry_s must be between 1 and 2**32 - 1, got {expiry_s}")
        paho = self._checked(topic, payload, qos)
        if qos == 0:
            self._send_qos0(paho, topic, payload, retain, response_topic, correlation, expiry_s)
            return
        fast = self._fast
        if fast is None:
            await self._publish_stock(paho, topic, payload, retain, response_topic, correlation, expiry_s)
            return
        properties = self._packed_properties(response_topic, correlation, expiry_s)
        await self._pubacks.reserve()
        if self._fast is not fast:
            raise ConnectionLost(f"{self._client_id!r}: connection lost while publishing")
        mid = fast.publish(topic, payload, 1, retain, properties)
        if mid is None:
            raise ConnectionLost(f"{self._client_id!r}: connection lost while publishing")
        await self._pubacks.wait(mid)

    def publish_nowait(self, topic: str, payload: bytes, *, correlation: bytes | None = None) -> None:
        """QoS 0, not retained: written to the connection now (see `Transport.publish_nowait`)."""
        paho = self._checked(topic, payload, 0)
        self._send_qos0(paho, topic, payload, False, None, correlation, None)

    def _checked(self, topic: str, payload: bytes, qos: int) -> Any:
        """The paho client to publish through, once the payload, topic, QoS and connection are checked."""
        if len(payload) > self._max_payload:
            raise PayloadTooLarge(len(payload), self._max_payload)
        topics.validate_topic(topic)
        if qos not in (0, 1):
            raise TransportError(f"{self._client_id!r}: QoS {qos} is not supported")
        paho = self._paho
        if paho is None or not self._gate.is_open:
            raise NotConnected(f"{self._client_id!r} is not connected")
        return paho

    def _send_qos0(self, paho: Any, topic: str, payload: bytes, retain: bool, response_topic: str | None,
                   correlation: bytes | None, expiry_s: int | None) -> None:
        """Write a QoS 0 PUBLISH now: nothing acknowledges it, so nothing is awaited."""
        fast = self._fast
        if fast is None:
            info = paho.publish(topic, payload, qos=0, retain=retain,
                                properties=_stock_properties(response_topic, correlation, expiry_s))
            if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                raise ConnectionLost(f"{self._client_id!r}: connection lost while publishing ({info.rc})")
            return
        properties = self._packed_properties(response_topic, correlation, expiry_s)
        if fast.publish(topic, payload, 0, retain, properties) is None:
            raise ConnectionLost(f"{self._client_id!r}: connection lost while publishing")

    def _packed_properties(self, response_topic: str | None, correlation: bytes | None,
                           expiry_s: int | None) -> PackedProperties | None:
        """The PUBLISH properties for the fast path, pre-encoded (None when there are none)."""
        if response_topic is None and correlation is None and expiry_s is None:
            return None
        return self._props.build(response_topic, correlation, expiry_s)

    async def _publish_stock(self, paho: Any, topic: str, payload: bytes, retain: bool,
                             response_topic: str | None, correlation: bytes | None, expiry_s: int | None) -> None:
        """A QoS 1 publish through paho's own `publish`; its PUBACK comes back through `on_publish`."""
        await self._pubacks.reserve()
        if self._paho is not paho:
            raise ConnectionLost(f"{self._client_id!r}: connection lost while publishing")
        info = paho.publish(topic, payload, qos=1, retain=retain,
                            properties=_stock_properties(response_topic, correlation, expiry_s))
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise ConnectionLost(f"{self._client_id!r}: connection lost while publishing ({info.rc})")
        await self._pubacks.wait(info.mid)

    def link_bytes(self) -> TcpCounters | None:
        """What this transport's connections moved so far, as the kernel counts it (TLS
        included); None where the system does not say."""
        total = self.link.total()
        return None if total == TcpCounters() else total

    async def subscribe(self, topic_filter: str, handler: Handler, *, qos: int = 1) -> None:
        """Record the subscription; send it now if connected (else on the next connect)."""
        topics.validate_filter(topic_filter)
        self._subs[topic_filter] = (handler, qos)
        self._routes.clear()
        client = self._client
        if client is not None and self._gate.is_open:
            try:
                await self._send_subscribe(client, topic_filter, qos)
            except aiomqtt.MqttError as exc:
                # The connection is going away; the next connect sends the subscription again.
                log.info("%s: subscribe %r deferred: %s", self._client_id, topic_filter, exc)

    async def unsubscribe(self, topic_filter: str) -> None:
        """Forget the handler at once and send UNSUBSCRIBE without waiting for its UNSUBACK
        (which may sit behind a backlog). Messages already received for the filter are
        acknowledged and dropped, as after an UNSUBACK."""
        if self._subs.pop(topic_filter, None) is None:
            return
        self._routes.clear()
        paho = self._paho
        if paho is not None and self._gate.is_open:
            rc, mid = paho.unsubscribe(topic_filter)
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                log.info("%s: unsubscribe %r not sent: %s", self._client_id, topic_filter, rc)
            elif mid is not None:
                self._unsubscribes.add(mid)

    # -- connection supervisor -------------------------------------------------------------
    def _make_client(self) -> aiomqtt.Client:
        properties = Properties(PacketTypes.CONNECT)
        # A clean start asks for a throwaway session; otherwise the broker keeps ours (and queues
        # QoS 1 messages for it) for session_expiry_s after a disconnect.
        properties.SessionExpiryInterval = 0 if self._clean_start else self._session_expiry_s
        # MQTT v5 Maximum Packet Size: the broker does not send us a packet we would refuse
        # anyway (it drops it for us), so an oversized message never reaches our memory.
        properties.MaximumPacketSize = self._max_payload + PACKET_OVERHEAD_BYTES
        will = None
        if self.will is not None:
            will_properties = None
            if self.will.delay_s > 0:
                will_properties = Properties(PacketTypes.WILLMESSAGE)
                will_properties.WillDelayInterval = self.will.delay_s
            will = aiomqtt.Will(self.will.topic, self.will.payload, qos=self.will.qos, retain=self.will.retain,
                                properties=will_properties)
        client = aiomqtt.Client(
            self._host,
            self._port,
            identifier=self._client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            username=self._username,
            password=self._password,
            will=will,
            clean_start=self._clean_start,
            properties=properties,
            keepalive=self._keepalive_s,
            timeout=self._timeout_s,
            tls_context=self._tls_context,
            max_inflight_messages=self._max_inflight,
            # Request/reply is ping-pong of small packets: without this, Nagle and delayed ACKs
            # hold each one back by tens of milliseconds.
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            queue_type=lambda maxsize=0: _Handoff(self._on_message),  # type: ignore[arg-type]
            logger=PAHO_LOG,
        )
        client.pending_calls_threshold = 1 << 30  # many concurrent publishes are our normal
        missing = [name for name in _AIOMQTT_INTERNALS if not hasattr(client, name)]
        if missing:
            raise TransportError(f"unsupported aiomqtt version: no Client.{', Client.'.join(missing)}")
        paho: Any = client._client  # noqa: SLF001  (aiomqtt exposes no hook for these paths)
        self._wire = paho
        self._fast = None
        if self._fast_path_mode == "auto":
            problem = unsupported(paho)
            if problem is None:
                self._fast = FastPath(paho, loop=asyncio.get_running_loop(), deliver=self._accept,
                                      acked=self._pubacks.acked, on_read_error=lambda exc: _end_connection(client, exc))
            elif not self._fallback_warned:
                self._fallback_warned = True
                log.warning("%s: paho-mqtt's internals are not the ones the lean paths were written for (%s);"
                            " using aiomqtt's own path (set mqtt.fast_path = \"off\" to say so)",
                            self._client_id, problem)
        self.fast_path_active = self._fast is not None
        if self._fast is None:
            stock_on_publish = paho.on_publish
            acked = self._pubacks.acked

            def on_publish(c: Any, userdata: Any, mid: int, *rest: Any) -> None:
                reason = rest[0] if rest else 0
                acked(mid, int(getattr(reason, "value", reason)))
                stock_on_publish(c, userdata, mid, *rest)

            paho.on_publish = on_publish
        stock_on_unsubscribe = paho.on_unsubscribe
        unsubscribes = self._unsubscribes = set()  # this connection's

        def on_unsubscribe(c: Any, userdata: Any, mid: int, *rest: Any) -> None:
            if mid in unsubscribes:
                unsubscribes.discard(mid)
            else:
                stock_on_unsubscribe(c, userdata, mid, *rest)

        paho.on_unsubscribe = on_unsubscribe
        stock_on_disconnect = paho.on_disconnect

        def on_disconnect(c: Any, userdata: Any, flags: Any, reason: Any = None, *rest: Any) -> None:
            self._disconnect_code = getattr(reason, "value", None)
            stock_on_disconnect(c, userdata, flags, reason, *rest)

        paho.on_disconnect = on_disconnect

        def on_log(_c: Any, _userdata: Any, level: int, text: str) -> None:
            # with TLS 1.3 a broker refuses a client certificate (revoked, say) by an alert after
            # the handshake: only paho's next read sees it, and the connection ends as a time-out.
            # Only while connecting: `_run` takes it away once connected
            if level == _PAHO_LOG_ERR and "SSL" in text:
                self._socket_error = text

        paho.on_log = on_log
        paho.on_socket_register_write, paho.on_socket_unregister_write = _writer_callbacks(
            paho, asyncio.get_running_loop(), client)
        paho.manual_ack_set(True)  # QoS 1 messages are acknowledged once dispatched
        return client

    async def _run(self) -> None:
        attempt = 0
        while not self._stopping:
            client: aiomqtt.Client | None = None
            permanent = False
            opened_at: float | None = None
            self._disconnect_code = None
            self._socket_error = None
            try:
                client = self._make_client()
                await self._enter(client)
                self._client = client
                await self._sync_subscriptions(client, set())
                if self.birth is not None:
                    await client.publish(
                        self.birth.topic,
                        self.birth.payload,
                        qos=self.birth.qos,
                        retain=self.birth.retain,
                        timeout=self._timeout_s,
                    )
                self.connects += 1
                self.last_error = None
                self._paho = client._client  # noqa: SLF001
                self._paho.on_log = None  # (connected: paho formats each line it logs for on_log)
                self.link.attach(self._paho.socket())
                self._gate.open()
                opened_at = self._clock.monotonic()
                self._log_connected()
                async for _ in client.messages:  # returns only by raising on disconnect
                    pass
            except aiomqtt.MqttError as exc:
                self.last_error = str(exc)
                broker = f"{self._host}:{self._port}"
                if opened_at is None and str(exc) == _CONNECT_TIMED_OUT and self._tcp_open(client) \
                        and self._socket_error is None:
                    self._log_failure(logging.WARNING, no_connack(broker, self._timeout_s))
                else:
                    failure = classify(self._socket_error or str(exc), code=reason_code_of(exc),
                                       disconnect_code=self._disconnect_code, broker=broker, username=self._username)
                    permanent = failure.permanent
                    self._log_failure(failure.level, failure.text)
            except TransportError as exc:
                self.last_error = str(exc)
                self._log_failure(logging.WARNING, str(exc))
            except Exception as exc:  # keep the agent connected whatever a library throws
                self.last_error = repr(exc)
                log.exception("%s: unexpected connection failure", self._client_id)
            finally:
                self.link.attach(None)  # a last reading, while its socket is still open
                self._client = None
                self._paho = None
                self._fast = None
                self._gate.close()
                self._pubacks.fail_all(
                    lambda: ConnectionLost(f"{self._client_id!r}: connection lost while publishing"))
                if client is not None and self._entered:
                    await self._leave(client)
            if self._stopping:
                break
            if opened_at is not None:
                if self._clock.monotonic() - opened_at >= SHORT_LIVED_S:
                    attempt = self._short_lived = 0  # it worked: reconnect soon
                else:
                    self._note_short_lived()
            delay = backoff_delay(attempt, self._reconnect_min_s, self._reconnect_max_s, self._rng)
            if permanent:  # credentials, protocol, TLS: retrying soon will not help
                delay = self._reconnect_max_s
            attempt += 1
            await self._clock.sleep(delay)

    async def _enter(self, client: aiomqtt.Client) -> None:
        """Connect. Not cancellable: aiomqtt connects in a thread that a cancel would orphan,
        leaving a live connection behind; `stop` waits for this step instead."""
        self._connecting = True
        try:
            await asyncio.shield(client.__aenter__())
            self._entered = True
        finally:
            self._connecting = False
            self._connect_done.set()

    async def _leave(self, client: aiomqtt.Client) -> None:
        """DISCONNECT cleanly if still connected (the broker then does not publish the will)."""
        self._entered = False
        try:
            await asyncio.shield(client.__aexit__(None, None, None))
        except aiomqtt.MqttError as exc:
            log.debug("%s: disconnect: %s", self._client_id, exc)

    async def _sync_subscriptions(self, client: aiomqtt.Client, sent: set[str]) -> None:
        """Send every recorded subscription, including ones recorded while we were sending."""
        while True:
            todo = [(f, qos) for f, (_, qos) in self._subs.items() if f not in sent]
            if not todo:
                return
            for topic_filter, qos in todo:
                await self._send_subscribe(client, topic_filter, qos)
                sent.add(topic_filter)

    async def _send_subscribe(self, client: aiomqtt.Client, topic_filter: str, qos: int) -> None:
        result = await client.subscribe(topic_filter, qos=qos, timeout=self._timeout_s)
        for code in result:
            value = getattr(code, "value", code)
            if isinstance(value, int) and value >= _FAILURE:
                raise TransportError(f"broker refused subscription {topic_filter!r}: {code}")

    def _log_connected(self) -> None:
        if self._failures_held:
            log.info("%s: connected to %s:%d after %d failed attempts", self._client_id, self._host,
                     self._port, self._failures)
        else:
            log.info("%s: connected to %s:%d", self._client_id, self._host, self._port)
        self._failures = self._failures_held = 0
        self._failure_logged_at = float("-inf")

    def _note_short_lived(self) -> None:
        self._short_lived += 1
        now = self._clock.monotonic()
        if (self._short_lived >= SHORT_LIVED_BEFORE_WARNING
                and now - self._short_lived_logged_at >= FAILURE_LOG_INTERVAL_S):
            self._short_lived_logged_at = now
            log.warning("%s: the broker at %s:%d ended %d connections in a row within %gs of accepting them;"
                        " is another client connected with this client id (a second agent with the same"
                        " device id or the same credentials)?", self._client_id, self._host, self._port,
                        self._short_lived, SHORT_LIVED_S)

    @staticmethod
    def _tcp_open(client: aiomqtt.Client | None) -> bool:
        """Whether the attempt got as far as a TCP connection (paho holds its socket)."""
        paho_client = getattr(client, "_client", None)
        return paho_client is not None and paho_client.socket() is not None

    def _log_failure(self, level: int, text: str) -> None:
        """The first failure in a row and then one per FAILURE_LOG_INTERVAL_S at `level`; the
        others at DEBUG, counted into the next line that gets through."""
        self._failures += 1
        now = self._clock.monotonic()
        if self._failures == 1 or now - self._failure_logged_at >= FAILURE_LOG_INTERVAL_S:
            held, self._failures_held = self._failures_held, 0
            suffix = f" ({held} more failed attempts not logged)" if held else ""
            log.log(level, "%s: %s%s", self._client_id, text, suffix)
            self._failure_logged_at = now
        else:
            self._failures_held += 1
            log.debug("%s: %s", self._client_id, text)

    # -- dispatch --------------------------------------------------------------------------
    def _accept(self, message: InboundMessage, mid: int) -> None:
        """Queue one received message (called by paho's read path on the loop). `mid` is the
        packet id to acknowledge once the message is dispatched (0 for QoS 0)."""
        inbound = self._inbound
        inbound.append((message, mid, self._wire))
        depth = len(inbound)
        if depth > self.inbound_high_water:
            self.inbound_high_water = depth
        if depth >= self._inbound_capacity and self._fast is not None and not self._fast.paused:
            self.inbound_pauses += 1
            self._fast.pause()
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _on_message(self, message: aiomqtt.Message) -> None:
        """Messages paho's own handler parsed (the unusual ones `FastPath` passes on)."""
        properties = message.properties
        payload = message.payload
        if not isinstance(payload, bytes):
            payload = bytes(payload) if isinstance(payload, bytearray) else str(payload).encode()
        self._accept(
            InboundMessage(
                message.topic.value,
                payload,
                bool(message.retain),
                getattr(properties, "ResponseTopic", None),
                getattr(properties, "CorrelationData", None),
                message.qos,
            ),
            message.mid if message.qos else 0,
        )

    def _handlers(self, topic: str) -> tuple[Handler, ...]:
        handlers = self._routes.get(topic)
        if handlers is None:
            handlers = tuple(h for f, (h, _) in self._subs.items() if topics.matches(f, topic))
            if len(self._routes) >= _ROUTE_CACHE:
                self._routes.clear()
            self._routes[topic] = handlers
        return handlers

    async def _dispatch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        inbound = self._inbound
        resume_at = self._inbound_capacity // 2
        while True:
            if not inbound:
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
                continue
            message, mid, paho = inbound.popleft()
            fast = self._fast
            if fast is not None and fast.paused and len(inbound) <= resume_at:
                fast.resume()
            for handler in self._handlers(message.topic):
                try:
                    pending = handler(message)
                    if pending is not None:
                        await pending
                except Exception:
                    log.exception("%s: handler for %r failed", self._client_id, message.topic)
            if mid and paho is self._wire and paho is not None:
                # After a reconnect the broker redelivers what this connection did not ack.
                paho.ack(mid, message.qos)


def _stock_properties(response_topic: str | None, correlation: bytes | None,
                      expiry_s: int | None) -> Properties | None:
    """The PUBLISH properties for paho's own `publish` (None when there are none)."""
    if response_topic is None and correlation is None and expiry_s is None:
        return None
    properties = Properties(PacketTypes.PUBLISH)
    if expiry_s is not None:
        properties.MessageExpiryInterval = expiry_s
    if response_topic is not None:
        properties.ResponseTopic = response_topic
    if correlation is not None:
        properties.CorrelationData = correlation
    return properties


def reason_code_of(exc: aiomqtt.MqttError) -> int | None:
    """The reason code the broker sent (CONNACK, DISCONNECT), if `exc` carries one.

    aiomqtt puts paho's own error numbers (`MQTTErrorCode`: 4 no connection, 5 refused, 7 lost)
    in the same field as the broker's codes; they are not the broker's answer (MQTT 3.1.1's
    CONNACK codes 4 and 5 are bad credentials, which a dropped connection is not)."""
    rc = getattr(exc, "rc", None)
    if rc is None or isinstance(rc, MQTTErrorCode):
        return None
    value = getattr(rc, "value", rc)
    return value if isinstance(value, int) else None


def _writer_callbacks(paho: Any, loop: asyncio.AbstractEventLoop, client: aiomqtt.Client) -> tuple[
        Callable[[Any, Any, Any], None], Callable[[Any, Any, Any], None]]:
    """paho's socket write (un)registration, in place of aiomqtt's.

    paho asks for a writer from the loop or from the thread that connects, so the writer is
    added on a later turn of the loop. aiomqtt takes the file descriptor when asked, and a
    connection that dropped in between (a stalled one, ended by the keepalive) leaves the loop
    adding a writer for a closed socket: asyncio logs an EBADF traceback, or watches a
    descriptor the system has since given to another file. Here the socket is checked when the
    loop gets to it."""

    def write_ready() -> None:
        try:
            paho.loop_write()
        except Exception as exc:  # a broken pipe: the connection is over, as aiomqtt does
            _end_connection(client, exc)

    def add_writer(sock: Any) -> None:
        fd = sock.fileno()
        if paho.socket() is sock and fd >= 0:  # still this connection's open socket
            loop.add_writer(fd, write_ready)

    def register(_client: Any, _userdata: Any, sock: Any) -> None:
        loop.call_soon_threadsafe(add_writer, sock)

    def unregister(_client: Any, _userdata: Any, sock: Any) -> None:
        fd = sock.fileno()
        if fd >= 0:
            loop.remove_writer(fd)

    return register, unregister


def _end_connection(client: aiomqtt.Client, exc: BaseException) -> None:
    """What aiomqtt's own reader does when reading fails: end the connection with `exc`."""
    disconnected: asyncio.Future[None] = client._disconnected  # noqa: SLF001  (checked at connect)
    if not disconnected.done():
        disconnected.set_exception(exc)


async def _join(task: asyncio.Task[Any]) -> None:
    """Wait for a task we cancelled; re-raise only a cancellation aimed at the caller."""
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:
        log.exception("task %s failed while stopping", task.get_name())


__all__ = ["MqttTransport", "TlsSettings", "backoff_delay", "credentials", "read_password"]
