"""The simulator's model of a broker connection's cost over TLS (`AirModel`)."""

from __future__ import annotations

from agent.transport.linkbytes import PING_BYTES, TLS_RECORD_BYTES, AirModel


def test_reading_the_counters_often_loses_no_keepalive_ping() -> None:
    read_often, read_once = AirModel(keepalive_s=50.0), AirModel(keepalive_s=50.0)
    for model in (read_often, read_once):
        model.connected(0.0)
    for t in range(0, 1000, 2):  # a progress sample every 2 s of a silent connection
        read_often.total(float(t))
    assert read_often.total(1000.0) == read_once.total(1000.0)
    assert read_once.total(1000.0).bytes_sent == 20 * (PING_BYTES + TLS_RECORD_BYTES)  # a ping each 50 s


def test_a_packet_restarts_the_silence() -> None:
    model = AirModel(keepalive_s=50.0)
    model.connected(0.0)
    model.publish_out(40.0, 100, qos=0)
    assert model.total(89.0).bytes_sent == 100 + TLS_RECORD_BYTES  # 49 s of silence: no ping yet
    assert model.total(90.0).bytes_sent == 100 + TLS_RECORD_BYTES + PING_BYTES + TLS_RECORD_BYTES
