"""/healthz and /metrics over a real loopback socket."""

from __future__ import annotations

import asyncio
import json

import pytest
from promparse import parse

from agent.core.errors import ConfigError
from agent.core.gate import Gate
from agent.service.checks import gate_check
from agent.service.collectors import process_collector
from agent.service.healthhttp import HealthServer, parse_listen
from agent.service.prom import Counter, family


async def request(server: HealthServer, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    address = server.address
    assert address is not None
    reader, writer = await asyncio.open_connection(*address)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    version, status, _ = status_line.split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {k.lower(): v for k, v in (h.split(": ", 1) for h in header_lines)}
    if "content-length" in headers and not raw.startswith(b"HEAD"):
        assert int(headers["content-length"]) == len(body)
    return int(status), headers, body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()


async def ok_check():
    return True, "fine"


@pytest.fixture
async def server():
    gate = Gate(is_open=True)
    sent = Counter("ea_test_sent_total", "Sent.", ["kind"])
    sent.inc(3, kind="heartbeat")
    srv = HealthServer(
        "127.0.0.1:0",
        {"transport": gate_check(gate), "database": ok_check},
        {"test": sent.collect, "process": process_collector()},
        check_timeout_s=0.2,
        request_timeout_s=0.5,
        max_request_bytes=1024,
    )
    async with srv:
        srv.gate = gate  # type: ignore[attr-defined]
        yield srv


async def test_healthz_is_200_when_every_check_passes(server: HealthServer) -> None:
    status, headers, body = await request(server, get("/healthz"))
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {
        "status": "ok",
        "checks": {
            "database": {"ok": True, "detail": "fine"},
            "transport": {"ok": True, "detail": "connected"},
        },
    }


async def test_healthz_is_503_when_a_check_fails(server: HealthServer) -> None:
    server.gate.close()  # type: ignore[attr-defined]
    status, _, body = await request(server, get("/healthz?verbose=1"))
    assert status == 503
    doc = json.loads(body)
    assert doc["status"] == "fail"
    assert doc["checks"]["transport"] == {"ok": False, "detail": "disconnected"}


async def test_raising_and_hanging_checks_count_as_failures(server: HealthServer) -> None:
    async def broken():
        raise OSError("read-only file system")

    async def hung():
        await asyncio.Event().wait()

    server.add_check("broken", broken)
    server.add_check("hung", hung)
    status, _, body = await request(server, get("/healthz"))
    assert status == 503
    checks = json.loads(body)["checks"]
    assert checks["broken"] == {"ok": False, "detail": "error: OSError: read-only file system"}
    assert checks["hung"] == {"ok": False, "detail": "timed out after 0.2s"}
    assert checks["database"]["ok"] is True


async def test_metrics_are_prometheus_text(server: HealthServer) -> None:
    status, headers, body = await request(server, get("/metrics"))
    assert status == 200
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = parse(body.decode())
    assert families["ea_test_sent_total"]["type"] == "counter"
    assert families["ea_test_sent_total"]["samples"] == [({"kind": "heartbeat"}, 3.0)]
    [(_, rss)] = families["process_resident_memory_bytes"]["samples"]
    assert rss > 1_000_000
    assert families["process_cpu_seconds_total"]["samples"][0][1] > 0


async def test_a_broken_collector_is_skipped_and_counted(server: HealthServer) -> None:
    def broken():
        raise RuntimeError("stats unavailable")

    server.add_collector("broken", broken)
    server.add_collector("fine", lambda: [family("ea_fine", "gauge", "fine", 1)])
    for expected in (1.0, 2.0):
        status, _, body = await request(server, get("/metrics"))
        assert status == 200
        families = parse(body.decode())
        assert families["ea_fine"]["samples"] == [({}, 1.0)]
        assert families["ea_metrics_collector_errors_total"]["samples"] == [
            ({"collector": "broken"}, expected)
        ]


async def test_head_answers_without_a_body(server: HealthServer) -> None:
    status, headers, body = await request(server, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (get("/"), 404),
        (get("/healthz/../etc/passwd"), 404),
        (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
        (b"DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        (b"GET /healthz\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4000 + b"\r\n\r\n", 431),
    ],
)
async def test_error_statuses(server: HealthServer, raw: bytes, expected: int) -> None:
    status, headers, _ = await request(server, raw)
    assert status == expected
    if expected == 405:
        assert headers["allow"] == "GET, HEAD"


async def test_a_slow_client_gets_408_and_the_server_stays_up(server: HealthServer) -> None:
    status, _, _ = await request(server, b"GET /healthz HTTP/1.1\r\n")  # never finishes
    assert status == 408
    status, _, _ = await request(server, get("/healthz"))
    assert status == 200


async def test_many_clients_at_once(server: HealthServer) -> None:
    results = await asyncio.gather(*(request(server, get("/metrics")) for _ in range(10)))
    assert {status for status, _, _ in results} <= {200, 503}
    assert any(status == 200 for status, _, _ in results)


async def test_disabled_when_listen_is_empty() -> None:
    srv = HealthServer("", {})
    assert not srv.enabled
    async with srv:
        assert srv.address is None


async def test_port_in_use_is_a_config_error(server: HealthServer) -> None:
    host, port = server.address  # type: ignore[misc]
    other = HealthServer(f"{host}:{port}", {})
    with pytest.raises(ConfigError, match="metrics.listen"):
        await other.start()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("  ", None),
        ("127.0.0.1:9100", ("127.0.0.1", 9100)),
        ("[::1]:9100", ("::1", 9100)),
        ("localhost:0", ("localhost", 0)),
        ("127.0.0.2:80", ("127.0.0.2", 80)),
    ],
)
def test_parse_listen(text: str, expected: tuple[str, int] | None) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    "text", ["9100", "127.0.0.1", "127.0.0.1:http", ":9100", "127.0.0.1:70000", "0.0.0.0:9100",
             "192.168.1.5:9100", "example.com:9100"],
)
def test_parse_listen_refuses(text: str) -> None:
    with pytest.raises(ConfigError, match="metrics.listen"):
        parse_listen(text)


def test_remote_listen_when_explicitly_allowed() -> None:
    assert parse_listen("0.0.0.0:9100", allow_remote=True) == ("0.0.0.0", 9100)
