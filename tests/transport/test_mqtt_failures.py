"""What a failed MQTT connection is told as: the fix for permanent causes, at ERROR, with the
longest backoff; the session takeover named; the rest transient."""

from __future__ import annotations

import logging

from agent.transport._mqtt_failures import classify


def check(error: str, code: int | None = None, disconnect: int | None = None):
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


def test_paho_error_numbers_are_not_taken_for_the_brokers_answer() -> None:
    """A publish on a dropped connection fails with paho's MQTT_ERR_NO_CONN (4), which is also
    MQTT 3.1.1's CONNACK code for bad credentials: it must stay a transient failure."""
    import aiomqtt
    from aiomqtt.exceptions import MqttConnectError
    from paho.mqtt.enums import MQTTErrorCode
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    from agent.transport.mqtt import reason_code_of

    dropped = aiomqtt.MqttCodeError(MQTTErrorCode.MQTT_ERR_NO_CONN, "Could not publish message")
    assert reason_code_of(dropped) is None
    assert not classify(str(dropped), code=reason_code_of(dropped), disconnect_code=None, broker="b:1",
                        username=None).permanent
    refused = MqttConnectError(ReasonCode(PacketTypes.CONNACK, identifier=0x86))
    assert reason_code_of(refused) == 0x86
    assert classify(str(refused), code=0x86, disconnect_code=None, broker="b:1", username="pi").permanent
    assert reason_code_of(MqttConnectError(5)) == 5  # a v3 broker's CONNACK code, as a plain int


async def test_a_broker_that_never_answers_the_mqtt5_connect_is_named_once(caplog) -> None:  # type: ignore[no-untyped-def]
    """What a broker that speaks only MQTT 3.1.1 does with our v5 CONNECT (amqtt 0.12 was seen
    to): it takes the TCP connection and never answers. Here a listener that does just that: the
    agent says so once, at WARNING, naming MQTT 5 and brokers that speak it, and keeps trying
    without repeating it."""
    import asyncio
    import socket
    import threading

    from agent.core.clock import SystemClock
    from agent.transport.mqtt import MqttTransport

    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    caplog.set_level(logging.INFO, logger="agent.transport.mqtt")
    transport = MqttTransport(host="127.0.0.1", port=server.getsockname()[1], client_id="pi-1", clock=SystemClock(),
                              operation_timeout_s=0.5)
    await transport.start()
    try:
        while len(held) < 3:  # a third attempt: the second one failed too, and was not logged again
            await asyncio.sleep(0.05)
    finally:
        await transport.stop()
        server.close()
        for conn in held:
            conn.close()
    said = [r for r in caplog.records if "did not answer our MQTT 5 CONNECT" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "speaks only 3.1.1" in said[0].getMessage() and "mosquitto 1.6 or later, EMQX" in said[0].getMessage()
    assert not [r for r in caplog.records if "connection ended: Operation timed out" in r.getMessage()]


def test_a_certificate_refused_as_revoked_says_this_device_is_revoked() -> None:
    failure = classify("[SSL: SSLV3_ALERT_CERTIFICATE_REVOKED] sslv3 alert certificate revoked (_ssl.c:2580)",
                       code=None, disconnect_code=None, broker="gw:8883", username=None)
    assert failure.level == logging.ERROR and failure.permanent
    assert failure.text.startswith("this device is revoked: the broker at gw:8883 refused its certificate as revoked")
