"""Where identities live on disk: a device's key, certificate and the fleet's CA certificate
(`IdentityFiles`, under `[identity] dir` of its data directory), and a leader's fleet CA with its
revocation list (`authority_files`, `fleet_authority`). Keys are 0600 in a 0700 folder; every
write is atomic (`agent.core.files`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from agent.core.config import AgentConfig, IdentitySection, resolve
from agent.core.errors import IdentityError
from agent.core.files import write_private_file

if TYPE_CHECKING:
    from agent.identity.authority import FleetAuthority

log = logging.getLogger(__name__)

KEY_FILE = "device.key"
CERT_FILE = "device.crt"
CA_FILE = "fleet-ca.crt"
CA_KEY = "ca.key"
CA_CERT = "ca.crt"
CRL_FILE = "crl.pem"


def _private_dir(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)


@dataclass(frozen=True)
class IdentityFiles:
    """Where a device keeps its identity."""

    dir: Path

    @classmethod
    def of(cls, config: AgentConfig, base: Path) -> IdentityFiles:
        section = config.identity or IdentitySection()
        return cls(resolve(base, section.dir))

    @property
    def key(self) -> Path:
        return self.dir / KEY_FILE

    @property
    def cert(self) -> Path:
        return self.dir / CERT_FILE

    @property
    def ca(self) -> Path:
        return self.dir / CA_FILE

    def key_pem(self) -> bytes:
        """The device's key, made on first use (0600 in a 0700 folder)."""
        from agent.identity.device_key import new_device_key

        try:
            return self.key.read_bytes()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise IdentityError(f"{self.key}: cannot read the device key: {exc.strerror or exc}") from None
        _private_dir(self.dir)
        pem = new_device_key()
        write_private_file(self.key, pem, 0o600)
        log.info("made the device key %s", self.key)
        return pem

    def store(self, cert_pem: bytes, ca_pem: bytes | None = None) -> None:
        if ca_pem is not None:
            write_private_file(self.ca, ca_pem, 0o644)
        write_private_file(self.cert, cert_pem, 0o644)


def with_identity(config: AgentConfig, files: IdentityFiles) -> AgentConfig:
    """The config with the device's certificate, key and CA as its broker credentials."""
    mqtt = msgspec.structs.replace(config.mqtt, tls_cert=str(files.cert), tls_key=str(files.key),
                                   tls_ca=config.mqtt.tls_ca or str(files.ca), password_file="", username="")
    return msgspec.structs.replace(config, mqtt=mqtt)


def authority_files(section: IdentitySection, base: Path) -> tuple[Path, Path, Path]:
    """(CA key, CA certificate, CRL) of the leader whose data directory is `base`."""
    folder = resolve(base, section.dir)
    crl = Path(section.crl_file) if section.crl_file else folder / CRL_FILE
    return folder / CA_KEY, folder / CA_CERT, crl


def fleet_authority(section: IdentitySection, base: Path, *, fleet: str, now_ms: int) -> FleetAuthority:
    """The fleet's CA, made (with an empty CRL) when there is none yet."""
    from agent.identity.authority import FleetAuthority, new_authority  # certificate code: gateway only

    key_path, cert_path, crl_path = authority_files(section, base)
    if not key_path.exists() and not cert_path.exists():
        _private_dir(key_path.parent)
        key_pem, cert_pem = new_authority(f"edge-agent fleet {fleet}", now_ms=now_ms)
        write_private_file(key_path, key_pem, 0o600)
        write_private_file(cert_path, cert_pem, 0o644)
        authority = FleetAuthority(key_pem, cert_pem)
        write_private_file(crl_path, authority.revocation_list((), now_ms=now_ms), 0o644)
        log.info("made the fleet CA %s", cert_path)
        return authority
    try:
        return FleetAuthority(key_path.read_bytes(), cert_path.read_bytes())
    except OSError as exc:
        raise IdentityError(f"{exc.filename}: cannot read the fleet CA: {exc.strerror or exc}") from None


__all__ = ["CA_CERT", "CA_FILE", "CA_KEY", "CERT_FILE", "CRL_FILE", "KEY_FILE", "IdentityFiles", "authority_files",
           "fleet_authority", "with_identity"]
