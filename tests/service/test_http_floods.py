"""Every server of the product on its one HTTP layer, flooded: 1,000 connections, a request of
10,000 headers, a 10 GB Content-Length, 400 idle connections. Each server keeps answering a
legitimate request while the flood goes on, and logs no traceback."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.core.clock import SystemClock
from agent.leader.registry import DeviceRegistry
from agent.protocol import Heartbeat
from agent.service.healthhttp import HealthServer
from agent.transport.memory import MemoryBroker
from agent.worker.local_api import LocalApi

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e.agent_support import worker
from otheruser import NOBODY, unix_status_as

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
LEGIT_DEADLINE_S = 60.0  # the legitimate client retries a 503 or a refused connect until then


@dataclass
class Target:
    name: str
    connect: Connect
    legit: bytes  # a request the server answers 2xx
    post_path: str
    # the status a legitimate request of another client (address or uid) gets, 503s retried
    elsewhere: Callable[[], Awaitable[int]] | None = None


async def _status_of(connect: Connect, request: bytes) -> int | None:
    """The status the server answers `request` with; None when the connection failed or closed."""
    try:
        reader, writer = await connect()
    except OSError:
        return None
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 30)
        return int(line.split(b" ", 2)[1]) if line.startswith(b"HTTP/1.1 ") else None
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError, TimeoutError):
        return None
    finally:
        writer.close()


async def legit_answered(target: Target) -> int:
    """A legitimate client: retries a 503 or a refused connection, as a device does after
    Retry-After, until it is answered; the status it got."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LEGIT_DEADLINE_S
    while True:
        status = await _status_of(target.connect, target.legit)
        if status is not None and status != 503:
            return status
        assert loop.time() < deadline, f"{target.name}: no answer to a legitimate request during the flood"
        await asyncio.sleep(0.05)


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


def _from_elsewhere(target: Target, host: str, port: int) -> Callable[[], Awaitable[int]]:
    """The legitimate client on another loopback address (Linux routes all of 127/8 to lo): the
    status of its first attempt (0: none)."""
    async def once() -> int:
        return await _status_of(lambda: asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0)),
                                target.legit) or 0

    return once


@asynccontextmanager
async def serving(name: str, tmp_path: Path, *, open_dir: Path | None = None) -> AsyncIterator[Target]:
    if name == "health":
        health = HealthServer("127.0.0.1:0", {"ok": _ok})
        await health.start()
        address = health.address
        assert address is not None
        try:
            target = Target(name, lambda: asyncio.open_connection(*address), _get("/healthz"), "/metrics")
            target.elsewhere = _from_elsewhere(target, *address)
            yield target
        finally:
            await health.stop()
    elif name == "local API":
        clock = SystemClock()
        device = await worker(clock, tmp_path, "pi-1", broker=MemoryBroker(clock=clock), relay=False)
        sock = (open_dir or tmp_path) / "api.sock"
        api = LocalApi(device.messages, device.message_status, clock=clock, socket_path=sock, group="nogroup")
        await api.start()
        try:
            target = Target(name, lambda: asyncio.open_unix_connection(str(sock)), _get("/v1/status"),
                            "/v1/messages")
            target.elsewhere = lambda: asyncio.to_thread(unix_status_as, NOBODY, sock, target.legit)
            yield target
        finally:
            await api.stop()
            await device.stop()
    elif name == "artifact server":
        from firmware_rollout.orchestration.artifact_server import ArtifactServer

        blob = tmp_path / "a.eafw"
        blob.write_bytes(b"x" * 4096)
        sha = "ab" * 32
        server = ArtifactServer(lambda name: blob if name == f"{sha}.eafw" else None, host="127.0.0.1", port=0)
        await server.start()
        port = server.port
        try:
            target = Target(name, lambda: asyncio.open_connection("127.0.0.1", port),
                            f"GET /artifacts/{sha}.eafw HTTP/1.1\r\nHost: x\r\nRange: bytes=0-99\r\n"
                            "Connection: close\r\n\r\n".encode(), f"/artifacts/{sha}.eafw")
            target.elsewhere = _from_elsewhere(target, "127.0.0.1", port)
            yield target
        finally:
            await server.stop()
    else:
        from agent.console.server import Console, ConsoleConfig, ConsoleServer

        db = tmp_path / "leader.db"
        with DeviceRegistry.open(db, clock=SystemClock()) as reg:
            reg.apply_heartbeats([Heartbeat(device_id="pi-0001", seq=1, uptime_s=1.0, firmware_version="1.0.0")])
        console = ConsoleServer(("127.0.0.1", 0), Console(ConsoleConfig(db=db, outbox=tmp_path / "outbox.db",
                                                                        token="0123456789abcdef0123456789")))
        console.serve_in_thread()
        host, port = console.server_address
        try:
            target = Target(name, lambda: asyncio.open_connection(host, port), _get("/login"), "/login")
            target.elsewhere = _from_elsewhere(target, host, port)
            yield target
        finally:
            console.shutdown()
            console.server_close()


