"""The shipped broker example (configs/mosquitto/) with TLS and its ACL, against real mosquitto.

Certificates are made by the test; the agent's own MqttTransport connects over TLS with a
username and a password read from a private file.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from svc_broker import ExampleBroker, Pki, make_pki, render_example

from agent.core.clock import SystemClock
from agent.core.codec import Envelope, Reply, encode
from agent.core.config import LeaderSection, MqttSection
from agent.core.errors import Permanent
from agent.service.files import read_secret
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.endpoint import EnvelopeInbox, EnvelopeSender
from agent.transport.mqtt import MqttTransport

pytestmark = pytest.mark.mqtt

FLEET = "default"
LEADER = "gateway-01"  # the leader user named in configs/mosquitto/acl and configs/leader.toml
USERS = {LEADER: "leader-secret", "pi-0001": "one-secret", "pi-0002": "two-secret"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), client_cn="pi-0001")


@pytest.fixture
def broker(tmp_path: Path, pki: Pki):
    with ExampleBroker(tmp_path / "broker", pki, USERS) as running:
        yield running


def password_file(directory: Path, user: str) -> str:
    path = directory / f"{user}.password"
    path.write_text(USERS[user] + "\n")
    path.chmod(0o600)
    assert read_secret(path) == USERS[user]  # what the agent accepts as a credentials file
    return str(path)


async def connect(broker: ExampleBroker, pki: Pki, tmp_path: Path, user: str) -> MqttTransport:
    section = MqttSection(
        url=f"mqtts://127.0.0.1:{broker.port}",
        username=user,
        password_file=password_file(tmp_path, user),
        tls_ca=str(pki.ca_cert),
        reconnect_min_s=0.1,
        reconnect_max_s=0.5,
    )
    transport = MqttTransport.from_config(section, client_id=user)
    await transport.start()
    await asyncio.wait_for(transport.connected.wait_open(), 30)
    return transport


class Inbox:
    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self._changed = asyncio.Event()

    async def handler(self, message: InboundMessage) -> None:
        self.messages.append((message.topic, message.payload))
        self._changed.set()

    async def wait_for(self, payload: bytes) -> None:
        while payload not in [p for _, p in self.messages]:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 30)


def test_example_config_renders_only_what_the_test_must_change(tmp_path: Path) -> None:
    files = {k: tmp_path / k for k in ("password_file", "acl_file", "cafile", "certfile", "keyfile")}
    text = render_example(1234, files)
    assert "listener 1234 127.0.0.1" in text
    for kept in ("set_tcp_nodelay true", "allow_anonymous false", "require_certificate false",
                 "tls_version tlsv1.2"):
        assert kept in text


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-subscription"])
async def test_a_device_cannot_publish_as_another_device(
    broker: ExampleBroker, pki: Pki, tmp_path: Path, shared: bool
) -> None:
    leader = await connect(broker, pki, tmp_path, LEADER)
    device = await connect(broker, pki, tmp_path, "pi-0001")
    try:
        inbox = Inbox()
        topic_filter = "ea/v1/+/+/up"  # every fleet's uplinks, as the leader user may read them
        await leader.subscribe(f"$share/leaders/{topic_filter}" if shared else topic_filter,
                               inbox.handler)
        await device.publish(f"ea/v1/{FLEET}/pi-0001/up", b"own")
        await device.publish(f"ea/v1/{FLEET}/pi-0002/up", b"forged")  # refused by the ACL
        await device.publish("ea/v1/otherfleet/pi-0001/up", b"other fleet", retain=True)  # refused too
        await device.publish(f"ea/v1/{FLEET}/pi-0001/up", b"marker")
        # the broker keeps one publisher's order: once "marker" is in, "forged" would be too
        await inbox.wait_for(b"marker")
        assert inbox.messages == [
            (f"ea/v1/{FLEET}/pi-0001/up", b"own"),
            (f"ea/v1/{FLEET}/pi-0001/up", b"marker"),
        ]
        if not shared:  # nothing was kept in another fleet's namespace either (retained)
            await device.publish(f"ea/v1/{FLEET}/pi-0001/up", b"retained marker", retain=True)
            late = Inbox()
            await leader.subscribe("ea/v1/+/pi-0001/up", late.handler)
            await late.wait_for(b"retained marker")
            assert b"other fleet" not in [payload for _, payload in late.messages]
            await device.publish(f"ea/v1/{FLEET}/pi-0001/up", b"", retain=True)  # (cleared)
    finally:
        await device.stop()
        await leader.stop()


async def test_a_device_joining_the_leaders_shared_subscription_takes_nothing(
    broker: ExampleBroker, pki: Pki, tmp_path: Path
) -> None:
    """Mosquitto 2.0's acl_file does not check subscriptions, so pi-0002 may join any shared
    subscription; a lone leader subscribes without one, so the group it joins is its own."""
    leader = await connect(broker, pki, tmp_path, LEADER)
    rogue = await connect(broker, pki, tmp_path, "pi-0002")
    device = await connect(broker, pki, tmp_path, "pi-0001")
    try:
        inbox, stolen = Inbox(), Inbox()
        await leader.subscribe(topics.leader_up_filter(FLEET, LeaderSection().shared_group), inbox.handler)
        for grab in (topics.leaders_up(FLEET), f"$share/leaders/ea/v1/{FLEET}/#", f"ea/v1/{FLEET}/+/up"):
            await rogue.subscribe(grab, stolen.handler)
        sent = [f"heartbeat {i}".encode() for i in range(20)]
        for payload in sent:
            await device.publish(f"ea/v1/{FLEET}/pi-0001/up", payload)
        await rogue.publish(f"ea/v1/{FLEET}/pi-0002/up", b"rogue marker")
        await inbox.wait_for(b"rogue marker")  # delivered after all of pi-0001's, to the rogue too
        assert [payload for _, payload in inbox.messages] == [*sent, b"rogue marker"]
        assert stolen.messages == []
    finally:
        await device.stop()
        await rogue.stop()
        await leader.stop()


async def test_a_device_reads_only_its_own_commands(
    broker: ExampleBroker, pki: Pki, tmp_path: Path
) -> None:
    leader = await connect(broker, pki, tmp_path, LEADER)
    device = await connect(broker, pki, tmp_path, "pi-0001")
    try:
        inbox = Inbox()
        await device.subscribe(f"ea/v1/{FLEET}/+/down", inbox.handler)  # asks for too much
        await leader.publish(f"ea/v1/{FLEET}/pi-0002/down", b"for pi-0002")
        await leader.publish(f"ea/v1/{FLEET}/pi-0001/down", b"for pi-0001")
        await inbox.wait_for(b"for pi-0001")
        assert inbox.messages == [(f"ea/v1/{FLEET}/pi-0001/down", b"for pi-0001")]
        # and it cannot issue commands itself
        other = Inbox()
        await leader.subscribe(f"ea/v1/{FLEET}/+/up", other.handler)
        await device.publish(f"ea/v1/{FLEET}/pi-0002/down", b"fake command")
        await device.publish(f"ea/v1/{FLEET}/pi-0001/up", b"marker")
        await other.wait_for(b"marker")
        assert b"fake command" not in [p for _, p in inbox.messages]
    finally:
        await device.stop()
        await leader.stop()


async def test_only_the_device_a_command_went_to_can_answer_it(broker: ExampleBroker, pki: Pki,
                                                                tmp_path: Path) -> None:
    """The leader asks for the reply on `.../reply/relay/pi-0001`, the only sub-topic of its
    reply topic pi-0001 may write: pi-0002, which sees the correlation, cannot answer for it."""
    leader = await connect(broker, pki, tmp_path, LEADER)
    device = await connect(broker, pki, tmp_path, "pi-0001")
    rogue = await connect(broker, pki, tmp_path, "pi-0002")
    sender = EnvelopeSender(leader, clock=SystemClock(), reply_topic=topics.reply(FLEET, LEADER, "relay"),
                            timeout_s=30.0, per_receiver=True)
    async def answer(envelope: Envelope, message: InboundMessage) -> Reply:
        # pi-0002 tries first, on its own sub-topic and on pi-0001's (the ACL drops that one)
        assert message.response_topic == topics.reply(FLEET, LEADER, "relay") + "/pi-0001"
        forged = encode(Reply(id=envelope.id, status="rejected", reason="answered by pi-0002"))
        for topic in (topics.reply(FLEET, LEADER, "relay") + "/pi-0002", message.response_topic):
            await rogue.publish(topic, forged, correlation=message.correlation)
        await rogue.publish(f"ea/v1/{FLEET}/pi-0002/up", b"marker")  # after both forged replies
        await marker.wait()
        return Reply(id=envelope.id, status="accepted")

    marker = asyncio.Event()

    async def on_up(message: InboundMessage) -> None:
        if message.payload == b"marker":
            marker.set()

    inbox = EnvelopeInbox(device, topic_filter=topics.down(FLEET, "pi-0001"), handler=answer, sender_check=False)
    try:
        await leader.subscribe(f"ea/v1/{FLEET}/+/up", on_up)
        await sender.start()
        await inbox.start()
        await sender.deliver(Envelope(id="cmd-1", kind="job.offer", sender=LEADER, receiver="pi-0001"),
                             topics.down(FLEET, "pi-0001"))  # returns: accepted, by pi-0001
        assert sender.stats.accepted == 1 and sender.stats.rejected == 0
        assert sender.stats.foreign_replies == 1  # pi-0002's own sub-topic; the other never arrived
    finally:
        await inbox.stop()
        await sender.stop()
        await rogue.stop()
        await device.stop()
        await leader.stop()


async def test_a_forged_sender_inside_an_envelope_is_refused_by_the_leader(
    broker: ExampleBroker, pki: Pki, tmp_path: Path
) -> None:
    """The ACL lets pi-0001 publish on its own topic; the envelope there claims to be pi-0002.
    The leader's inbox compares the two and answers `rejected`."""
    leader = await connect(broker, pki, tmp_path, LEADER)
    device = await connect(broker, pki, tmp_path, "pi-0001")
    handled: list[str] = []
    refused: list[tuple[str, str]] = []

    async def accept(envelope: Envelope, message: InboundMessage) -> Reply:
        handled.append(envelope.sender)
        return Reply(id=envelope.id, status="accepted")

    inbox = EnvelopeInbox(leader, topic_filter=topics.fleet_filter(FLEET, "up"), handler=accept,
                          on_rejected=lambda reason, raw, topic: refused.append((reason, topic)))
    sender = EnvelopeSender(device, clock=SystemClock(), reply_topic=topics.reply(FLEET, "pi-0001"),
                            timeout_s=30)
    try:
        await inbox.start()
        await sender.start()
        own_topic = topics.up(FLEET, "pi-0001")
        await sender.deliver(Envelope(id="m1", kind="telemetry", sender="pi-0001",
                                      receiver=LEADER, payload=b"t"), own_topic)
        with pytest.raises(Permanent, match="does not match"):
            await sender.deliver(Envelope(id="m2", kind="telemetry", sender="pi-0002",
                                          receiver=LEADER, payload=b"t"), own_topic)
        assert handled == ["pi-0001"]
        assert [topic for _, topic in refused] == [own_topic]
    finally:
        await sender.stop()
        await inbox.stop()
        await device.stop()
        await leader.stop()


