"""The device's own identity: its key, its enrolment, its certificate (docs/service.md, "Device
identity").

    config = await enrolment_stage(config, base, clock, env, Starting(stopping=stop_event))

At the start of a worker with `[identity]`: the device makes its P-256 key once (0600, in
`DATA_DIR/identity`, never sent anywhere); while it has no certificate, or only an expired one,
it enrols: a certificate request with its hardware identity goes to the leader over the broker's
enrolment listener, with the fleet's claim credential
(`ea/enrol/v1/{fleet}/{claim}/ea-enrol-{fleet}-{device}/request`, the connection's client id as
its level), sent as soon as the connection is up and again every `ask_interval_s` until an
operator (or the allow-list, or a batch's token) approves it. The approved certificate and the
fleet's CA are written next to the key, and the worker connects with them: mutual TLS, the
certificate's subject being its MQTT username.

Renewal runs over the device's own authenticated channel: `agent.worker.renewal`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import msgspec

from agent.core.clock import Clock
from agent.core.config import AgentConfig
from agent.core.durations import utc_iso
from agent.core.errors import CodecError, ConfigError, IdentityError, TransportError
from agent.identity.files import IdentityFiles, with_identity
from agent.transport import topics
from agent.transport.base import InboundMessage, Transport

if TYPE_CHECKING:
    from agent.identity.certificates import CertificateInfo
    from agent.service.parts import Starting
    from agent.worker.env import DeviceEnv

log = logging.getLogger(__name__)
T = TypeVar("T")



def hardware_identity() -> tuple[str, str]:
    """(serial number, machine id) of this machine, "" where it has none (a Pi's serial is in
    /proc/cpuinfo or the device tree; systemd keeps /etc/machine-id)."""
    serial = ""
    for path in ("/sys/firmware/devicetree/base/serial-number",):
        with contextlib.suppress(OSError):
            serial = Path(path).read_bytes().rstrip(b"\x00\n").decode("ascii", "replace")
    if not serial:
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
                name, _, value = line.partition(":")
                if name.strip().lower() == "serial":
                    serial = value.strip()
    machine = ""
    with contextlib.suppress(OSError):
        machine = Path("/etc/machine-id").read_text().strip()
    return serial[:64], machine[:64]


def own_certificate(pem: bytes | str, device: str, key_pem: bytes) -> CertificateInfo:
    """The certificate in `pem`, checked to be this device's, for its own key (`IdentityError`
    otherwise): what an approval, a renewal and a start take."""
    from agent.identity.certificates import read_certificate
    from agent.identity.device_key import device_key_fingerprint

    info = read_certificate(pem)
    if info.subject != device or info.fingerprint != device_key_fingerprint(key_pem):
        raise IdentityError("the certificate is not for this device and key")
    return info


def usable_certificate(files: IdentityFiles, key_pem: bytes, now_ms: int, device: str) -> bool:
    """Whether the stored certificate is this device's, for its key, and not expired (an
    expired one: say so)."""
    try:
        info = own_certificate(files.cert.read_bytes(), device, key_pem)
    except FileNotFoundError:
        return False
    except (OSError, IdentityError) as exc:
        log.warning("%s: not a usable certificate (%s): enrolling again", files.cert, exc)
        return False
    if info.expired(now_ms):
        log.error("the device certificate expired at %s: this device must enrol again (an operator approves it)",
                  utc_iso(info.not_after_ms))
        return False
    return True


async def enrolment_stage(config: AgentConfig, base: Path, clock: Clock, env: DeviceEnv,
                          starting: Starting) -> AgentConfig | None:
    """The stage before the worker's assembly: the config to run with, unchanged without
    `[identity]`; else with the device's own certificate, enrolling first when it has none
    (`starting.enrolling` told first; None: stopped while enrolling)."""
    if config.identity is None:
        return config
    files = IdentityFiles.of(config, base)
    key_pem = files.key_pem()
    if not usable_certificate(files, key_pem, clock.now_ms(), config.agent.device_id):
        starting.enrolling(config)
        if not await Enrolment(config, files, key_pem, clock, connect=env.claim_transport).run(starting.stopping):
            return None
    return with_identity(config, files)


class Enrolment:
    """One enrolment: ask over the claim connection until the answer is approved."""

    def __init__(self, config: AgentConfig, files: IdentityFiles, key_pem: bytes, clock: Clock, *,
                 connect: Callable[[AgentConfig, str], Transport] | None = None) -> None:
        """`connect`: the connection to ask on, given the config and the client id (default:
        the broker's enrolment listener at `[identity] claim_url`)."""
        assert config.identity is not None
        self._connect = connect
        self.config = config
        self.section = config.identity
        self.files = files
        self.key_pem = key_pem
        self.clock = clock
        self.device = config.agent.device_id
        fleet, claim = config.agent.fleet, self.section.claim_username
        # the broker's ACL lets a connection ask and hear only under its own client id
        self.client_id = topics.enrol_client_id(fleet, self.device)
        self.request_topic = topics.enrol_request(fleet, claim, self.client_id)
        self.answer_topic = topics.enrol_answer(fleet, claim, self.client_id)
        self._answers: asyncio.Queue[bytes] = asyncio.Queue(maxsize=16)

    def _request(self) -> bytes:
        from agent import __version__
        from agent.identity.device_key import certificate_request
        from agent.identity.messages import EnrolRequest

        serial, machine = hardware_identity()
        token = ""
        if self.section.token_file:
            try:
                token = Path(self.section.token_file).read_text().strip()[:128]
            except OSError as exc:
                raise ConfigError("identity", "token_file", f"cannot read: {exc.strerror or exc}") from None
        return msgspec.msgpack.encode(EnrolRequest(
            device=self.device, csr=certificate_request(self.key_pem, self.device).decode("ascii"),
            serial=serial, machine_id=machine, agent_version=__version__[:64], token=token))

    def _transport(self) -> Transport:
        if self._connect is not None:
            return self._connect(self.config, self.client_id)
        from agent.transport.mqtt import MqttTransport, credentials

        s = self.section
        return MqttTransport.from_url(
            s.claim_url, client_id=self.client_id, clock=self.clock,
            **credentials(s.claim_url, username=s.claim_username, password_file=s.claim_password_file,
                          tls_ca=s.claim_ca or self.config.mqtt.tls_ca, tls_cert="", tls_key="", source="identity"),
            keepalive_s=self.config.mqtt.keepalive_s, reconnect_min_s=self.config.mqtt.reconnect_min_s,
            reconnect_max_s=self.config.mqtt.reconnect_max_s, clean_start=True, session_expiry_s=0)

    def _on_answer(self, message: InboundMessage) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self._answers.put_nowait(bytes(message.payload))

    async def run(self, stopping: asyncio.Event) -> bool:
        """True once approved and stored; False when `stopping` is set first."""
        request = self._request()
        transport = self._transport()
        from agent.identity.device_key import device_key_fingerprint

        # the key's fingerprint is what `devices pending` shows: an operator compares before approving
        log.info("enrolling %s (key %s) with the claim credential %r at %s", self.device,
                 device_key_fingerprint(self.key_pem)[:16], self.section.claim_username, self.section.claim_url)
        await transport.subscribe(self.answer_topic, self._on_answer)
        await transport.start()
        try:
            while not stopping.is_set():
                if not transport.connected.is_open:  # the first request goes the moment it connects
                    await self._until(transport.connected.wait_open(), stopping, self.section.ask_interval_s)
                    continue
                with contextlib.suppress(TransportError):
                    await transport.publish(self.request_topic, request, qos=1)
                deadline = self.clock.now_ms() + int(self.section.ask_interval_s * 1000)
                while (left := deadline - self.clock.now_ms()) > 0 and not stopping.is_set():
                    answer = await self._until(self._answers.get(), stopping, left / 1000)
                    if answer is not None and self._take(answer) == "approved":
                        return True
            return False
        finally:
            await transport.stop()

    async def _until(self, waiting: Awaitable[T], stopping: asyncio.Event, timeout_s: float) -> T | None:
        """What `waiting` gives within `timeout_s` of the agent's clock (the simulator's fleet
        time there); None when it did not, or `stopping` came first."""
        getting = asyncio.ensure_future(waiting)
        stop = asyncio.ensure_future(stopping.wait())
        try:
            with contextlib.suppress(TimeoutError):
                await self.clock.wait_for(asyncio.wait((getting, stop), return_when=asyncio.FIRST_COMPLETED),
                                          timeout_s)
        finally:
            for task in (getting, stop):
                task.cancel()
        return getting.result() if getting.done() and not getting.cancelled() else None

    def _take(self, payload: bytes) -> str:
        """Apply one answer; its status ("" when it was not for us or not usable)."""
        from agent.core.codec import decode
        from agent.identity.certificates import read_certificate
        from agent.identity.messages import EnrolAnswer

        try:
            answer = decode(payload, EnrolAnswer)
        except CodecError as exc:
            log.warning("enrolment: an undecodable answer: %s", exc)
            return ""
        if answer.device != self.device:
            return ""
        if answer.status == "pending":
            log.info("enrolment of %s is pending: an operator approves it (edge-agent devices approve %s)",
                     self.device, self.device)
            return "pending"
        if answer.status == "rejected":
            log.error("enrolment of %s refused: %s", self.device, answer.reason or "no reason given")
            return "rejected"
        try:
            info = own_certificate(answer.cert, self.device, self.key_pem)
            if not answer.ca:
                raise IdentityError("no CA certificate with it")
            read_certificate(answer.ca)
        except IdentityError as exc:
            log.error("enrolment of %s: the approved answer is not usable: %s", self.device, exc)
            return ""
        self.files.store(answer.cert.encode("ascii"), answer.ca.encode("ascii"))
        log.info("enrolled %s: certificate serial %x valid until %s", self.device, info.serial,
                 utc_iso(info.not_after_ms))
        return "approved"


__all__ = ["Enrolment", "enrolment_stage", "hardware_identity", "own_certificate", "usable_certificate"]
