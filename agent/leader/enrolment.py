"""The leader's side of device identities (docs/service.md, "Device identity").

    IdentityService (a part of the leader; on with `[identity]`)
    ├── the fleet's CA under DATA_DIR/identity (ca.key 0600, ca.crt), made at the first start
    ├── ea/enrol/v1/{fleet}/+/+/request  ──► checked, bounded, recorded (pending, or approved by
    │        the allow-list or a batch's token) ──► EnrolAnswer on .../answer
    ├── identity.renew on a device's up topic ──► a new certificate for the same key, in the reply
    ├── identity_controls (approve, reject, revoke: `edge-agent devices`, the console), applied
    │        every `poll_s`: a revocation refuses the device's messages at once
    │        (`LeaderAgent.revoked`), writes the CRL and runs `identity.broker_reload`
    └── the CRL (`identity.crl_file`) written again at start and every day (it expires in 30)

Every refusal (claim not heard, a flood, a request for another device id, a weak key, a key
other than the one on record, a revoked device, a reserved name) is recorded in the rejects with
its reason, and nothing else changes. The rejects and the log are keyed on the claim credential,
never on the id the request names: a flood through one credential cannot evict another device's
evidence.

What a holder of the claim credential (on every device being provisioned) cannot do:
- take a name that is not a device's (`reserved_reason`): the fleet's leaders (configured, and
  every leader that marked itself in the registry), its operators, the claim credentials, the
  names in `[identity] reserved` and the broker's client ids (`ea-...`). Checked where a request
  is recorded and again where any certificate is signed (approval by hand, token, allow-list,
  renewal);
- ask for another connection's device, or hear its answers: a request's connection level is its
  client id (the broker's `%c`), which must be `ea-enrol-{fleet}-{device}`;
- starve another device: requests are counted per connection, then per claim, then in all;
- spend an allow-list entry twice, or a token's last use twice (`IdentityStore`);
- mint certificates: a renewal before its point gets the certificate on record, not a new one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import TYPE_CHECKING

import msgspec
from cryptography.hazmat.primitives.serialization import Encoding

from agent.core.codec import Envelope, Reply, decode
from agent.core.errors import CodecError, EdgeAgentError, IdentityError, TransportError, store_log_level
from agent.core.ratelog import RateLimitedLog
from agent.core.sql import ServerUrl
from agent.core.tasks import cancel_and_wait
from agent.identity.authority import FleetAuthority
from agent.identity.certificates import CertificateInfo, CertificateRequest, read_certificate, read_request
from agent.identity.files import authority_files, fleet_authority
from agent.identity.messages import KIND_RENEW, EnrolAnswer, EnrolRequest, RenewAnswer, RenewRequest
from agent.leader.identities import Control, Identity, IdentityStore, reserved_reason
from agent.leader.rates import DeviceRates
from agent.service.files import write_private_file
from agent.service.parts import Collectors, PartBase
from agent.transport import topics
from agent.transport.base import InboundMessage

if TYPE_CHECKING:
    from agent.leader.agent import LeaderAgent
    from agent.leader.env import GatewayEnv

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 * 1024
CRL_REFRESH_S = 86_400.0
PENDING_SWEEP_S = 60.0
RELOAD_TIMEOUT_S = 30.0


class IdentityService(PartBase):
    name = "identity"

    def __init__(self, leader: LeaderAgent, store: IdentityStore, authority: FleetAuthority, *,
                 poll_s: float = 1.0) -> None:
        assert leader.config.identity is not None
        self.leader = leader
        self.section = leader.config.identity
        self.store = store
        self.authority = authority
        self.clock = leader.clock
        self.fleet = leader.config.agent.fleet
        self.poll_s = poll_s
        self._claims = frozenset(self.section.claims)
        # the intake's token buckets (a burst of a minute's requests, refilled over the minute), in
        # order: a connection's flood is refused before it takes from its claim's or the total
        self._buckets = tuple(
            (DeviceRates(self.clock, rate_per_s=per_min / 60, burst=per_min), per_min, key, what)
            for per_min, key, what in (
                (self.section.connection_rate_per_min, "client", "over the connection {client!r}"),
                (self.section.claim_rate_per_min, "claim", "through the claim credential {claim!r}"),
                (self.section.total_rate_per_min, "all", "in all")))
        self._pending_swept_s = -PENDING_SWEEP_S
        self._log = RateLimitedLog(log, self.clock, 60.0)
        self._task: asyncio.Task[None] | None = None
        self._crl_written_s = -CRL_REFRESH_S
        self.answered = 0
        self.refused = 0
        _, _, self.crl_path = authority_files(self.section, leader.data_dir)
        # every enrolment request, or with other leaders the group's share of them
        self._requests = topics.leader_enrol_filter(self.fleet, leader.config.leader.shared_group)

    def collectors(self) -> Collectors:
        from agent.service.collectors import snapshot_collector

        def snapshot() -> dict[str, object]:
            states = {state: self.store.count(state) for state in ("pending", "approved", "rejected", "revoked")}
            return {"devices": states, "answered": self.answered, "refused": self.refused}

        return {"identity": snapshot_collector(
            "ea_identity", snapshot, counters=("answered", "refused"), label="state",
            help_={"devices": "Device identities by state (pending enrolments wait for an operator).",
                   "answered": "Enrolment answers sent.",
                   "refused": "Enrolment and renewal requests refused (see edge-agent rejects)."})}

    def register(self) -> None:
        self.leader.register_route(KIND_RENEW, RenewRequest, self._renew)
        self.leader.revoked = self.store.revoked_devices()

    async def start(self) -> None:
        await self.leader.transport.subscribe(self._requests, self._on_request)
        self._task = asyncio.create_task(self._run(), name="identity-controls")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        try:
            await self.leader.transport.unsubscribe(self._requests)
        except TransportError:
            pass
        self.store.close()

    # -- names -------------------------------------------------------------------------------
    def reserved_reason(self, device: str) -> str:
        """Why `device` is a name no device may hold ("" when it may): `identities.reserved_reason`
        with this fleet's leaders (configured, and every one that marked itself in the registry)."""
        return reserved_reason(device, leaders={self.leader.device_id} | self.leader.registry.leader_names(),
                               operators=self.leader.config.leader.operators, claims=self._claims,
                               reserved=self.section.reserved)

    # -- enrolment -----------------------------------------------------------------------------
    def _refuse(self, topic: str, reason: str, payload: bytes, claim: str) -> None:
        """Recorded and logged under the claim credential: the one thing the broker proved."""
        self.refused += 1
        self._log.warning(f"enrol:{claim}", f"enrolment refused on {topic}: {reason}")
        self.leader.rejects.record(topic=topic, reason=reason, payload=payload, sender=claim, kind="enrol")

    def _flooded(self, claim: str, client: str) -> str:
        """Why this request is one too many ("" when it is not)."""
        keys = {"client": client, "claim": claim, "all": "all"}
        for bucket, per_min, key, what in self._buckets:
            if bucket.take(keys[key]):
                return f"enrolment flood: over {per_min} requests a minute " + what.format(client=client, claim=claim)
        return ""

    async def _on_request(self, message: InboundMessage) -> None:
        topic, payload = message.topic, bytes(message.payload)
        where = topics.parse_enrol_request(topic)
        if where is None:
            return
        claim, client = where
        if claim not in self._claims:
            self._refuse(topic, f"the claim credential {claim!r} is not one this leader hears (identity.claims)",
                         payload, claim)
            return
        flood = self._flooded(claim, client)
        if flood:
            self._refuse(topic, flood, b"", claim)
            return
        if len(payload) > MAX_REQUEST_BYTES:
            self._refuse(topic, f"enrolment request of {len(payload)} bytes, over {MAX_REQUEST_BYTES}", b"", claim)
            return
        device = ""
        try:
            request = decode(payload, EnrolRequest)
            device = request.device
            if client != self._client_of(device):
                raise IdentityError(f"the request names device {device!r}, its connection is {client!r}"
                                    f" (a device enrols as {self._client_of(device)!r})")
            answer = self._enrol(request, read_request(request.csr, device_id=device), claim)
        except (CodecError, IdentityError) as exc:
            self._refuse(topic, str(exc), payload, claim)
            await self._answer(claim, client, EnrolAnswer(device=device or "-", status="rejected",
                                                          reason=str(exc)[:512]))
            return
        except EdgeAgentError as exc:
            log.warning("enrolment of %s not recorded: %s", device, exc)
            return
        await self._answer(claim, client, answer)

    def _enrol(self, request: EnrolRequest, csr: CertificateRequest, claim: str) -> EnrolAnswer:
        now = self.clock.now_ms()
        reserved = self.reserved_reason(request.device)
        if reserved:
            raise IdentityError(reserved)
        known = self.store.get(request.device)
        if known is None and self.store.count("pending") >= self.section.max_pending \
                and not self.store.vouched_for(serial=request.serial, token=request.token, now_ms=now):
            # (a device with a valid token or an unused allow-list entry does not wait: never refused here)
            raise IdentityError(f"{self.section.max_pending} enrolments are pending already (identity.max_pending)")
        record = self.store.record_request(
            device=request.device, fingerprint=csr.fingerprint, csr=request.csr, hw_serial=request.serial,
            machine_id=request.machine_id, agent_version=request.agent_version, claim=claim, now_ms=now)
        if record.state == "pending":
            if self.store.take_allowed(request.serial, request.device, now):
                record = self._approve(record, by=f"allow-list (serial {request.serial})", csr=csr)
            elif request.token and self.store.take_token(request.token, now):
                record = self._approve(record, by="enrolment token", csr=csr)
            elif request.token:
                log.warning("enrolment of %s: its token is unknown, used up or expired: left pending", request.device)
            elif request.serial and (used := self.store.allow_used_by(request.serial)) not in (None, request.device):
                log.warning("enrolment of %s: the allow-list's serial %s approved %s already: left pending",
                            request.device, request.serial, used)
        return self._answer_of(record)

    def _answer_of(self, record: Identity) -> EnrolAnswer:
        if record.state == "approved":
            return EnrolAnswer(device=record.device, status="approved", cert=record.cert,
                               ca=self.authority.cert_pem.decode("ascii"))
        if record.state == "pending":
            return EnrolAnswer(device=record.device, status="pending")
        return EnrolAnswer(device=record.device, status="rejected", reason=record.reason or record.state)

    def _approve(self, record: Identity, *, by: str, csr: CertificateRequest | None = None) -> Identity:
        """Sign the pending request (`csr`: already checked, else the one on record)."""
        if csr is None:
            csr = read_request(self.store.request_pem(record.device), device_id=record.device)
        _, info = self._issue(csr, by=by)
        log.info("approved %s (%s): certificate serial %x", record.device, by, info.serial)
        approved = self.store.get(record.device)
        assert approved is not None
        return approved

    def _issue(self, csr: CertificateRequest, *, by: str) -> tuple[bytes, CertificateInfo]:
        """Sign a checked request with the fleet's CA and record the certificate (approval or
        renewal): the one place a device certificate is made, so a reserved name is refused here."""
        reserved = self.reserved_reason(csr.device_id)
        if reserved:
            raise IdentityError(reserved)
        now = self.clock.now_ms()
        cert = self.authority.issue_device(csr, now_ms=now, days=self.section.cert_days,
                                           skew_s=self.section.clock_skew_s)
        info = read_certificate(cert)
        self.store.issued(csr.device_id, cert=cert.decode("ascii"), serial=info.serial,
                          not_after_ms=info.not_after_ms, by=by, now_ms=now)
        return cert, info

    def _client_of(self, device: str) -> str:
        return topics.enrol_client_id(self.fleet, device)

    async def _answer(self, claim: str, client: str, answer: EnrolAnswer) -> None:
        try:
            await self.leader.transport.publish(topics.enrol_answer(self.fleet, claim, client),
                                                msgspec.msgpack.encode(answer), qos=1)
            self.answered += 1
        except (TransportError, topics.TopicError) as exc:
            log.debug("enrolment answer to %s not sent: %s (it asks again)", client, exc)

    # -- renewal -------------------------------------------------------------------------------
    def _renew(self, env: Envelope, message: msgspec.Struct) -> Reply:
        assert isinstance(message, RenewRequest)
        device = env.sender
        try:
            record = self.store.get(device)
            if record is None or record.state != "approved":
                raise IdentityError(f"device {device} is {record.state if record else 'not enrolled'}: no renewal")
            csr = read_request(message.csr, device_id=device)
            if csr.fingerprint != record.fingerprint:
                raise IdentityError(f"the renewal of {device} is for another key than the one on record")
            on_record = read_certificate(record.cert)
            if self.clock.now_ms() < on_record.renew_at_ms - self.section.clock_skew_s * 1000:
                # not due: no new certificate. The one on record goes back (a device whose renewal
                # answer was lost holds an older one); asking again and again mints nothing
                return Reply(id=env.id, status="accepted", body=msgspec.msgpack.encode(RenewAnswer(cert=record.cert)))
            cert, info = self._issue(csr, by=record.decided_by)
        except IdentityError as exc:
            self.refused += 1
            self.leader.rejects.record(topic=topics.up(self.fleet, device), reason=str(exc), payload=env.payload,
                                       sender=device, msg_id=env.id, kind=env.kind)
            return Reply(id=env.id, status="rejected", reason=str(exc)[:512])
        except EdgeAgentError as exc:
            return Reply(id=env.id, status="busy", retry_after_ms=5_000, reason=str(exc))
        log.info("renewed the certificate of %s: serial %x", device, info.serial)
        return Reply(id=env.id, status="accepted", body=msgspec.msgpack.encode(RenewAnswer(cert=cert.decode("ascii"))))

    # -- controls and the CRL ------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._follow_revocations()
                if self.clock.monotonic() - self._crl_written_s >= CRL_REFRESH_S:
                    await self.write_crl(reload=False)
                for control in self.store.controls():
                    if self.store.claim(control.id, self.leader.device_id):  # another leader's, else
                        await self._apply(control)
                if self.clock.monotonic() - self._pending_swept_s >= min(PENDING_SWEEP_S,
                                                                         self.section.pending_expiry_s / 2):
                    self._pending_swept_s = self.clock.monotonic()
                    expired = self.store.expire_pending(self.clock.now_ms() - int(self.section.pending_expiry_s * 1000))
                    if expired:
                        log.info("forgot %d pending enrolment(s) not asked for in %g s: %s", len(expired),
                                 self.section.pending_expiry_s, ", ".join(expired[:10]))
            except EdgeAgentError as exc:
                self._log.log(store_log_level(exc, logging.WARNING), "identity",
                              f"identity controls not applied: {exc}")
            await self.clock.sleep(self.poll_s)

    async def _follow_revocations(self) -> None:
        """Several leaders share the store: a device another leader revoked is refused here too,
        and this leader's CRL (its broker's, maybe) says so, within a tick."""
        news = self.store.revoked_devices() - self.leader.revoked
        if news:
            self.leader.revoked |= news
            said = await self.write_crl(reload=True)
            log.warning("revoked by another leader: %s; %s", ", ".join(sorted(news)), said)

    async def _apply(self, control: Control) -> None:
        record = self.store.get(control.device)
        ok, outcome = False, ""
        try:
            if record is None:
                outcome = f"no enrolment of {control.device}"
            elif control.action == "approve":
                if record.state != "pending":
                    outcome = f"{control.device} is {record.state}, not pending"
                else:
                    record = self._approve(record, by=control.by)
                    await self._answer(record.claim, self._client_of(record.device), self._answer_of(record))
                    ok, outcome = True, f"approved {control.device}"
            elif control.action == "reject":
                if record.state != "pending":
                    outcome = f"{control.device} is {record.state}, not pending"
                else:
                    reason = control.reason or f"rejected by {control.by}"
                    self.store.decide(control.device, "rejected", by=control.by, reason=reason,
                                      now_ms=self.clock.now_ms())
                    await self._answer(record.claim, self._client_of(record.device),
                                       EnrolAnswer(device=record.device, status="rejected", reason=reason))
                    ok, outcome = True, f"rejected {control.device}"
            elif control.action == "revoke":
                if record.state != "approved":
                    outcome = f"{control.device} is {record.state}, not enrolled"
                else:
                    self.store.decide(control.device, "revoked", by=control.by,
                                      reason=control.reason or f"revoked by {control.by}", now_ms=self.clock.now_ms())
                    self.leader.revoked.add(control.device)  # its messages are refused from now on
                    reloaded = await self.write_crl(reload=True)
                    ok, outcome = True, f"revoked {control.device}; {reloaded}"
                    log.warning("revoked %s (by %s): %s", control.device, control.by, reloaded)
        except IdentityError as exc:
            outcome = str(exc)
        self.store.applied(control.id, ok=ok, outcome=outcome, now_ms=self.clock.now_ms())

    async def write_crl(self, *, reload: bool) -> str:
        """Write the CRL of the revoked certificates (and, with `reload`, run the broker's reload
        command); what was done, in words."""
        now = self.clock.now_ms()
        crl = self.authority.revocation_list(self.store.revoked_certs(now), now_ms=now)
        await asyncio.to_thread(write_private_file, self.crl_path, crl, 0o644)
        self._crl_written_s = self.clock.monotonic()
        command = self.section.broker_reload
        if not reload or not command:
            return f"CRL written to {self.crl_path}" + ("" if command else " (no identity.broker_reload to run)")
        try:
            proc = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(proc.communicate(), RELOAD_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            return f"CRL written to {self.crl_path}; the broker's reload ({command[0]}) failed: {exc}"
        if proc.returncode:
            tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            return f"CRL written to {self.crl_path}; the broker's reload exited {proc.returncode}: {tail[0][:200]}"
        return f"CRL written to {self.crl_path}; the broker reloaded it"


async def identity_part(leader: LeaderAgent, env: GatewayEnv) -> IdentityService | None:
    """Device identities; None without `[identity]`."""
    section = leader.config.identity
    if section is None:
        return None
    authority = await asyncio.to_thread(fleet_authority, section, leader.data_dir, fleet=leader.config.agent.fleet,
                                        now_ms=leader.clock.now_ms())
    # where the registry is: leader.db, or the fleet's PostgreSQL that every leader shares
    store = IdentityStore.open(leader.shared)
    try:
        ours = hashlib.sha256(authority.certificate.public_bytes(Encoding.DER)).hexdigest()
        # several leaders sign for one fleet: with one CA (on SQLite the store is this leader's alone)
        fleets = store.fleet_authority(ours) if isinstance(leader.shared, ServerUrl) else ours
        if fleets != ours:
            _, cert_path, _ = authority_files(section, leader.data_dir)
            raise IdentityError(f"{cert_path}: this leader's CA (sha256 {ours[:16]}) is not the fleet's (sha256"
                                f" {fleets[:16]}, in {store.path}): copy ca.crt and ca.key from a leader of the"
                                " fleet into its identity folder")
    except BaseException:
        store.close()
        raise
    service = IdentityService(leader, store, authority)
    service.register()
    return service


__all__ = ["IdentityService", "identity_part"]
