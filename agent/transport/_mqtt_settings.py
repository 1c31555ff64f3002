"""Settings helpers of `MqttTransport`: the broker address, TLS files, reconnect backoff, the password
file."""

from __future__ import annotations

import random
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agent.core.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsSettings:
    """Files for an `mqtts://` connection. Without `ca_file` the system's CAs are trusted."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    def context(self, *, source: str = "mqtt") -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.ca_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(source, "tls_ca", f"cannot load CA file: {exc}") from None
        if self.cert_file:
            try:
                context.load_cert_chain(self.cert_file, self.key_file or None)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(source, "tls_cert", f"cannot load client cert/key: {exc}") from None
        elif self.key_file:
            raise ConfigError(source, "tls_key", "a client key needs tls_cert as well")
        return context


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool


def broker_address(url: str) -> BrokerAddress:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError("mqtt", "url", f"invalid URL {url!r}: {exc}") from None
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise ConfigError("mqtt", "url", f"expected mqtt://host[:port] or mqtts://..., got {url!r}")
    tls = parts.scheme == "mqtts"
    return BrokerAddress(parts.hostname, port or (8883 if tls else 1883), tls)


def backoff_delay(attempt: int, min_s: float, max_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in [0, min(max_s, min_s * 2**attempt)]; attempt 0 is the first retry."""
    cap = min(max_s, min_s * (2 ** min(attempt, 32)))
    return rng.uniform(0.0, cap)


def read_password(path: str, *, source: str = "mqtt") -> str:
    """The password is read from a file (never from argv); one trailing newline is dropped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, "password_file", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(source, "password_file", "not UTF-8 text") from None
    return text.rstrip("\r\n")


def credentials(url: str, *, username: str, password_file: str, tls_ca: str, tls_cert: str, tls_key: str,
                source: str = "mqtt") -> dict[str, Any]:
    """The `tls`, `username` and `password` keywords of `MqttTransport.from_url` for a config
    section (`source`: its name, for errors): TLS for mqtts:// or when a CA or a client certificate
    is named, the password read from its file."""
    tls = None
    if url.startswith("mqtts://") or tls_ca or tls_cert:
        tls = TlsSettings(ca_file=tls_ca, cert_file=tls_cert, key_file=tls_key)
    return {"tls": tls, "username": username or None,
            "password": read_password(password_file, source=source) if password_file else None}


__all__ = ["BrokerAddress", "TlsSettings", "backoff_delay", "broker_address", "credentials", "read_password"]
