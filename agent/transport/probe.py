"""Probes of the way to the broker, one step at a time, for `edge-agent doctor`: TCP, TLS (and
the server certificate's expiry), then an MQTT v5 session that proves the credentials, the
protocol, the device's right to publish on its own up topic and read its replies, and that a
leader answers.

The MQTT probe connects with the agent's own client id (the broker may tie the id to the
username anyway), so it runs only while the agent does not: `doctor` checks that first. It
resumes a worker's persistent session with the same expiry (the session survives), does not
acknowledge what the broker delivers from it (queued commands are delivered to the agent again),
and takes back the one subscription it adds.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.transport._mqtt_failures import REVOKED_MARK, Failure, classify, no_connack
from agent.transport._mqtt_settings import BrokerAddress, TlsSettings, broker_address


def probe_tcp(address: BrokerAddress, timeout_s: float) -> float:
    """Seconds to open a TCP connection; OSError if it cannot be opened."""
    started = time.monotonic()
    with socket.create_connection((address.host, address.port), timeout=timeout_s):
        return time.monotonic() - started


@dataclass(frozen=True, slots=True)
class TlsProbe:
    version: str
    not_after: float  # the server certificate's expiry, seconds since the epoch


def probe_tls(address: BrokerAddress, context: ssl.SSLContext, timeout_s: float) -> TlsProbe:
    """A TLS handshake as the agent makes it; ssl.SSLError / OSError if it fails."""
    with socket.create_connection((address.host, address.port), timeout=timeout_s) as raw, \
            context.wrap_socket(raw, server_hostname=address.host) as tls:
        cert = tls.getpeercert() or {}
        not_after = cert.get("notAfter")
        expiry = ssl.cert_time_to_seconds(not_after) if isinstance(not_after, str) else 0.0
        return TlsProbe(version=tls.version() or "?", not_after=expiry)


@dataclass(frozen=True, slots=True)
class SessionProbe:
    """What one MQTT v5 session showed. `failure` set: the connection was refused or failed."""

    failure: Failure | None
    connect_s: float = 0.0
    publish_reason: int | None = None  # the PUBACK reason code of the publish on the up topic
    reply: bytes | None = None  # the leader's answer, None if none came within the timeout
    reply_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRequest:
    client_id: str
    username: str | None
    password: str | None
    tls: TlsSettings | None
    clean_start: bool
    session_expiry_s: int
    up_topic: str
    reply_topic: str
    request: bytes | None  # an envelope for the leader, published on `up_topic` (None: connect only)
    correlation: bytes


def probe_session(address: BrokerAddress, req: SessionRequest, timeout_s: float) -> SessionProbe:
    """Connect, publish `req.request` on the up topic asking for an answer on the reply topic,
    wait for it, clean up, disconnect. Never raises for what the broker answers."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=req.client_id, protocol=paho.MQTTv5)
    client.manual_ack_set(True)  # whatever the resumed session holds stays unacknowledged
    if req.username:
        client.username_pw_set(req.username, req.password)
    if req.tls is not None or address.tls:
        client.tls_set_context((req.tls or TlsSettings()).context())
    connected = threading.Event()
    acked = threading.Event()
    answered = threading.Event()
    state: dict[str, object] = {}

    def on_connect(_c: paho.Client, _u: object, _f: object, reason: object, _p: object) -> None:
        state["connack"] = int(getattr(reason, "value", 0))
        connected.set()

    def on_publish(_c: paho.Client, _u: object, _mid: int, reason: object, _p: object) -> None:
        state["puback"] = int(getattr(reason, "value", 0))
        acked.set()

    def on_message(_c: paho.Client, _u: object, message: paho.MQTTMessage) -> None:
        props = getattr(message, "properties", None)
        if message.topic == req.reply_topic and getattr(props, "CorrelationData", None) == req.correlation:
            state["reply"] = bytes(message.payload)
            state["reply_at"] = time.monotonic()
            answered.set()

    socket_errors: list[str] = []  # what paho's loop read: with TLS 1.3 a broker refuses a client
    # certificate (revoked, say) by an alert after the handshake, seen only on the next read

    def on_log(_c: paho.Client, _u: object, level: int, text: str) -> None:
        if level == paho.MQTT_LOG_ERR and len(socket_errors) < 8:
            socket_errors.append(text)

    client.on_connect, client.on_publish, client.on_message = on_connect, on_publish, on_message
    client.on_log = on_log
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 0 if req.clean_start else req.session_expiry_s
    started = time.monotonic()
    try:
        client.connect(address.host, address.port, keepalive=30, clean_start=req.clean_start, properties=props)
    except (OSError, ssl.SSLError) as exc:
        return SessionProbe(failure=classify(str(exc), code=None, disconnect_code=None,
                                             broker=f"{address.host}:{address.port}", username=req.username))
    client.loop_start()
    try:
        if not connected.wait(timeout_s):
            refused = next((e for e in socket_errors if "SSL" in e), None)
            if refused is not None:
                return SessionProbe(failure=classify(refused, code=None, disconnect_code=None,
                                                     broker=f"{address.host}:{address.port}", username=req.username))
            return SessionProbe(failure=Failure(logging.ERROR, no_connack(f"{address.host}:{address.port}", timeout_s),
                                                False))
        code = int(str(state.get("connack", 0)))
        if code >= 0x80:
            return SessionProbe(failure=classify(f"CONNACK reason {code:#x}", code=code, disconnect_code=None,
                                                 broker=f"{address.host}:{address.port}", username=req.username))
        connect_s = time.monotonic() - started
        if req.request is None:
            return SessionProbe(failure=None, connect_s=connect_s)
        client.subscribe(req.reply_topic, qos=1)
        publish = Properties(PacketTypes.PUBLISH)
        publish.ResponseTopic = req.reply_topic
        publish.CorrelationData = req.correlation
        sent_at = time.monotonic()
        client.publish(req.up_topic, req.request, qos=1, properties=publish)
        acked.wait(timeout_s)
        answered.wait(timeout_s)
        client.unsubscribe(req.reply_topic)
        reply = state.get("reply")
        reply_at = state.get("reply_at")
        return SessionProbe(
            failure=None, connect_s=connect_s,
            publish_reason=int(str(state["puback"])) if "puback" in state else None,
            reply=reply if isinstance(reply, bytes) else None,
            reply_s=(reply_at - sent_at) if isinstance(reply_at, float) else None,
        )
    finally:
        client.disconnect()
        client.loop_stop()


__all__ = ["REVOKED_MARK", "BrokerAddress", "SessionProbe", "SessionRequest", "TlsProbe", "broker_address",
           "probe_session", "probe_tcp", "probe_tls"]
