"""The leader's side of device identities on the in-memory broker: what it approves, what it
refuses (each refusal in the rejects, nothing else changed), and a renewal on virtual time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from agent.core.clock import VirtualClock
from agent.core.codec import Envelope, decode
from agent.core.errors import IdentityError
from agent.identity.certificates import read_certificate
from agent.identity.device_key import certificate_request, device_key_fingerprint, new_device_key
from agent.identity.files import IdentityFiles
from agent.identity.messages import KIND_RENEW, EnrolAnswer, EnrolRequest, RenewAnswer, RenewRequest
from agent.leader.agent import LeaderAgent
from agent.leader.enrolment import IdentityService, identity_part
from agent.leader.env import GatewayEnv
from agent.transport import topics
from agent.transport.memory import MemoryBroker, MemoryTransport
from agent.worker.renewal import IdentityRenewal
from tests.alerting import WITH_IDENTITY
from tests.e2e.agent_support import FLEET, leader, stop_all, until, worker

IDENTITY = {"claims": ["claim"], "claim_rate_per_min": 20, "total_rate_per_min": 40}


class Claimant:
    """A client with the claim credential: sends requests, collects answers."""

    def __init__(self, broker: MemoryBroker, claim: str = "claim") -> None:
        self.broker = broker
        self.transport = MemoryTransport(broker, f"claimant-{claim}")
        self.claim = claim
        self.answers: list[EnrolAnswer] = []

    async def start(self) -> Claimant:
        await self.transport.subscribe(f"ea/enrol/v1/{FLEET}/{self.claim}/+/answer", self._on)
        await self.transport.start()
        await self.transport.connected.wait_open()
        return self

    def _on(self, message: Any) -> None:
        self.answers.append(decode(bytes(message.payload), EnrolAnswer))

    async def ask(self, device: str, key: bytes, *, csr_for: str | None = None, client: str | None = None,
                  **fields: Any) -> None:
        """A request for `device` over the connection `client` (default: the device's own)."""
        csr = certificate_request(key, csr_for or device).decode()
        request = EnrolRequest(device=device, csr=csr, **fields)
        await self.transport.publish(topics.enrol_request(FLEET, self.claim, client or topics.enrol_client_id(
            FLEET, device)), msgspec.msgpack.encode(request))

    def last(self, device: str) -> EnrolAnswer | None:
        return next((a for a in reversed(self.answers) if a.device == device), None)


async def identity_leader(tmp: Path, broker: MemoryBroker, clock: Any, *, name: str = "gw", database: str = "",
                          **identity: Any) -> tuple[LeaderAgent, IdentityService]:
    sections: dict[str, Any] = {"leader": {"database": database}} if database else {}
    agent = await leader(clock, tmp, broker=broker, name=name, identity={**IDENTITY, **identity}, **sections)
    service = await identity_part(agent, GatewayEnv())
    assert service is not None
    service.poll_s = 0.05
    await service.start()
    return agent, service


async def answered(claimant: Claimant, device: str, status: str) -> EnrolAnswer:
    for _ in range(200):
        found = claimant.last(device)
        if found is not None and found.status == status:
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {status} answer for {device}: {claimant.answers}")


def rejects(agent: LeaderAgent) -> list[str]:
    return [r.reason for r in agent.rejects.list()]


@pytest.fixture
async def fleet(tmp_path: Path, leader_store: Path | str) -> Any:
    """A leader with identities on each backend: leader.db, then a PostgreSQL database."""
    from agent.core.clock import SystemClock

    clock = SystemClock()
    broker = MemoryBroker(clock=clock)
    agent, service = await identity_leader(tmp_path, broker, clock,
                                           database=leader_store if isinstance(leader_store, str) else "")
    claimant = await Claimant(broker).start()
    yield agent, service, claimant
    await service.stop()
    await claimant.transport.stop()
    await agent.stop()


async def test_a_request_waits_for_approval_and_gets_a_certificate_of_the_fleet_ca(fleet: Any) -> None:
    agent, service, claimant = fleet
    key = new_device_key()
    await claimant.ask("dev-1", key, serial="1000abcd", agent_version="0.1.0")
    await answered(claimant, "dev-1", "pending")
    assert service.store.get("dev-1").state == "pending"  # type: ignore[union-attr]
    control = service.store.add_control("approve", "dev-1", by="op", now_ms=agent.clock.now_ms())
    answer = await answered(claimant, "dev-1", "approved")
    cert = x509.load_pem_x509_certificate(answer.cert.encode())
    ca = x509.load_pem_x509_certificate(answer.ca.encode())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "dev-1"
    assert service.store.control(control).ok  # type: ignore[union-attr]
    metrics = {(f.name, tuple(s.labels)): s.value for f in await service.collectors()["identity"]()
               for s in f.samples}
    assert metrics[("ea_identity_devices", (("state", "approved"),))] == 1.0
    assert metrics[("ea_identity_devices", (("state", "pending"),))] == 0.0
    # the same request again: the same certificate, nothing new issued
    await claimant.ask("dev-1", key)
    await until(agent.clock, lambda: len([a for a in claimant.answers if a.status == "approved"]) == 2)
    assert claimant.last("dev-1").cert == answer.cert  # type: ignore[union-attr]


async def test_bad_requests_are_refused_with_a_reason_and_change_nothing(fleet: Any) -> None:
    agent, service, claimant = fleet
    # a request for another device id than its topic's
    await claimant.ask("dev-a", new_device_key(), csr_for="dev-b")
    refused = await answered(claimant, "dev-a", "rejected")
    assert "certificate request for device 'dev-b', sent as 'dev-a'" in refused.reason
    # a weak (here: foreign) key
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    csr = (x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                                                "dev-r")]))
           .sign(rsa_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())
    await claimant.transport.publish(topics.enrol_request(FLEET, "claim", topics.enrol_client_id(FLEET, "dev-r")),
                                     msgspec.msgpack.encode(EnrolRequest(device="dev-r", csr=csr)))
    assert "weak or foreign key" in (await answered(claimant, "dev-r", "rejected")).reason
    # not a request at all
    await claimant.transport.publish(topics.enrol_request(FLEET, "claim", topics.enrol_client_id(FLEET, "dev-x")),
                                     b"\x93junk")
    await until(agent.clock, lambda: any("undecodable" in r or "invalid" in r for r in rejects(agent)))
    assert service.store.listed() == []
    assert len(rejects(agent)) == 3