async def _ok() -> tuple[bool, str]:
    return True, "fine"


async def _many_connections(target: Target, n: int) -> None:
    async def one() -> None:
        await _status_of(target.connect, target.legit)

    await asyncio.gather(*(one() for _ in range(n)))


async def _idle_connections(target: Target, n: int, *, first: bytes = b"") -> list[asyncio.StreamWriter]:
    """`n` connections that send `first` and then nothing (the start of a request head: a
    connection in the middle of a request is never closed to make room, its head timeout ends it)."""
    held = []
    for _ in range(n):
        try:
            _, writer = await target.connect()
        except OSError:
            continue
        writer.write(first)
        held.append(writer)
    return held


SERVERS = ["health", "local API", "artifact server", "console"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SERVERS)
async def test_a_server_answers_a_legitimate_request_through_every_flood(name: str, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with serving(name, tmp_path) as target:
        assert 200 <= await legit_answered(target) < 300

        # 1,000 connections at once, each with a request
        flood = asyncio.ensure_future(_many_connections(target, 1000))
        assert 200 <= await legit_answered(target) < 300
        await flood

        # a request of 10,000 headers: refused whole, the server goes on
        many = b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))
        status = await _status_of(target.connect, b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
        assert status in (431, None)  # answered 431, or cut off while it was still being sent
        assert 200 <= await legit_answered(target) < 300

        # a 10 GB Content-Length: refused before a byte of the body is read
        status = await _status_of(target.connect, f"POST {target.post_path} HTTP/1.1\r\nHost: x\r\n"
                                                  f"Content-Length: {10 * 1024 ** 3}\r\n\r\n".encode())
        assert status == 413
        assert 200 <= await legit_answered(target) < 300

        # 400 connections that never send a byte
        held = await _idle_connections(target, 400)
        try:
            assert 200 <= await legit_answered(target) < 300
        finally:
            for writer in held:
                writer.close()
    tracebacks = [r for r in caplog.records if r.exc_info and r.name.startswith(("agent", "firmware_rollout"))]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local API's other client runs as another user")
@pytest.mark.parametrize("name", SERVERS)
async def test_one_client_holding_connections_does_not_starve_another(name: str, tmp_path: Path,
                                                                      open_dir: Path) -> None:
    """M1-M3. One client (an address, a uid) opens 300 connections that each start a request and
    stall (none of them may be closed to make room, only its head timeout ends one): it holds its
    own share of the server's connections only, and another client's first request is answered."""
    async with serving(name, tmp_path, open_dir=open_dir) as target:
        held = await _idle_connections(target, 300, first=b"GET / HTTP/1.1\r\nHost: x\r\n")
        try:
            assert target.elsewhere is not None
            assert 200 <= await target.elsewhere() < 300
        finally:
            for writer in held:
                writer.close()
