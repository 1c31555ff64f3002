"""The renewal of the device's certificate over its own authenticated channel (a part of the
worker with `[identity]`); see `IdentityRenewal`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.core.durations import utc_iso
from agent.core.errors import CodecError, IdentityError
from agent.identity.files import IdentityFiles
from agent.service.parts import Collectors, PartBase
from agent.worker.identity import own_certificate

if TYPE_CHECKING:
    from agent.worker.agent import WorkerAgent
    from agent.worker.env import DeviceEnv

log = logging.getLogger(__name__)


class IdentityRenewal(PartBase):
    """Renews the device's certificate over its own authenticated channel, two thirds into its
    life (`CertificateInfo.renew_at_ms`): a request for the same key, answered with the new
    certificate, which is stored and taken into use by restarting the agent's parts in the
    process (`restart`; the outbox keeps every message). A device that was offline past that
    point renews as soon as it is connected again (the old certificate is still valid); one
    that comes back after its expiry cannot connect, and enrols again at its next start.
    Checked when the connection opens and at least every `check_s`; a failed renewal is tried
    again at the next check."""

    name = "identity"

    def __init__(self, worker: WorkerAgent, files: IdentityFiles, restart: Callable[[], None] | None, *,
                 check_s: float = 3600.0) -> None:
        self.worker = worker
        self.files = files
        self.restart = restart
        self.check_s = check_s
        self.clock = worker.clock
        self.renewed = 0
        self.failures = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def collectors(self) -> Collectors:
        from agent.service.collectors import snapshot_collector

        def snapshot() -> dict[str, object]:
            from agent.identity.certificates import read_certificate

            try:
                info = read_certificate(self.files.cert.read_bytes())
                left = (info.not_after_ms - self.clock.now_ms()) / 1000
            except (OSError, IdentityError):
                left = 0.0
            return {"certificate_expires_in_seconds": left, "renewals": self.renewed, "renewal_failures": self.failures}

        return {"identity": snapshot_collector(
            "ea_identity", snapshot, counters=("renewals", "renewal_failures"),
            help_={"certificate_expires_in_seconds": "Seconds until this device's certificate expires (renewed at"
                                                     " two thirds of its life).",
                   "renewals": "Certificates renewed by this agent since it started.",
                   "renewal_failures": "Renewals that failed (tried again at the next check)."})}

    async def start(self) -> None:
        self.worker.transport.connected.add_listener(self._on_connection)
        self._task = asyncio.create_task(self._run(), name="identity-renewal")

    async def stop(self) -> None:
        self.worker.transport.connected.remove_listener(self._on_connection)
        from agent.core.tasks import cancel_and_wait

        await cancel_and_wait(self._task)

    def _on_connection(self, is_open: bool) -> None:
        if is_open:
            self._wake.set()

    def _renew_at_ms(self) -> int | None:
        from agent.identity.certificates import read_certificate

        try:
            return read_certificate(self.files.cert.read_bytes()).renew_at_ms
        except (OSError, IdentityError):
            return None

    async def _run(self) -> None:
        while True:
            renew_at = self._renew_at_ms()
            now = self.clock.now_ms()
            if renew_at is not None and now >= renew_at and self.worker.transport.connected.is_open:
                if await self.renew_once():
                    return  # the parts restart with the new certificate
            wait_s = self.check_s if renew_at is None or renew_at <= now else min(self.check_s, (renew_at - now) / 1000)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await self.clock.wait_for(self._wake.wait(), max(wait_s, 1.0))

    async def renew_once(self) -> bool:
        """Ask for a new certificate now; True when it is stored (and the restart asked for)."""
        from agent.core.codec import decode
        from agent.core.errors import DeliveryError, NotConnected
        from agent.identity.certificates import read_certificate
        from agent.identity.device_key import certificate_request
        from agent.identity.messages import KIND_RENEW, RenewAnswer, RenewRequest

        key_pem = self.files.key.read_bytes()
        device = self.worker.device_id
        try:
            current = read_certificate(self.files.cert.read_bytes())
            body = await self.worker.link.request(KIND_RENEW, RenewRequest(
                device_id=device, csr=certificate_request(key_pem, device).decode("ascii")))
            answer = decode(body, RenewAnswer)
            info = own_certificate(answer.cert, device, key_pem)
            if info.not_after_ms <= current.not_after_ms:
                raise IdentityError("the renewed certificate does not outlive the current one")
        except (DeliveryError, NotConnected, CodecError, IdentityError, OSError) as exc:
            self.failures += 1
            log.warning("certificate renewal of %s failed (tried again later): %s", device, exc)
            return False
        self.files.store(answer.cert.encode("ascii"))
        self.renewed += 1
        log.info("renewed the certificate of %s: serial %x valid until %s", device, info.serial,
                 utc_iso(info.not_after_ms))
        if self.restart is not None:
            self.restart()
        return True


async def identity_part(worker: WorkerAgent, env: DeviceEnv) -> IdentityRenewal | None:
    """The certificate's renewal; None without `[identity]`."""
    if worker.config.identity is None:
        return None
    return IdentityRenewal(worker, IdentityFiles.of(worker.config, worker.data_dir), env.restart)


__all__ = ["IdentityRenewal", "identity_part"]