def paho_connect(port: int, *, username: str | None, password: str | None,
                 context: ssl.SSLContext | None, client_id: str | None = None,
                 then_publish: tuple[str, bytes] | None = None) -> str:
    """One connect attempt with paho; returns the outcome as text ("ok" or why not).

    Driven with `loop()` on this thread: paho's background loop would reconnect on its own
    after a refusal and could leave a socket behind."""
    outcome: list[str] = []
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"probe-{os.getpid()}",
                         protocol=paho.MQTTv5)
    if username is not None:
        client.username_pw_set(username, password)
    if context is not None:
        client.tls_set_context(context)

    def on_connect(_c, _u, _f, reason_code, _p) -> None:
        outcome.append("ok" if not reason_code.is_failure else str(reason_code))

    def on_disconnect(_c, _u, _f, reason_code, _p) -> None:
        outcome.append(f"disconnected: {reason_code}")

    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    try:
        try:
            client.connect("127.0.0.1", port, keepalive=10)
        except (ssl.SSLError, OSError) as exc:
            return f"refused: {type(exc).__name__}"
        deadline = time.monotonic() + 30
        while not outcome and time.monotonic() < deadline:
            if client.loop(timeout=0.5) != paho.MQTT_ERR_SUCCESS and not outcome:
                outcome.append("connection lost")
        if outcome and outcome[0] == "ok" and then_publish is not None:
            client.publish(*then_publish, qos=1)
            deadline = time.monotonic() + 30
            while len(outcome) == 1 and time.monotonic() < deadline:
                if client.loop(timeout=0.5) != paho.MQTT_ERR_SUCCESS and len(outcome) == 1:
                    outcome.append("connection lost")
            return outcome[-1]
        if outcome and outcome[0] == "ok":
            client.disconnect()
        return outcome[0] if outcome else "no answer"
    finally:
        _close(client)


