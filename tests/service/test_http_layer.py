"""The one HTTP layer (`agent.service.http`): its limits, its connection bound and its evictions,
on a real loopback socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from agent.service.http import HttpServer, Limits, Request, Response, text


async def echo(request: Request) -> Response:
    return text(200, f"{request.method} {request.path} {len(request.body)}")


@pytest.fixture
async def served() -> AsyncIterator[tuple[HttpServer, int]]:
    layer = HttpServer(echo, name="test", limits=Limits(max_head_bytes=1024, max_headers=8, max_body_bytes=100,
                                                        head_timeout_s=0.5, idle_timeout_s=5.0, max_connections=4,
                                                        evict_after_s=0.0))
    server = await asyncio.start_server(layer.connection, "127.0.0.1", 0, backlog=layer.backlog)
    try:
        yield layer, server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await layer.close()
        await server.wait_closed()


async def exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def get(path: str = "/x", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra + b"\r\n"


@pytest.mark.parametrize(("raw", "status"), [
    (get(), 200),
    (get(extra=b"".join(b"X-%d: v\r\n" % i for i in range(9))), 431),  # a header over max_headers
    (get(extra=b"X-Big: " + b"a" * 2000 + b"\r\n"), 431),  # a head over max_head_bytes, in one read
    (b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n", 413),  # refused before the body comes
    (b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    (b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 411),
    (b"GET /x HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"\x16\x03\x01\x00\x05hello\r\n\r\n", 400),
])
async def test_the_limits_answer_with_their_status(served: tuple[HttpServer, int], raw: bytes, status: int) -> None:
    layer, port = served
    got, _ = await exchange(port, raw)
    assert got == status
    assert (await exchange(port, get()))[0] == 200  # and the server goes on


async def test_a_head_that_stops_coming_is_408_and_a_silent_connection_just_closes(
        served: tuple[HttpServer, int]) -> None:
    layer, port = served
    status, _ = await exchange(port, b"GET /x HTTP/1.1\r\nHost: x\r\n")  # never finished
    assert status == 408
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await asyncio.wait_for(reader.read(), 10) == b""  # nothing sent: closed without an answer
    writer.close()


async def test_kept_alive_requests_share_a_connection(served: tuple[HttpServer, int]) -> None:
    layer, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for n in range(3):
            body = b"x" * n
            writer.write(b"POST /k HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % n + body)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert head.startswith(b"HTTP/1.1 200 ") and await reader.readexactly(length) == f"POST /k {n}\n".encode()
    finally:
        writer.close()
    assert layer.stats.requests >= 3


async def test_at_the_bound_a_quiet_connection_makes_room(served: tuple[HttpServer, int]) -> None:
    layer, port = served
    quiet = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]  # every slot, no byte sent
    while layer.stats.connections < 4:  # every one accepted
        await asyncio.sleep(0.01)
    assert (await exchange(port, get()))[0] == 200  # the quietest made room
    assert layer.stats.evicted == 1 and layer.stats.busy == 0
    for _, writer in quiet:
        writer.close()


async def test_at_the_bound_connections_sending_a_request_are_kept_and_the_newcomer_waits(
        served: tuple[HttpServer, int]) -> None:
    layer, port = served
    busy = []
    for _ in range(4):  # every slot holds a request still arriving
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        await writer.drain()
        busy.append((reader, writer))
    while layer.stats.connections < 4:
        await asyncio.sleep(0.01)
    status, _ = await exchange(port, get())
    assert status == 503 and layer.stats.busy == 1 and layer.stats.evicted == 0
    for reader, writer in busy:  # the head timeout ends them (408), then the server has room again
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 408 ")
        writer.close()
    assert (await exchange(port, get()))[0] == 200