async def test_a_device_id_enrolled_with_another_key_is_refused_and_reported(fleet: Any) -> None:
    agent, service, claimant = fleet
    await claimant.ask("dev-1", new_device_key())
    await answered(claimant, "dev-1", "pending")
    service.store.add_control("approve", "dev-1", by="op", now_ms=agent.clock.now_ms())
    approved = await answered(claimant, "dev-1", "approved")
    await claimant.ask("dev-1", new_device_key())  # a thief with the claim credential and another key
    refused = await answered(claimant, "dev-1", "rejected")
    assert "is enrolled with another key" in refused.reason
    assert any("is enrolled with another key" in r for r in rejects(agent))
    record = service.store.get("dev-1")
    assert record is not None and record.state == "approved" and record.cert == approved.cert


async def test_a_claim_credential_not_heard_and_a_flood_are_refused(tmp_path: Path, fleet: Any) -> None:
    agent, service, claimant = fleet
    other = await Claimant(claimant.broker, claim="stranger").start()
    await other.ask("dev-s", new_device_key())
    await until(agent.clock, lambda: any("'stranger' is not one this leader hears" in r for r in rejects(agent)))
    for n in range(25):  # the claim's bucket holds 20
        await claimant.ask(f"dev-{n}", new_device_key())
    await until(agent.clock, lambda: sum("enrolment flood" in r for r in rejects(agent)) >= 5)
    assert service.store.count("pending") == 20
    await other.transport.stop()


async def test_a_batch_token_and_the_allow_list_approve_at_once(fleet: Any) -> None:
    agent, service, claimant = fleet
    now = agent.clock.now_ms()
    service.store.add_token("batch-7", uses=1, expires_ms=now + 60_000, by="op", now_ms=now)
    service.store.allow_serials(["00000000feedbeef"], by="op", now_ms=now)
    await claimant.ask("dev-t1", new_device_key(), token="batch-7")
    await answered(claimant, "dev-t1", "approved")
    await claimant.ask("dev-t2", new_device_key(), token="batch-7")  # its one use is taken
    await answered(claimant, "dev-t2", "pending")
    await claimant.ask("dev-s", new_device_key(), serial="00000000feedbeef")
    await answered(claimant, "dev-s", "approved")
    assert service.store.get("dev-t1").decided_by == "enrolment token"  # type: ignore[union-attr]


