"""The one HTTP layer (`agent.service.http`): its limits, its connection bound and its evictions,
on a real loopback socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.service.http import FileRange, HttpServer, Limits, Request, Response, text


async def echo(request: Request) -> Response:
    return text(200, f"{request.method} {request.path} {len(request.body)}")


@pytest.fixture
async def served() -> AsyncIterator[tuple[HttpServer, int]]:
    layer = HttpServer(echo, name="test", limits=Limits(max_head_bytes=1024, max_headers=8, max_body_bytes=100,
                                                        head_timeout_s=0.5, idle_timeout_s=5.0, max_connections=4,
                                                        max_per_peer=4, evict_after_s=0.0))
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


async def kept_alive(port: int, local: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """A connection from address `local` that made one keep-alive request; its status (it stays open)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0))
    writer.write(b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    return reader, writer, int(head.split(b" ", 2)[1])


async def test_one_client_holds_at_most_its_share_and_another_is_served_at_once() -> None:
    """M2, M3. Connections kept alive after a request are not closed for newcomers (their client may
    be sending the next request): one address holding them reaches its own bound, 503 beyond it,
    and a client from another address finds room without waiting for any timeout."""
    layer = HttpServer(echo, name="test", limits=Limits(idle_timeout_s=60.0, max_connections=8, max_per_peer=2))
    server = await asyncio.start_server(layer.connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    held = []
    try:
        for _ in range(2):
            held.append(await kept_alive(port, "127.0.0.1"))
        assert [status for *_, status in held] == [200, 200]
        status, body = await exchange(port, get())
        assert status == 503 and b"more than 2 connections from one client" in body
        for _ in range(2):  # another address: its own share
            held.append(await kept_alive(port, "127.0.0.2"))
        assert [status for *_, status in held] == [200] * 4
        assert layer.stats.peer_busy == 1 and layer.stats.evicted == 0
    finally:
        for _, writer, _ in held:
            writer.close()
        server.close()
        await layer.close()
        await server.wait_closed()


async def test_a_client_that_stops_reading_a_file_gives_its_slot_back(tmp_path: Path) -> None:
    """M1. A download whose client never reads ends once the kernel's buffers are full and the
    minimum rate is not met (`stats.slow`), not at `send_timeout_s`; a reading client gets it all."""
    blob = tmp_path / "blob"
    blob.write_bytes(bytes(range(256)) * (256 * 1024))  # 64 MiB: more than the socket buffers hold
    sent: list[bool] = []

    async def download(request: Request) -> Response:
        handle = blob.open("rb")

        def done(whole: bool) -> None:
            handle.close()
            sent.append(whole)

        return Response(200, file=FileRange(handle, 0, blob.stat().st_size), sent=done)

    layer = HttpServer(download, name="test", limits=Limits(send_timeout_s=3600.0, min_send_bps=1024 * 1024,
                                                            send_grace_s=0.5))
    server = await asyncio.start_server(layer.connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get())
        await writer.drain()
        while not sent:  # the server ends it: nothing is read here
            await asyncio.sleep(0.05)
        assert sent == [False] and layer.stats.slow == 1 and layer.stats.connections == 0
        writer.close()
        status, body = await exchange(port, get())
        assert status == 200 and len(body) == blob.stat().st_size and sent == [False, True]
    finally:
        server.close()
        await layer.close()
        await server.wait_closed()
