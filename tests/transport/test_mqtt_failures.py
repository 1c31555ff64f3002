"""What a failed MQTT connection is told as: the fix for permanent causes, at ERROR, with the
longest backoff; the session takeover named; the rest transient."""

from __future__ import annotations

import logging

from agent.transport._mqtt_failures import classify


def check(error: str, code: int | None = None, disconnect: int | None = None):  # noqa: ANN201
    return classify(error, code=code, disconnect_code=disconnect, broker="broker:8883", username="pi-0001")


def test_refused_credentials_name_the_keys_to_fix() -> None:
    for code in (0x86, 0x87, 4, 5):
        f = check("[code:135] Not authorized", code)
        assert f.level == logging.ERROR and f.permanent
        assert "broker:8883" in f.text and "mqtt.password_file" in f.text and "pi-0001" in f.text


def test_a_broker_without_mqtt_v5_is_said_so() -> None:
    for code in (0x84, 1):
        f = check("[code:132] Unsupported protocol version", code)
        assert f.level == logging.ERROR and f.permanent and "does not speak MQTT v5" in f.text


def test_tls_failures_point_at_the_tls_settings() -> None:
    f = check("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate")
    assert f.level == logging.ERROR and f.permanent and "mqtt.tls_ca" in f.text


def test_a_session_taken_over_is_named() -> None:
    """A broker that sends DISCONNECT 0x8E (EMQX, HiveMQ; mosquitto 2.0 closes the old
    connection without one) tells us another client connected with our client id."""
    f = check("Disconnected during message iteration", None, 0x8E)
    assert f.level == logging.WARNING and not f.permanent and "0x8E" in f.text and "same device id" in f.text


def test_anything_else_is_transient() -> None:
    f = check("[Errno 111] Connection refused")
    assert f.level == logging.INFO and not f.permanent and f.text == "connection ended: [Errno 111] Connection refused"