async def test_a_revoked_device_is_refused_at_once_even_its_renewal(fleet: Any) -> None:
    agent, service, claimant = fleet
    key = new_device_key()
    await claimant.ask("dev-1", key)
    await answered(claimant, "dev-1", "pending")
    service.store.add_control("approve", "dev-1", by="op", now_ms=agent.clock.now_ms())
    await answered(claimant, "dev-1", "approved")
    control = service.store.add_control("revoke", "dev-1", by="op", now_ms=agent.clock.now_ms(), reason="stolen")
    await until(agent.clock, lambda: (c := service.store.control(control)) is not None and c.applied_ms is not None)
    assert "dev-1" in agent.revoked
    crl = x509.load_pem_x509_crl(service.crl_path.read_bytes())
    assert len(list(crl)) == 1
    renewal = Envelope(id="r-1", kind=KIND_RENEW, sender="dev-1", receiver="leader", ts_ms=agent.clock.now_ms(),
                       payload=msgspec.msgpack.encode(RenewRequest(device_id="dev-1",
                                                                   csr=certificate_request(key, "dev-1").decode())))
    reply = agent._on_up(renewal, None)  # type: ignore[arg-type]
    assert not isinstance(reply, asyncio.Future) and reply.status == "rejected"  # type: ignore[union-attr]
    assert reply.reason == "device dev-1 is revoked"  # type: ignore[union-attr]
    await claimant.ask("dev-1", key)  # and it cannot enrol again
    assert "was revoked" in (await answered(claimant, "dev-1", "rejected")).reason


async def enrolled_on_virtual_time(tmp_path: Path) -> tuple[VirtualClock, MemoryBroker, tuple[Any, ...]]:
    """A leader and an enrolled, connected worker on virtual time, its certificate 1728 s long
    (renewed from 1152 s), its renewal started; restarts asked for are noted."""
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    agent, service = await identity_leader(tmp_path, broker, clock, cert_days=0.02, clock_skew_s=0)
    dev = await worker(clock, tmp_path, "dev-1", broker=broker)
    files = IdentityFiles(tmp_path / "dev-1" / "identity")
    key = files.key_pem()
    service.store.record_request(device="dev-1", fingerprint=device_key_fingerprint(key),
                                 csr=certificate_request(key, "dev-1").decode(), hw_serial="", machine_id="",
                                 agent_version="", claim="claim", now_ms=clock.now_ms())
    record = service._approve(service.store.get("dev-1"), by="op")  # type: ignore[arg-type]
    files.store(record.cert.encode(), service.authority.cert_pem)
    restarts: list[int] = []
    renewal = IdentityRenewal(dev, files, lambda: restarts.append(clock.now_ms()), check_s=600.0)
    await renewal.start()
    await until(clock, lambda: dev.transport.connected.is_open, limit_s=30)
    return clock, broker, (agent, service, dev, files, read_certificate(record.cert), renewal, restarts)


async def test_a_certificate_renews_two_thirds_into_its_life_on_virtual_time(tmp_path: Path) -> None:
    clock, broker, (agent, service, dev, files, first, renewal, restarts) = await enrolled_on_virtual_time(tmp_path)
    await until(clock, lambda: restarts, limit_s=1800, step_s=5.0, what="a renewal")  # a 1728 s certificate
    renewed = read_certificate(files.cert.read_bytes())
    assert first.renew_at_ms <= restarts[0] < first.renew_at_ms + 10_000  # two thirds into its life
    assert renewed.serial != first.serial and renewed.not_after_ms > first.not_after_ms
    assert renewed.fingerprint == first.fingerprint  # the same key, never sent
    metrics = {f.name: f.samples[0].value for f in await renewal.collectors()["identity"]()}
    assert metrics["ea_identity_renewals_total"] == 1.0
    assert WITH_IDENTITY <= set(metrics)  # what the shipped alerting rules read of a device's certificate
    assert metrics["ea_identity_certificate_expires_in_seconds"] == (renewed.not_after_ms - clock.now_ms()) / 1000
    await renewal.stop()
    await service.stop()
    await stop_all(dev, agent, clock=clock)


