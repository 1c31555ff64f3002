"""MqttTransport against a real mosquitto (started by the fixtures), plus its pure helpers.

Every test runs twice: on the lean paths through paho (`fast_path="auto"`) and on aiomqtt's own
path (`fast_path="off"`, what an agent falls back to on an unexpected paho)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.core.config import MqttSection
from agent.core.errors import ConfigError, ConnectionLost, NotConnected
from agent.transport import topics
from agent.transport.base import InboundMessage, PayloadTooLarge, Transport, Will
from agent.transport.mqtt import MqttTransport, TlsSettings, backoff_delay, read_password

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from mosquitto import Mosquitto, TlsFiles  # noqa: E402


@pytest.fixture(autouse=True, params=["auto", "off"])
def fast_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The message path every transport of the test takes (the constructor's default)."""
    mode: str = request.param
    defaults = dict(MqttTransport.__init__.__kwdefaults__ or {})
    defaults["fast_path"] = mode
    monkeypatch.setattr(MqttTransport.__init__, "__kwdefaults__", defaults)
    return mode


class Collector:
    def __init__(self) -> None:
        self.messages: list[InboundMessage] = []
        self._changed = asyncio.Event()

    async def __call__(self, message: InboundMessage) -> None:
        self.messages.append(message)
        self._changed.set()

    @property
    def payloads(self) -> list[bytes]:
        return [m.payload for m in self.messages]

    async def wait_for(self, predicate: Callable[[list[InboundMessage]], bool], timeout_s: float = 10) -> None:
        async def loop() -> None:
            while not predicate(self.messages):
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(loop(), timeout_s)


def transport(url: str, client_id: str, **kwargs: object) -> MqttTransport:
    return MqttTransport.from_url(
        url,
        client_id=client_id,
        reconnect_min_s=0.05,
        reconnect_max_s=0.3,
        **kwargs,  # type: ignore[arg-type]
    )


async def connected(t: MqttTransport) -> MqttTransport:
    await t.start()
    await asyncio.wait_for(t.connected.wait_open(), 10)
    return t


# -- pure helpers -----------------------------------------------------------------------------