def _close(client: paho.Client) -> None:
    """paho leaves the socket open after a refused connect; close it ourselves."""
    sock = client.socket()
    if sock is not None:
        sock.close()


def tls_refused(port: int, context: ssl.SSLContext) -> bool:
    """True when the TLS session fails: in the handshake, or (TLS 1.3 client certificates)
    with the server's alert or close right after it. A session that stays open is not refused."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                return tls.recv(1) == b""
        except (ssl.SSLError, ConnectionError):
            return True
        except TimeoutError:
            return False


def tls_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key) if key else None)
    return context


async def test_a_device_reads_the_leaders_presence_not_another_devices(
        broker: ExampleBroker, pki: Pki, tmp_path: Path) -> None:
    leader = await connect(broker, pki, tmp_path, LEADER)
    other = await connect(broker, pki, tmp_path, "pi-0002")
    device = await connect(broker, pki, tmp_path, "pi-0001")
    try:
        await leader.publish(topics.presence(FLEET, LEADER), topics.ONLINE, retain=True)
        await other.publish(topics.presence(FLEET, "pi-0002"), topics.ONLINE, retain=True)
        inbox = Inbox()
        await device.subscribe(topics.presence(FLEET, "pi-0002"), inbox.handler)
        await device.subscribe(topics.presence(FLEET, LEADER), inbox.handler)
        await inbox.wait_for(topics.ONLINE)
        await device.publish(f"ea/v1/{FLEET}/pi-0001/up", b"round trip")  # after both retained deliveries
        assert inbox.messages == [(topics.presence(FLEET, LEADER), topics.ONLINE)]
    finally:
        await device.stop()
        await other.stop()
        await leader.stop()


async def test_another_devices_client_id_takes_over_nothing(broker: ExampleBroker, pki: Pki, tmp_path: Path) -> None:
    """`use_username_as_clientid`: pi-0002's credentials with pi-0001's client id get pi-0002's
    session; pi-0001 stays connected and keeps its session."""
    device = await connect(broker, pki, tmp_path, "pi-0001")
    try:
        assert await asyncio.to_thread(paho_connect, broker.port, username="pi-0002", password=USERS["pi-0002"],
                                       context=tls_context(pki.ca_cert), client_id="pi-0001") == "ok"
        # a QoS 1 round trip after the rogue's CONNACK: a kicked connection would fail it or reconnect
        await device.publish(f"ea/v1/{FLEET}/pi-0001/up", b"still here")
        assert device.connected.is_open and device.connects == 1
    finally:
        await device.stop()


async def test_a_publish_larger_than_the_agents_limit_is_refused_by_the_broker(
        broker: ExampleBroker, pki: Pki, tmp_path: Path) -> None:
    leader = await connect(broker, pki, tmp_path, LEADER)
    try:
        inbox = Inbox()
        await leader.subscribe(f"ea/v1/{FLEET}/+/up", inbox.handler)
        outcome = await asyncio.to_thread(
            paho_connect, broker.port, username="pi-0001", password=USERS["pi-0001"],
            context=tls_context(pki.ca_cert), then_publish=(f"ea/v1/{FLEET}/pi-0001/up", b"x" * 10_000_000))
        assert outcome.startswith("disconnected")  # the broker ends the connection: nothing is read in
        device = await connect(broker, pki, tmp_path, "pi-0001")
        try:
            await device.publish(f"ea/v1/{FLEET}/pi-0001/up", b"marker")
            await inbox.wait_for(b"marker")
            assert inbox.messages == [(f"ea/v1/{FLEET}/pi-0001/up", b"marker")]  # the 10 MB one never arrived
        finally:
            await device.stop()
    finally:
        await leader.stop()


def test_wrong_password_plaintext_and_untrusted_server_are_refused(
    broker: ExampleBroker, pki: Pki
) -> None:
    port = broker.port
    assert paho_connect(port, username="pi-0001", password=USERS["pi-0001"],
                        context=tls_context(pki.ca_cert)) == "ok"
    assert paho_connect(port, username="pi-0001", password="guess",
                        context=tls_context(pki.ca_cert)) == "Not authorized"
    assert paho_connect(port, username=None, password=None,
                        context=tls_context(pki.ca_cert)) == "Not authorized"
    assert paho_connect(port, username="pi-0001", password=USERS["pi-0001"],
                        context=None) != "ok"  # plain MQTT on the TLS port
    assert tls_refused(port, tls_context(pki.rogue_ca_cert))  # the server's cert is the CA's


def test_client_certificates_when_the_broker_requires_them(tmp_path: Path, pki: Pki) -> None:
    with ExampleBroker(tmp_path / "broker", pki, USERS,
                       overrides={"require_certificate": "true"}) as broker:
        with_cert = tls_context(pki.ca_cert, pki.client_cert, pki.client_key)
        assert paho_connect(broker.port, username="pi-0001", password=USERS["pi-0001"],
                            context=with_cert) == "ok"
        assert tls_refused(broker.port, tls_context(pki.ca_cert))  # no client certificate


async def test_a_device_hears_only_its_own_sessions_and_answers_only_as_itself(broker: ExampleBroker, pki: Pki,
                                                                             tmp_path: Path) -> None:
    """Remote sessions' topics under the shipped ACL: pi-0002 neither hears pi-0001's session
    frames nor opens sessions on it, nor answers in its name."""
    leader = await connect(broker, pki, tmp_path, LEADER)
    device = await connect(broker, pki, tmp_path, "pi-0001")
    rogue = await connect(broker, pki, tmp_path, "pi-0002")
    try:
        heard, overheard, answers = Inbox(), Inbox(), Inbox()
        await device.subscribe(topics.session_down(FLEET, "pi-0001"), heard.handler)
        await rogue.subscribe(f"ea/v1/{FLEET}/+/session/down", overheard.handler)
        await leader.subscribe(topics.sessions_up_filter(FLEET, LEADER), answers.handler)
        await rogue.publish(topics.session_down(FLEET, "pi-0001"), b"an open from a device")  # refused
        await leader.publish(topics.session_down(FLEET, "pi-0001"), b"open for pi-0001")
        await heard.wait_for(b"open for pi-0001")
        assert heard.messages == [(topics.session_down(FLEET, "pi-0001"), b"open for pi-0001")]
        await rogue.publish(topics.session_up(FLEET, "pi-0001", LEADER), b"forged answer")  # refused
        await rogue.publish(topics.session_up(FLEET, "pi-0002", LEADER), b"its own")
        await device.publish(topics.session_up(FLEET, "pi-0001", LEADER), b"answer")
        await answers.wait_for(b"answer")
        await answers.wait_for(b"its own")
        assert b"forged answer" not in [p for _, p in answers.messages]
        assert [p for _, p in overheard.messages] == []
    finally:
        await rogue.stop()
        await device.stop()
        await leader.stop()