def test_a_device_back_after_its_certificate_expired_says_so_and_enrols_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """At its start: an expired certificate is one line and no certificate (enrolment follows);
    the leader takes the same key's request again as pending (an operator decides again)."""
    from agent.identity.authority import FleetAuthority, new_authority
    from agent.identity.certificates import read_request
    from agent.leader.identities import IdentityStore
    from agent.worker.identity import usable_certificate

    files = IdentityFiles(tmp_path / "identity")
    key = files.key_pem()
    assert (files.dir.stat().st_mode & 0o777, files.key.stat().st_mode & 0o777) == (0o700, 0o600)
    ca = FleetAuthority(*new_authority("t", now_ms=0))
    request = read_request(certificate_request(key, "dev-1"), device_id="dev-1")
    cert = ca.issue_device(request, now_ms=1_000_000, days=1, skew_s=0)
    files.store(cert, ca.cert_pem)
    assert usable_certificate(files, key, now_ms=1_000_000 + 3_600_000, device="dev-1")
    with caplog.at_level("ERROR"):
        assert not usable_certificate(files, key, now_ms=1_000_000 + 86_400_000, device="dev-1")
    assert "the device certificate expired at 1970-01-02T00:16:40Z: this device must enrol again" in caplog.text
    assert not usable_certificate(files, new_device_key(), now_ms=1_000_000, device="dev-1")  # not this key's
    with IdentityStore.open(tmp_path / "leader.db") as store:
        fields = {"device": "dev-1", "fingerprint": request.fingerprint, "csr": request.pem.decode(), "hw_serial": "",
                  "machine_id": "", "agent_version": "", "claim": "claim"}
        store.record_request(**fields, now_ms=1_000_000)
        store.issued("dev-1", cert=cert.decode(), serial=1, not_after_ms=1_000_000 + 86_400_000, by="op",
                     now_ms=1_000_000)
        assert store.record_request(**fields, now_ms=2_000_000).state == "approved"  # still valid: the same one
        again = store.record_request(**fields, now_ms=1_000_000 + 86_400_000)
        assert (again.state, again.reason) == ("pending", "certificate expired")


async def test_a_device_offline_past_its_renewal_point_renews_as_soon_as_it_is_back(tmp_path: Path) -> None:
    clock, broker, (agent, service, dev, files, first, renewal, restarts) = await enrolled_on_virtual_time(tmp_path)
    broker.partition(dev.transport.client_id)
    await until(clock, lambda: clock.now_ms() > first.renew_at_ms + 60_000, limit_s=1800, step_s=5.0)
    assert not restarts  # offline: nothing to renew with
    back = clock.now_ms()
    broker.heal(dev.transport.client_id)
    await until(clock, lambda: restarts, limit_s=120, step_s=1.0, what="a renewal at reconnect")
    assert restarts[0] - back < 30_000 and restarts[0] < first.not_after_ms  # at once, while the old one holds
    await renewal.stop()
    await service.stop()
    await stop_all(dev, agent, clock=clock)


async def test_two_leaders_on_postgresql_share_identities_with_one_ca(tmp_path: Path, pg_url: str) -> None:
    """Two leaders of one fleet on one PostgreSQL and one shared subscription: an enrolment is
    answered by one of them, an approval is applied by exactly one, a revocation made through one
    is refused by the other within a tick; a third leader with a CA of its own refuses to start."""
    import shutil

    from agent.core.clock import SystemClock
    from agent.core.errors import IdentityError
    from agent.identity.files import CA_CERT, CA_KEY

    clock = SystemClock()
    broker = MemoryBroker(clock=clock)
    first, one = await identity_leader(tmp_path, broker, clock, name="gw1", database=pg_url)
    ident = tmp_path / "gw2" / "identity"
    ident.mkdir(parents=True, mode=0o700)
    for name in (CA_KEY, CA_CERT):  # the fleet's CA, copied from the first leader, as docs/service.md says
        shutil.copy2(tmp_path / "gw1" / "identity" / name, ident / name)
    agents: list[LeaderAgent] = [first]
    services = [one]
    try:
        second, two = await identity_leader(tmp_path, broker, clock, name="gw2", database=pg_url)
        agents.append(second)
        services.append(two)
        claimant = await Claimant(broker).start()
        key = new_device_key()
        await claimant.ask("dev-1", key)
        await answered(claimant, "dev-1", "pending")
        control = one.store.add_control("approve", "dev-1", by="op", now_ms=clock.now_ms())
        await answered(claimant, "dev-1", "approved")
        await until(clock, lambda: (c := one.store.control(control)) is not None and c.applied_ms is not None)
        assert len([a for a in claimant.answers if a.status == "approved"]) == 1  # applied once, by one leader
        revoke = two.store.add_control("revoke", "dev-1", by="op", now_ms=clock.now_ms(), reason="stolen")
        await until(clock, lambda: (c := two.store.control(revoke)) is not None and c.applied_ms is not None)
        await until(clock, lambda: all("dev-1" in a.revoked for a in agents), what="both leaders refuse dev-1")
        await claimant.transport.stop()
        other = await leader(clock, tmp_path, broker=broker, name="gw3", identity=IDENTITY,
                             leader={"database": pg_url})
        agents.append(other)
        with pytest.raises(IdentityError, match="this leader's CA .* is not the fleet's"):
            await identity_part(other, GatewayEnv())
    finally:
        for service in services:
            await service.stop()
        await stop_all(*agents)


