"""A holder of the claim credential (it sits on every device being provisioned) against a real
leader process and a real mosquitto with the shipped identity.conf and acl: it may enrol a
device, and nothing more. Each attack is refused with its reason, in the broker's answer or in
the leader's rejects, and a real device still enrols beside it.
"""

from __future__ import annotations

import signal
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import paho.mqtt.client as paho
import pytest

from agent.core.codec import decode
from agent.identity.device_key import certificate_request, new_device_key
from agent.identity.messages import EnrolAnswer, EnrolRequest
from agent.transport import topics
from tests.e2e.agent_support import FLEET, db_query, kill, run_agent, wait_for, write_config
from tests.identity_broker import IdentityBroker, cli, fleet_files

pytestmark = [pytest.mark.mqtt, pytest.mark.timeout(300)]

LEADER = "gw"


@dataclass
class Fleet:
    broker: IdentityBroker
    leader_conf: Path
    leader_db: Path
    certs: Path
    password: str = "claim-pw"

    def rejects(self) -> list[str]:
        return [r[0] for r in db_query(self.leader_db, "SELECT reason FROM rejects ORDER BY id")]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("identity-attacks")
    leader_dir, conf = tmp / LEADER, tmp / "leader.toml"
    identity: dict[str, Any] = {"claims": ["claim"], "ask_interval_s": 1.0}
    write_config(conf, "leader", LEADER, agent={"data_dir": str(leader_dir)}, identity=identity)
    certs, passwd = fleet_files(tmp, conf)
    broker = IdentityBroker(tmp / "broker", certs, leader_dir / "identity" / "crl.pem", passwd, leader=LEADER).start()
    write_config(conf, "leader", LEADER, agent={"data_dir": str(leader_dir)},
                 mqtt={"url": f"mqtts://127.0.0.1:{broker.port}", "tls_ca": str(certs / "ca.crt"),
                       "tls_cert": str(certs / "leader.crt"), "tls_key": str(certs / "leader.key")},
                 identity=identity)
    leader = run_agent(conf, tmp / "leader.log")
    try:
        wait_for(lambda: db_query(leader_dir / "leader.db", "SELECT 1 FROM registry_leaders"), "the leader started")
        yield Fleet(broker, conf, leader_dir / "leader.db", certs)
        log = (tmp / "leader.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    finally:
        kill(leader, signal.SIGTERM)
        broker.stop()


class Claimant:
    """A connection to the enrolment listener with the claim credential, under `client_id`."""

    def __init__(self, fleet: Fleet, client_id: str, *, hear: str | None = None) -> None:
        self.client_id = client_id
        self.answers: list[EnrolAnswer] = []
        self.heard: list[str] = []  # topics of everything delivered
        self.refused: int | None = None
        self._last = b""
        self._connected = threading.Event()
        client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        client.username_pw_set("claim", fleet.password)
        client.tls_set(ca_certs=str(fleet.certs / "ca.crt"), cert_reqs=ssl.CERT_REQUIRED)
        client.on_connect = self._on_connect
        client.on_message = self._on_message
        self.client = client
        self._hear = hear or topics.enrol_answer(FLEET, "claim", client_id)
        client.connect("127.0.0.1", fleet.broker.claim_port)
        client.loop_start()

    def _on_connect(self, client: paho.Client, _: Any, __: Any, reason: Any, ___: Any) -> None:
        if reason.is_failure:
            self.refused = reason.value
        else:
            client.subscribe(self._hear, qos=1)
        self._connected.set()

    def _on_message(self, _: paho.Client, __: Any, message: paho.MQTTMessage) -> None:
        self.heard.append(message.topic)
        try:
            self.answers.append(decode(message.payload, EnrolAnswer))
        except Exception:  # not an answer: only its topic matters here
            pass

    def connected(self) -> bool:
        assert self._connected.wait(30), "no CONNACK"
        return self.refused is None

    def ask(self, device: str, *, key: bytes | None = None, **fields: Any) -> None:
        csr = certificate_request(key or new_device_key(), device).decode()
        payload = msgspec.msgpack.encode(EnrolRequest(device=device, csr=csr, **fields))
        self.send(payload)

    def send(self, payload: bytes) -> None:
        self._last = payload
        self.client.publish(topics.enrol_request(FLEET, "claim", self.client_id), payload, qos=1).wait_for_publish(10)

    def answer(self, status: str) -> EnrolAnswer:
        """The newest answer of `status`; the last request is sent again every 100 polls while
        none came, as a device asks again (a request the leader missed while it reconnected)."""
        polls = iter(range(1, 10**6))

        def found() -> EnrolAnswer | None:
            answer = next((a for a in reversed(self.answers) if a.status == status), None)
            if answer is None and next(polls) % 100 == 0:
                self.send(self._last)
            return answer

        return wait_for(found, f"a {status} answer to {self.client_id}")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def enrolling(fleet: Fleet, device: str) -> Claimant:
    claimant = Claimant(fleet, topics.enrol_client_id(FLEET, device))
    assert claimant.connected()
    return claimant


def test_the_claim_credential_cannot_take_a_devices_or_the_leaders_client_id(fleet: Fleet) -> None:
    """F3: connecting on the enrolment listener as `gw` (or any id without the agents' prefix)
    is refused by the broker, and the leader's own connection stays."""
    for stolen in (LEADER, "pi-0001"):
        thief = Claimant(fleet, stolen)
        assert not thief.connected() and thief.refused == 0x87  # not authorized
        thief.close()
    # the leader's connection was not taken over: it still answers a device's enrolment
    assert "session taken over" not in (fleet.leader_conf.parent / "leader.log").read_text()
    device = enrolling(fleet, "dev-after-f3")
    device.ask("dev-after-f3")
    device.answer("pending")
    device.close()


def test_the_leaders_name_is_never_a_devices(fleet: Fleet) -> None:
    """F1: a request, a token and the allow-list for the leader's name: refused, no certificate."""
    allowed = cli("devices", "allow", "10000000deadbeef", "--config", str(fleet.leader_conf))
    assert allowed.returncode == 0, allowed.stderr
    token = cli("devices", "token", "--uses", "5", "--config", str(fleet.leader_conf)).stdout.strip()
    for name in (LEADER, "claim", "admin", "ea-t-leader-gw"):
        attacker = enrolling(fleet, name)
        assert attacker.connected()
        attacker.ask(name, serial="10000000deadbeef", token=token)
        refused = attacker.answer("rejected")
        assert f"the name {name!r} is reserved" in refused.reason, refused
        attacker.close()
    assert not db_query(fleet.leader_db, "SELECT device FROM device_identities WHERE device IN ('gw', 'claim')")
    assert not db_query(fleet.leader_db, "SELECT serial FROM issued_certs")
    assert sum("is reserved" in r for r in fleet.rejects()) >= 4


def test_an_allow_listed_serial_enrols_one_device_once(fleet: Fleet) -> None:
    """F2: two ids, one self-reported serial: the first is approved, the second waits."""
    assert cli("devices", "allow", "20000000cafebabe", "--config", str(fleet.leader_conf)).returncode == 0
    first, second = enrolling(fleet, "evil-1"), enrolling(fleet, "evil-2")
    first.ask("evil-1", serial="20000000cafebabe")
    assert first.answer("approved").cert
    second.ask("evil-2", serial="20000000cafebabe")
    second.answer("pending")
    empty = cli("devices", "allow", "", "--config", str(fleet.leader_conf))
    assert empty.returncode == 2 and "a hardware serial number is 1 to 64 characters" in empty.stderr
    for c in (first, second):
        c.close()


def test_a_claim_holder_hears_no_other_devices_answers(fleet: Fleet) -> None:
    """F11: a spy subscribed to every enrolment topic hears nothing of another device's answers."""
    spy = Claimant(fleet, topics.enrol_client_id(FLEET, "spy"), hear=f"ea/enrol/v1/{FLEET}/#")
    assert spy.connected()
    device = enrolling(fleet, "dev-heard")
    device.ask("dev-heard")
    device.answer("pending")
    assert spy.heard == []
    for c in (spy, device):
        c.close()


def test_one_flooding_holder_does_not_starve_a_new_device(fleet: Fleet) -> None:
    """F7, F10, F12: 40 requests from one connection, and one with an unknown field: refused under
    the claim credential's name; a new device asking meanwhile is heard."""
    flood = enrolling(fleet, "flooder")
    key = new_device_key()
    for _ in range(40):
        flood.ask("flooder", key=key)
    odd = enrolling(fleet, "dev-odd")
    odd.send(msgspec.msgpack.encode({"device": "dev-odd", "csr": certificate_request(key, "dev-odd").decode(),
                                     "role": "leader"}))
    assert "unknown field `role`" in odd.answer("rejected").reason
    device = enrolling(fleet, "dev-starved")
    device.ask("dev-starved")
    device.answer("pending")
    wait_for(lambda: sum("over the connection 'ea-enrol-t-flooder'" in r for r in fleet.rejects()) >= 30,
             "the flood refused")
    senders = {r[0] for r in db_query(fleet.leader_db, "SELECT DISTINCT sender FROM rejects WHERE reason LIKE"
                                                       " '%flood%'")}
    assert senders == {"claim"}
    for c in (flood, odd, device):
        c.close()


def test_an_enrolled_device_asking_to_renew_again_and_again_gets_no_new_certificate(fleet: Fleet,
                                                                                     tmp_path: Path) -> None:
    """F6: 200 renewals over the device's own mutual-TLS connection before its renewal point: each
    answered with the certificate on record, one certificate issued in all, the CRL stays small."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from agent.core.codec import Envelope, decode_reply, encode
    from agent.identity.messages import KIND_RENEW, RenewAnswer, RenewRequest

    assert cli("devices", "allow", "30000000f00dbabe", "--config", str(fleet.leader_conf)).returncode == 0
    key = new_device_key()
    enrolling_conn = enrolling(fleet, "dev-renew")
    enrolling_conn.ask("dev-renew", key=key, serial="30000000f00dbabe")
    cert = enrolling_conn.answer("approved").cert
    enrolling_conn.close()
    (tmp_path / "dev.key").write_bytes(key)
    (tmp_path / "dev.crt").write_text(cert)
    answers: list[bytes] = []
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="ea-t-worker-dev-renew", protocol=paho.MQTTv5)
    client.tls_set(ca_certs=str(fleet.certs / "ca.crt"), certfile=str(tmp_path / "dev.crt"),
                   keyfile=str(tmp_path / "dev.key"), cert_reqs=ssl.CERT_REQUIRED)
    client.on_message = lambda _c, _u, message: answers.append(message.payload)
    reply_topic = topics.reply(FLEET, "dev-renew", "renew")
    client.connect("127.0.0.1", fleet.broker.port)
    client.subscribe(reply_topic, qos=1)
    client.loop_start()
    try:
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = reply_topic
        csr = certificate_request(key, "dev-renew").decode()
        for n in range(200):
            envelope = Envelope(id=f"renew-{n}", kind=KIND_RENEW, sender="dev-renew", receiver="leader",
                                payload=msgspec.msgpack.encode(RenewRequest(device_id="dev-renew", csr=csr)))
            client.publish(topics.up(FLEET, "dev-renew"), encode(envelope), qos=1,
                           properties=props).wait_for_publish(10)
        wait_for(lambda: len(answers) >= 200, "200 answers")
    finally:
        client.loop_stop()
        client.disconnect()
    certs = {decode(decode_reply(a).body, RenewAnswer).cert for a in answers}
    assert certs == {cert}
    assert db_query(fleet.leader_db, "SELECT count(*) FROM issued_certs WHERE device = 'dev-renew'") == [(1,)]
