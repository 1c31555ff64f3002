"""What a failed or ended MQTT connection means, and what to tell the operator (`mqtt.py` only).

A connection attempt fails, or a connection ends, for reasons that need different answers:

    credentials  CONNACK 0x86 / 0x87 / 0x8C (or v3 codes 4, 5): ERROR with the fix; retrying
                 every second will not help, so the next attempt waits the longest backoff
    protocol     CONNACK 0x84 (or v3 code 1): the broker does not speak MQTT v5; ERROR,
                 longest backoff
    no answer    the broker took the connection and never answered the MQTT 5 CONNECT (what
                 a broker that speaks only 3.1.1, such as amqtt, does): WARNING naming MQTT 5
                 and brokers that speak it, then at most once a minute
    revoked      the broker refused our certificate as revoked (an alert in the handshake):
                 ERROR saying plainly that this device is revoked, longest backoff
    tls          the TLS handshake failed (certificate, name, trust): ERROR with the fix,
                 longest backoff
    takeover     DISCONNECT 0x8E: another client connected with our client id (two agents
                 with one device id?); WARNING, naming it
    transient    anything else (network, broker restart): INFO, the ordinary backoff
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

_CREDENTIALS = {0x86: "bad user name or password", 0x87: "not authorized", 0x8C: "bad authentication method"}
_V3_CREDENTIALS = {4: "bad user name or password", 5: "not authorized"}
_SESSION_TAKEN_OVER = 0x8E
REVOKED_MARK = "CERTIFICATE_REVOKED"  # OpenSSL's name of the alert a broker sends for a revoked certificate
_TLS_MARKS = ("SSL", "CERTIFICATE", "certificate", "TLS", "tls", "hostname")


@dataclass(frozen=True, slots=True)
class Failure:
    level: int
    text: str
    permanent: bool  # wait the longest backoff before the next attempt


MQTT5_BROKERS = "mosquitto 1.6 or later, EMQX, HiveMQ, VerneMQ, NanoMQ"


def no_connack(broker: str, timeout_s: float) -> str:
    """What a CONNECT left unanswered most likely means."""
    return (f"the broker at {broker} took the connection but did not answer our MQTT 5 CONNECT within {timeout_s:g}s:"
            f" edge-agent speaks MQTT 5 only, and a broker that speaks only 3.1.1 (amqtt, mosquitto before 1.6)"
            f" never answers it; brokers that speak MQTT 5: {MQTT5_BROKERS}")


def classify(error: str, *, code: int | None, disconnect_code: int | None, broker: str,
             username: str | None) -> Failure:
    """`error`: the exception's text; `code`: a CONNACK reason code, if the broker sent one;
    `disconnect_code`: the reason code of a DISCONNECT the broker sent, if any."""
    if disconnect_code == _SESSION_TAKEN_OVER:
        return Failure(logging.WARNING, f"session taken over (0x8E): another client connected to {broker} with this"
                                        " client id; are two agents running with the same device id?", False)
    if code in _CREDENTIALS or (code in _V3_CREDENTIALS and code is not None and code < 0x80):
        why = _CREDENTIALS.get(code) or _V3_CREDENTIALS[code]
        return Failure(logging.ERROR, f"the broker at {broker} refused our credentials ({why}, username"
                                      f" {username or '(none)'}): check mqtt.username and mqtt.password_file", True)
    if code in (0x84, 1):
        return Failure(logging.ERROR, f"the broker at {broker} does not speak MQTT v5 (it answered: {error})", True)
    if REVOKED_MARK in error:
        return Failure(logging.ERROR, f"this device is revoked: the broker at {broker} refused its certificate as"
                                      f" revoked ({error}); an operator revoked it (`edge-agent devices list --state"
                                      " revoked` on the gateway says why) and it cannot connect again", True)
    if any(mark in error for mark in _TLS_MARKS):
        return Failure(logging.ERROR, f"TLS with the broker at {broker} failed ({error}): check mqtt.tls_ca, the"
                                      " broker's certificate name and, if it asks for one, mqtt.tls_cert", True)
    return Failure(logging.INFO, f"connection ended: {error}", False)


__all__ = ["MQTT5_BROKERS", "REVOKED_MARK", "Failure", "classify", "no_connack"]