# -- what a holder of the claim credential cannot do (docs/service.md, "Device identity") --------

async def test_no_device_may_take_a_name_of_the_fleet(fleet: Any) -> None:
    """The leader itself, a leader seen in the registry, a claim credential, the broker's admin
    and the broker's client ids: refused at the request, with a token, and by hand."""
    agent, service, claimant = fleet
    with agent.registry.atomic() as conn:
        conn.execute("INSERT INTO registry_leaders (name, alive_ms) VALUES ('gw-2', 0)")
    now = agent.clock.now_ms()
    service.store.add_token("batch-1", uses=10, expires_ms=now + 60_000, by="op", now_ms=now)
    for name, said in (("gw", "a leader of the fleet"), ("gw-2", "a leader of the fleet"),
                       ("claim", "a claim credential"), ("admin", "reserved (identity.reserved)"),
                       ("ea-t-worker-dev-1", "names beginning 'ea-' are the broker's client ids")):
        await claimant.ask(name, new_device_key(), token="batch-1")
        refused = await answered(claimant, name, "rejected")
        assert f"the name {name!r} is reserved" in refused.reason and said in refused.reason
        assert service.store.get(name) is None
    assert service.store._conn.execute("SELECT uses_left FROM enrol_tokens").fetchone()[0] == 10  # none spent
    # a pending record of a reserved name (made before the name was a leader's): approval refused
    key = new_device_key()
    service.store.record_request(device="gw-3", fingerprint=device_key_fingerprint(key),
                                 csr=certificate_request(key, "gw-3").decode(), hw_serial="", machine_id="",
                                 agent_version="", claim="claim", now_ms=now)
    with agent.registry.atomic() as conn:
        conn.execute("INSERT INTO registry_leaders (name, alive_ms) VALUES ('gw-3', 0)")
    control = service.store.add_control("approve", "gw-3", by="op", now_ms=now)
    await until(agent.clock, lambda: (c := service.store.control(control)) is not None and c.applied_ms is not None)
    done = service.store.control(control)
    assert done is not None and not done.ok and "the name 'gw-3' is reserved" in done.outcome
    assert service.store.get("gw-3").state == "pending"  # type: ignore[union-attr]
    assert service.store._conn.execute("SELECT count(*) FROM issued_certs").fetchone()[0] == 0


async def test_an_allow_list_entry_approves_one_device_once(fleet: Any) -> None:
    agent, service, claimant = fleet
    service.store.allow_serials(["10000000deadbeef"], by="op", now_ms=agent.clock.now_ms())
    await claimant.ask("evil-1", new_device_key(), serial="10000000deadbeef")
    await answered(claimant, "evil-1", "approved")
    await claimant.ask("evil-2", new_device_key(), serial="10000000deadbeef")  # the same self-reported serial
    await answered(claimant, "evil-2", "pending")
    assert service.store.allow_used_by("10000000deadbeef") == "evil-1"
    with pytest.raises(IdentityError, match="a hardware serial number is 1 to 64 characters"):
        service.store.allow_serials([""], by="op", now_ms=agent.clock.now_ms())