def test_backoff_is_full_jitter_within_an_exponential_cap() -> None:
    rng = random.Random(1)
    for attempt in range(12):
        cap = min(8.0, 0.5 * 2**attempt)
        samples = [backoff_delay(attempt, 0.5, 8.0, rng) for _ in range(200)]
        assert all(0.0 <= s <= cap for s in samples)
        assert max(samples) > cap * 0.8  # the whole range is used, not just the floor
    assert backoff_delay(10_000, 1.0, 60.0, rng) <= 60.0


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("http://host", "expected mqtt"),
        ("mqtt://", "expected mqtt"),
        ("mqtt://user:secret@host", "no password"),
        ("mqtt://host:notaport", "invalid URL"),
    ],
)
def test_from_url_refuses_bad_urls(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MqttTransport.from_url(url, client_id="c")


def test_from_url_defaults_ports_and_tls() -> None:
    plain = MqttTransport.from_url("mqtt://broker.local", client_id="c")
    assert (plain._host, plain._port, plain._tls_context) == ("broker.local", 1883, None)
    secure = MqttTransport.from_url("mqtts://user@broker.local", client_id="c")
    assert secure._port == 8883 and secure._tls_context is not None
    assert secure._username == "user"


def test_password_comes_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    assert read_password(str(secret)) == "s3cret"
    section = MqttSection(url="mqtt://127.0.0.1:1", username="dev", password_file=str(secret))
    built = MqttTransport.from_config(section, client_id="c")
    assert (built._username, built._password) == ("dev", "s3cret")
    with pytest.raises(ConfigError, match="password_file"):
        MqttTransport.from_config(MqttSection(password_file=str(tmp_path / "missing")), client_id="c")


def test_bad_tls_files_are_config_errors(tmp_path: Path) -> None:
    section = MqttSection(url="mqtts://127.0.0.1:1", tls_ca=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match="tls_ca"):
        MqttTransport.from_config(section, client_id="c")


async def test_not_connected_and_payload_limit() -> None:
    t = MqttTransport.from_url("mqtt://127.0.0.1:1", client_id="c", max_payload_bytes=10)
    assert isinstance(t, Transport)
    with pytest.raises(NotConnected):
        await t.publish("a/b", b"x")
    with pytest.raises(PayloadTooLarge):
        await t.publish("a/b", b"x" * 11)


# -- against mosquitto --------------------------------------------------------------------------


@pytest.mark.mqtt
async def test_the_path_taken_is_the_one_asked_for(mosquitto: Mosquitto, fast_path: str) -> None:
    t = await connected(transport(mosquitto.url, "path"))
    try:
        assert t.fast_path_active is (fast_path == "auto")
    finally:
        await t.stop()


async def test_publish_subscribe_round_trip(mosquitto: Mosquitto) -> None:
    inbox = Collector()
    sub = transport(mosquitto.url, "sub")
    await sub.subscribe("ea/v1/f/+/up", inbox)
    await connected(sub)
    pub = await connected(transport(mosquitto.url, "pub"))
    try:
        await pub.publish("ea/v1/f/d1/up", b"hello", response_topic="ea/v1/f/d1/reply/relay", correlation=b"\x00id")
        await pub.publish("ea/v1/f/d1/down", b"not for sub")
        await pub.publish("ea/v1/f/d2/up", b"second")
        await inbox.wait_for(lambda ms: len(ms) >= 2)
        first = inbox.messages[0]
        assert (first.topic, first.payload, first.retain) == ("ea/v1/f/d1/up", b"hello", False)
        assert (first.response_topic, first.correlation) == ("ea/v1/f/d1/reply/relay", b"\x00id")
        assert inbox.payloads == [b"hello", b"second"]
    finally:
        await pub.stop()
        await sub.stop()


@pytest.mark.mqtt
async def test_publish_nowait_sends_qos0_with_its_correlation_to_a_plain_function_handler(mosquitto: Mosquitto) -> None:
    got: list[InboundMessage] = []
    arrived = asyncio.Event()

    def take(message: InboundMessage) -> None:  # a plain function: nothing for the transport to await
        got.append(message)
        if len(got) == 2:
            arrived.set()

    sub = transport(mosquitto.url, "sub")
    await sub.subscribe("ea/v1/f/d1/reply/#", take)
    await connected(sub)
    pub = await connected(transport(mosquitto.url, "pub"))
    try:
        pub.publish_nowait("ea/v1/f/d1/reply/leader", b"r1", correlation=b"c1")
        pub.publish_nowait("ea/v1/f/d1/reply/leader", b"r2")
        await asyncio.wait_for(arrived.wait(), 10)
        assert [(m.payload, m.correlation, m.qos, m.retain) for m in got] == [(b"r1", b"c1", 0, False),
                                                                             (b"r2", None, 0, False)]
        with pytest.raises(PayloadTooLarge):
            pub.publish_nowait("ea/v1/f/d1/reply/leader", b"x" * (pub.max_payload_bytes + 1))
    finally:
        await pub.stop()
        await sub.stop()
    with pytest.raises(NotConnected):
        pub.publish_nowait("ea/v1/f/d1/reply/leader", b"r3")


VICTIM = """
import asyncio, sys
from agent.transport.base import Will
from agent.transport.mqtt import MqttTransport

async def main():
    delay = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    t = MqttTransport.from_url(sys.argv[1], client_id="victim", keepalive_s=5,
                               will=Will(sys.argv[2], b"offline", delay_s=delay), birth=Will(sys.argv[2], b"online"))
    await t.start()
    await asyncio.wait_for(t.connected.wait_open(), 10)
    print("up", flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


@pytest.mark.mqtt
async def test_birth_and_will_presence_are_retained(mosquitto: Mosquitto) -> None:
    presence = topics.presence("f", "victim")
    watch = Collector()
    watcher = transport(mosquitto.url, "watcher")
    await watcher.subscribe(topics.fleet_filter("f", "presence"), watch)
    await connected(watcher)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, mosquitto.url, presence], stdout=subprocess.PIPE, env=env, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.strip() == b"up"
        await watch.wait_for(lambda ms: b"online" in [m.payload for m in ms])
        proc.kill()  # SIGKILL by pid: no DISCONNECT, the broker publishes the will
        proc.wait(10)
        await watch.wait_for(lambda ms: ms[-1].payload == b"offline")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    late = Collector()
    latecomer = transport(mosquitto.url, "late")
    await latecomer.subscribe(presence, late)
    await connected(latecomer)
    await late.wait_for(lambda ms: len(ms) >= 1)
    assert (late.messages[0].payload, late.messages[0].retain) == (b"offline", True)
    await latecomer.stop()
    await watcher.stop()


@pytest.mark.mqtt
async def test_clean_stop_announces_offline_and_birth_says_online(mosquitto: Mosquitto) -> None:
    presence = topics.presence("f", "d1")
    watch = Collector()
    watcher = transport(mosquitto.url, "watcher")
    await watcher.subscribe(presence, watch)
    await connected(watcher)
    device = await connected(
        transport(mosquitto.url, "d1", will=Will(presence, b"offline"), birth=Will(presence, b"online"))
    )
    await watch.wait_for(lambda ms: b"online" in [m.payload for m in ms])
    await device.stop()
    await watch.wait_for(lambda ms: ms[-1].payload == b"offline")
    assert not device.connected.is_open
    await watcher.stop()


@pytest.mark.mqtt
async def test_broker_restart_closes_and_reopens_the_gate_and_resubscribes(
        mosquitto: Mosquitto, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    inbox = Collector()
    changes: list[bool] = []
    sub = transport(mosquitto.url, "sub")
    sub.connected.add_listener(changes.append)
    await sub.subscribe("t/#", inbox)
    await connected(sub)
    pub = await connected(transport(mosquitto.url, "pub"))
    try:
        await pub.publish("t/1", b"before")
        await inbox.wait_for(lambda ms: len(ms) == 1)
        mosquitto.stop()  # persistence off: the broker forgets every session and subscription
        await asyncio.wait_for(sub.connected.wait_closed(), 10)
        with pytest.raises(NotConnected):
            await pub.publish("t/1", b"while down")
        await asyncio.to_thread(mosquitto.start)
        await asyncio.wait_for(sub.connected.wait_open(), 15)
        await asyncio.wait_for(pub.connected.wait_open(), 15)
        await pub.publish("t/2", b"after")
        await inbox.wait_for(lambda ms: len(ms) == 2)
        assert inbox.payloads == [b"before", b"after"]
        assert changes == [True, False, True]
        assert sub.connects == 2
        # a broker's restart is an event the product logs at INFO; no library calls it an error
        errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors
        assert any(r.name == "agent.transport.mqtt" and "connection ended" in r.getMessage() for r in caplog.records)
    finally:
        await pub.stop()
        await sub.stop()


@pytest.mark.mqtt
async def test_persistent_session_receives_qos1_sent_while_offline(mosquitto: Mosquitto) -> None:
    first = Collector()
    device = transport(mosquitto.url, "dev-p")
    await device.subscribe("cmd/dev-p", first)
    await connected(device)
    await device.stop()
    pub = await connected(transport(mosquitto.url, "leader"))
    for i in range(3):
        await pub.publish("cmd/dev-p", b"%d" % i)
    again = Collector()
    device2 = transport(mosquitto.url, "dev-p")  # the agent restarted: same client id
    await device2.subscribe("cmd/dev-p", again)
    await connected(device2)
    await again.wait_for(lambda ms: len(ms) >= 3)
    assert again.payloads == [b"0", b"1", b"2"]
    assert first.payloads == []
    await device2.stop()
    await pub.stop()


@pytest.mark.mqtt
async def test_persistent_session_survives_a_broker_restart(mosquitto_persistent: Mosquitto) -> None:
    broker = mosquitto_persistent
    inbox = Collector()
    device = transport(broker.url, "dev-q")
    await device.subscribe("cmd/dev-q", inbox)
    await connected(device)
    await device.stop()
    pub = await connected(transport(broker.url, "leader"))
    await pub.publish("cmd/dev-q", b"queued")
    await pub.stop()
    await asyncio.to_thread(broker.restart)
    device2 = transport(broker.url, "dev-q")
    await device2.subscribe("cmd/dev-q", inbox)
    await connected(device2)
    await inbox.wait_for(lambda ms: len(ms) >= 1)
    assert inbox.payloads == [b"queued"]
    await device2.stop()


@pytest.mark.mqtt
async def test_shared_subscription_splits_messages_between_two_clients(mosquitto: Mosquitto) -> None:
    a_in, b_in = Collector(), Collector()
    flt = topics.leaders_up("f")
    leader_a = transport(mosquitto.url, "leader-a")
    leader_b = transport(mosquitto.url, "leader-b")
    await leader_a.subscribe(flt, a_in)
    await leader_b.subscribe(flt, b_in)
    await connected(leader_a)
    await connected(leader_b)
    dev = await connected(transport(mosquitto.url, "dev"))
    sent = [b"%02d" % i for i in range(40)]
    for i, payload in enumerate(sent):
        await dev.publish(topics.up("f", f"d{i % 7}"), payload)
    await a_in.wait_for(lambda _: len(a_in.messages) + len(b_in.messages) >= 40)
    assert sorted(a_in.payloads + b_in.payloads) == sent
    assert a_in.messages and b_in.messages
    for t in (dev, leader_a, leader_b):
        await t.stop()


@pytest.mark.mqtt
async def test_username_and_password_from_file(mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path) -> None:
    passwd = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwd), "dev", "right"], check=True, capture_output=True)
    passwd.chmod(0o600)
    broker = mosquitto_factory(password_file=passwd)
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("right\n")
    bad.write_text("wrong\n")
    ok = MqttTransport.from_config(
        MqttSection(url=broker.url, username="dev", password_file=str(good), reconnect_min_s=0.05, reconnect_max_s=0.2),
        client_id="dev-ok",
    )
    refused = MqttTransport.from_config(
        MqttSection(url=broker.url, username="dev", password_file=str(bad), reconnect_min_s=0.05, reconnect_max_s=0.2),
        client_id="dev-bad",
    )
    await connected(ok)
    await refused.start()
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while refused.last_error is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert refused.last_error is not None
        assert not refused.connected.is_open
    finally:
        await refused.stop()
        await ok.stop()


def _make_pki(directory: Path) -> tuple[TlsFiles, Path, Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def write_key(k: ec.EllipticCurvePrivateKey, path: Path) -> Path:
        path.write_bytes(
            k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        return path

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = key()
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("edge-agent test CA"))
        .issuer_name(name("edge-agent test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, server: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        k = key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca.subject)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return builder.sign(ca_key, hashes.SHA256()), k

    def write_cert(cert: x509.Certificate, path: Path) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    ca_path = write_cert(ca, directory / "ca.pem")
    server, server_key = leaf("127.0.0.1", True)
    client, client_key = leaf("dev-tls", False)
    files = TlsFiles(
        ca_file=str(ca_path),
        cert_file=str(write_cert(server, directory / "server.pem")),
        key_file=str(write_key(server_key, directory / "server.key")),
    )
    return (
        files,
        ca_path,
        write_cert(client, directory / "client.pem"),
        write_key(client_key, directory / "client.key"),
    )


@pytest.mark.mqtt
async def test_tls_with_ca_and_client_certificate(mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path) -> None:
    server_files, ca, cert, key = _make_pki(tmp_path)
    broker = mosquitto_factory(tls=server_files)
    assert broker.url.startswith("mqtts://")
    section = MqttSection(
        url=broker.url, tls_ca=str(ca), tls_cert=str(cert), tls_key=str(key), reconnect_min_s=0.05, reconnect_max_s=0.2
    )
    inbox = Collector()
    client = MqttTransport.from_config(section, client_id="dev-tls")
    await client.subscribe("secure/#", inbox)
    await connected(client)
    await client.publish("secure/x", b"over tls")
    await inbox.wait_for(lambda ms: len(ms) == 1)
    await client.stop()
    no_cert = MqttTransport.from_url(
        broker.url,
        client_id="anon",
        tls=TlsSettings(ca_file=str(ca)),
        operation_timeout_s=1.0,
        reconnect_min_s=0.05,
        reconnect_max_s=0.2,
    )
    await no_cert.start()
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while no_cert.last_error is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert no_cert.last_error is not None and not no_cert.connected.is_open
    finally:
        await no_cert.stop()


@pytest.mark.mqtt
async def test_publishes_in_flight_when_the_broker_dies_fail_with_our_errors(mosquitto: Mosquitto) -> None:
    pub = transport(mosquitto.url, "pub", operation_timeout_s=60.0)  # a hang would outlast the test
    await connected(pub)
    results: list[BaseException | None] = []

    async def one(i: int) -> None:
        try:
            await pub.publish("t/x", b"%d" % i)
            results.append(None)
        except BaseException as exc:
            results.append(exc)

    tasks = [asyncio.create_task(one(i)) for i in range(500)]
    await asyncio.sleep(0)
    mosquitto.kill()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    errors = [r for r in results if r is not None]
    assert len(results) == 500
    assert all(isinstance(e, (ConnectionLost, NotConnected)) for e in errors), {type(e) for e in errors}
    await pub.stop()


@pytest.mark.mqtt
async def test_stop_while_connecting_leaves_no_task_behind(mosquitto: Mosquitto) -> None:
    for i in range(10):
        t = transport(mosquitto.url, f"c{i}")
        await t.start()
        await asyncio.sleep(0.002 * i)
        await t.stop()
        assert not t.connected.is_open
    await asyncio.sleep(0.05)
    assert {task for task in asyncio.all_tasks() if task is not asyncio.current_task()} == set()


@pytest.mark.mqtt
async def test_reconnects_after_the_broker_comes_up_late(mosquitto: Mosquitto) -> None:
    mosquitto.stop()
    t = transport(mosquitto.url, "early")
    await t.start()

    async def refused() -> None:
        while t.last_error is None:  # the first attempt failed
            await asyncio.sleep(0.01)

    await asyncio.wait_for(refused(), 30)
    assert not t.connected.is_open
    await asyncio.to_thread(mosquitto.start)
    await asyncio.wait_for(t.connected.wait_open(), 15)
    await t.stop()


async def test_the_broker_sends_no_packet_larger_than_the_transport_takes(mosquitto: Mosquitto) -> None:
    """CONNECT announces Maximum Packet Size (max_payload_bytes plus headers): the broker drops
    a bigger message for this client instead of sending it."""
    inbox = Collector()
    small = transport(mosquitto.url, "small", max_payload_bytes=2048)
    await small.subscribe("big/t", inbox)
    await connected(small)
    pub = await connected(transport(mosquitto.url, "big-pub", max_payload_bytes=1 << 20))
    try:
        await pub.publish("big/t", b"x" * 100_000)
        await pub.publish("big/t", b"fits")
        await inbox.wait_for(lambda ms: any(m.payload == b"fits" for m in ms))
        assert inbox.payloads == [b"fits"]
        assert small.connected.is_open and small.connects == 1
    finally:
        await pub.stop()
        await small.stop()


async def test_refused_credentials_are_an_error_with_the_fix_and_wait_the_longest_backoff(
        mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:

    from agent.core.clock import VirtualClock

    passwd = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwd), "dev", "right"], check=True, capture_output=True)
    passwd.chmod(0o600)
    broker = mosquitto_factory(password_file=passwd)
    bad = tmp_path / "bad"
    bad.write_text("wrong\n")
    bad.chmod(0o600)
    clock = VirtualClock()
    t = MqttTransport.from_config(MqttSection(url=broker.url, username="dev", password_file=str(bad),
                                              reconnect_min_s=0.05, reconnect_max_s=300.0), client_id="dev-bad",
                                  clock=clock)
    with caplog.at_level(logging.INFO, logger="agent.transport.mqtt"):
        await t.start()
        try:
            async def sleeping() -> None:  # refused, and waiting for its next attempt
                while clock.next_deadline() is None:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(sleeping(), 30)
            deadline = clock.next_deadline()
            assert deadline is not None and deadline - clock.monotonic() == pytest.approx(300.0)
        finally:
            await t.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "refused our credentials" in errors[0] and "mqtt.password_file" in errors[0] and "dev" in errors[0]



@pytest.mark.mqtt
async def test_a_device_back_within_its_will_delay_was_never_offline(mosquitto: Mosquitto) -> None:
    """A network blip (here: the agent killed and started again at once, the same session):
    the broker holds the will for its delay and drops it when the device comes back."""
    presence = topics.presence("f", "victim")
    watch = Collector()
    watcher = transport(mosquitto.url, "watcher")
    await watcher.subscribe(presence, watch)
    await connected(watcher)
    env = dict(os.environ, PYTHONPATH=str(REPO))

    async def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", VICTIM, mosquitto.url, presence, "600"],
                                stdout=subprocess.PIPE, env=env, cwd=REPO)
        assert proc.stdout is not None
        assert (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)).strip() == b"up"
        return proc

    procs = []
    try:
        procs.append(await start())
        procs[0].kill()  # no DISCONNECT: without a delay the broker would publish the will now
        procs[0].wait(10)
        procs.append(await start())  # back, in the same session, within the 600 s delay
        pub = await connected(transport(mosquitto.url, "marker"))
        try:
            await pub.publish(presence, b"marker")  # after the second birth, on the same topic
            await watch.wait_for(lambda ms: ms[-1].payload == b"marker")
        finally:
            await pub.stop()
        assert b"offline" not in watch.payloads
        assert watch.payloads.count(b"online") == 2
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        await watcher.stop()



@pytest.mark.mqtt
async def test_a_message_expiry_drops_a_stale_command_for_an_offline_device(mosquitto: Mosquitto) -> None:
    """MQTT v5 Message Expiry: what waits in an offline device's session past its expiry is
    dropped by the broker; a message without one is kept."""
    device = transport(mosquitto.url, "dev-x")
    await device.subscribe("cmd/dev-x", Collector())
    await connected(device)
    await device.stop()  # offline; the session (and its subscription) stays
    pub = await connected(transport(mosquitto.url, "leader-x"))
    try:
        await pub.publish("cmd/dev-x", b"stale", expiry_s=1)
        await pub.publish("cmd/dev-x", b"kept")
        await asyncio.sleep(2.5)  # the expiry is a time of the broker's: let it pass
        again = Collector()
        device = transport(mosquitto.url, "dev-x")
        await device.subscribe("cmd/dev-x", again)
        await connected(device)
        await again.wait_for(lambda ms: b"kept" in [m.payload for m in ms])
        assert again.payloads == [b"kept"]
        await device.stop()
    finally:
        await pub.stop()


async def test_a_socket_closed_before_the_loop_adds_its_writer_logs_no_traceback(mosquitto: Mosquitto) -> None:
    """paho asks for a writer (a publish queued), and the connection drops in the same turn
    before the loop gets to it (a stalled connection): asyncio must not log an EBADF traceback
    for a closed socket, nor watch a file descriptor the system may have reused."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    t = await connected(transport(mosquitto.url, "closing"))
    try:
        wire = t._wire
        assert wire is not None
        wire._call_socket_register_write()
        wire._sock_close()
        for _ in range(10):
            await asyncio.sleep(0)
        assert errors == []
    finally:
        loop.set_exception_handler(previous)
        await asyncio.wait_for(t.stop(), 30)


async def test_two_agents_with_one_client_id_are_reported_and_slowed(mosquitto: Mosquitto,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Each takes the other's session over at its connect; mosquitto 2.0 sends no reason code,
    so the pattern itself is reported: connections the broker ends right after accepting them."""
    first, second = transport(mosquitto.url, "pi-twin"), transport(mosquitto.url, "pi-twin")
    with caplog.at_level(logging.WARNING, logger="agent.transport.mqtt"):
        await connected(first)  # (two CONNECTs at the same instant may both be accepted by mosquitto)
        await second.start()
        try:
            async def reported() -> None:
                while not any("is another client connected with this client id" in r.getMessage()
                              for r in caplog.records):
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(reported(), 60)
        finally:
            await first.stop()
            await second.stop()
    line = next(r.getMessage() for r in caplog.records if "another client" in r.getMessage())
    assert line.startswith("pi-twin: the broker at 127.0.0.1:") and "3 connections in a row" in line
    assert first.connects + second.connects >= 6


class ResettingProxy:
    """A TCP hop between a client and mosquitto that can end the client's connection with a reset
    (SO_LINGER 0), as a broker that crashed or a NAT that forgot the flow does."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.clients: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"mqtt://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.clients.append(writer)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def reset(self) -> None:
        import socket
        import struct

        for writer in self.clients:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self.clients.clear()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.mark.mqtt
async def test_a_connection_reset_is_logged_at_info_not_as_an_error(
        mosquitto: Mosquitto, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    proxy = ResettingProxy(mosquitto.port)
    device = await connected(transport(await proxy.start(), "dev-reset"))
    try:
        proxy.reset()
        await asyncio.wait_for(device.connected.wait_closed(), 10)
        await asyncio.wait_for(device.connected.wait_open(), 15)  # it connects again, through the proxy
    finally:
        await device.stop()
        proxy.close()
    paho = [r for r in caplog.records if r.name == "agent.transport.mqtt.paho" and "socket" in r.getMessage()]
    assert paho and all(r.levelno == logging.INFO for r in paho), [(r.levelname, r.getMessage()) for r in paho]
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