async def test_one_flooding_connection_starves_no_other_device(fleet: Any) -> None:
    """20 requests from one connection: beyond its 6 a minute they are refused before they take
    from the claim's bucket; a new device is heard; the rejects are kept under the claim."""
    agent, service, claimant = fleet
    key = new_device_key()
    for _ in range(20):
        await claimant.ask("flood-1", key)
    await until(agent.clock, lambda: sum("over the connection 'ea-enrol-t-flood-1'" in r for r in rejects(agent)) == 14)
    await claimant.ask("dev-new", new_device_key())
    await answered(claimant, "dev-new", "pending")
    assert {r.sender for r in agent.rejects.list()} == {"claim"}


async def test_a_request_over_another_devices_connection_or_with_unknown_fields_is_refused(fleet: Any) -> None:
    agent, service, claimant = fleet
    await claimant.ask("dev-v", new_device_key(), client=topics.enrol_client_id(FLEET, "dev-w"))
    refused = await answered(claimant, "dev-v", "rejected")
    assert "its connection is 'ea-enrol-t-dev-w'" in refused.reason
    payload = msgspec.msgpack.encode({"device": "dev-u", "csr": certificate_request(new_device_key(), "dev-u").decode(),
                                      "admin": True})
    await claimant.transport.publish(topics.enrol_request(FLEET, "claim", topics.enrol_client_id(FLEET, "dev-u")),
                                     payload)
    await until(agent.clock, lambda: any("unknown field `admin`" in r for r in rejects(agent)))
    assert service.store.listed() == []


async def test_a_renewal_before_its_point_mints_no_certificate(fleet: Any) -> None:
    agent, service, claimant = fleet
    key = new_device_key()
    await claimant.ask("dev-1", key)
    await answered(claimant, "dev-1", "pending")
    service.store.add_control("approve", "dev-1", by="op", now_ms=agent.clock.now_ms())
    approved = await answered(claimant, "dev-1", "approved")
    csr = certificate_request(key, "dev-1").decode()
    for n in range(50):
        renewal = Envelope(id=f"r-{n}", kind=KIND_RENEW, sender="dev-1", receiver="leader",
                           ts_ms=agent.clock.now_ms(),
                           payload=msgspec.msgpack.encode(RenewRequest(device_id="dev-1", csr=csr)))
        reply = agent._on_up(renewal, None)  # type: ignore[arg-type]
        assert reply.status == "accepted"  # type: ignore[union-attr]
        assert decode(reply.body, RenewAnswer).cert == approved.cert  # type: ignore[union-attr]
    assert service.store._conn.execute("SELECT count(*) FROM issued_certs").fetchone()[0] == 1


async def test_a_pending_enrolment_not_asked_for_again_is_forgotten(tmp_path: Path) -> None:
    from agent.core.clock import SystemClock

    clock = SystemClock()
    broker = MemoryBroker(clock=clock)
    agent, service = await identity_leader(tmp_path, broker, clock, pending_expiry_s=0.5)
    claimant = await Claimant(broker).start()
    try:
        await claimant.ask("dev-gone", new_device_key())
        await answered(claimant, "dev-gone", "pending")
        await until(clock, lambda: service.store.get("dev-gone") is None, limit_s=30, step_s=0.1,
                    what="the pending record forgotten")
    finally:
        await service.stop()
        await claimant.transport.stop()
        await agent.stop()


def test_a_tokens_last_use_is_spent_once_by_leaders_asking_at_once(tmp_path: Path, leader_store: Path | str) -> None:
    """Eight leaders' connections spend a 3-use token at once: exactly 3 succeed."""
    import threading

    from agent.leader.identities import IdentityStore

    target = leader_store if isinstance(leader_store, str) else tmp_path / "leader.db"
    with IdentityStore.open(target) as store:
        store.add_token("race", uses=3, expires_ms=10**13, by="op", now_ms=0)
    stores = [IdentityStore.open(target) for _ in range(8)]
    start = threading.Barrier(len(stores))
    spent: list[bool] = []

    def spend(store: IdentityStore) -> None:
        start.wait()
        spent.append(store.take_token("race", 1))

    threads = [threading.Thread(target=spend, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    assert spent.count(True) == 3


async def test_the_first_request_goes_the_moment_the_claim_connection_opens(tmp_path: Path) -> None:
    """A device that cannot reach the enrolment listener at first asks as soon as it can, not an
    `ask_interval_s` later (here 10 minutes of virtual time)."""
    from agent.worker.identity import Enrolment
    from tests.e2e.agent_support import config

    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    agent, service = await identity_leader(tmp_path, broker, clock)
    cfg = config("worker", "dev-1", identity={"claim_url": "mqtts://gw:8884", "claim_username": "claim",
                                              "ask_interval_s": 600.0})
    files = IdentityFiles(tmp_path / "dev-1" / "identity")
    enrolment = Enrolment(cfg, files, files.key_pem(), clock)
    enrolment._transport = lambda: MemoryTransport(broker, enrolment.client_id)  # type: ignore[method-assign]
    broker.partition(enrolment.client_id)
    stopping = asyncio.Event()
    running = asyncio.create_task(enrolment.run(stopping))
    try:
        await until(clock, lambda: clock.now_ms() >= 30_000, step_s=1.0)
        assert service.store.get("dev-1") is None
        broker.heal(enrolment.client_id)
        await until(clock, lambda: service.store.get("dev-1") is not None, limit_s=20, step_s=0.5,
                    what="the request heard well before ask_interval_s")
    finally:
        stopping.set()
        await running
        await service.stop()
        await stop_all(agent, clock=clock)


async def test_a_device_no_leader_answers_asks_again_every_ask_interval_of_its_clock(tmp_path: Path) -> None:
    """The enrolment's pauses are the agent's clock's: 20 minutes of virtual time (the
    simulator's fleet time) see the request again every `ask_interval_s`, with no real wait."""
    from agent.worker.identity import Enrolment
    from tests.e2e.agent_support import config

    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    heard: list[bytes] = []
    ear = MemoryTransport(broker, "ear")
    await ear.subscribe(f"ea/enrol/v1/{FLEET}/#", lambda message: heard.append(bytes(message.payload)))
    await ear.start()
    cfg = config("worker", "dev-1", identity={"claim_url": "mqtts://gw:8884", "claim_username": "claim",
                                              "ask_interval_s": 600.0})
    files = IdentityFiles(tmp_path / "dev-1" / "identity")
    enrolment = Enrolment(cfg, files, files.key_pem(), clock,
                          connect=lambda config_, client_id: MemoryTransport(broker, client_id))
    stopping = asyncio.Event()
    running = asyncio.create_task(enrolment.run(stopping))
    try:
        await until(clock, lambda: len(heard) >= 1, limit_s=10, step_s=0.5, what="the first request")
        started = clock.now_ms()
        await until(clock, lambda: len(heard) >= 3, limit_s=1300, step_s=30.0, what="two requests more")
        assert 1_200_000 <= clock.now_ms() - started <= 1_260_000  # one each 600 s, not sooner
    finally:
        stopping.set()
        await running
        await ear.stop()


async def test_at_the_pending_bound_only_a_vouched_device_is_taken(tmp_path: Path) -> None:
    """max_pending reached: a new id with some serial or a made-up token is refused; a valid token
    or an unused allow-list entry is approved at once."""
    from agent.core.clock import SystemClock

    clock = SystemClock()
    broker = MemoryBroker(clock=clock)
    agent, service = await identity_leader(tmp_path, broker, clock, max_pending=2)
    claimant = await Claimant(broker).start()
    try:
        now = clock.now_ms()
        service.store.add_token("batch-9", uses=1, expires_ms=now + 60_000, by="op", now_ms=now)
        service.store.allow_serials(["40000000aa"], by="op", now_ms=now)
        for n in range(2):
            await claimant.ask(f"dev-{n}", new_device_key())
            await answered(claimant, f"dev-{n}", "pending")
        for name, fields in (("dev-s", {"serial": "1000000012345678"}), ("dev-t", {"token": "made-up"})):
            await claimant.ask(name, new_device_key(), **fields)
            assert "2 enrolments are pending already" in (await answered(claimant, name, "rejected")).reason
        await claimant.ask("dev-ok", new_device_key(), token="batch-9")
        await answered(claimant, "dev-ok", "approved")
        await claimant.ask("dev-al", new_device_key(), serial="40000000aa")
        await answered(claimant, "dev-al", "approved")
    finally:
        await service.stop()
        await claimant.transport.stop()
        await agent.stop()
