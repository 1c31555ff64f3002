"""The leader's artifact HTTP server: range requests of its verified copies, and its bound."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from firmware_rollout.orchestration.artifact_server import ArtifactServer

SHA = "ab" * 32


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[ArtifactServer, bytes, Path]]:
    data = random.Random(3).randbytes(300_000)
    path = tmp_path / "copy.eafw"
    path.write_bytes(data)
    server = ArtifactServer(lambda name: path if name == f"{SHA}.eafw" else None, host="127.0.0.1", port=0,
                            max_downloads=2, retry_after_s=3)
    await server.start()
    try:
        yield server, data, path
    finally:
        await server.stop()


def _url(server: ArtifactServer, sha: str = SHA) -> str:
    return f"http://127.0.0.1:{server.port}/artifacts/{sha}.eafw"


async def test_a_range_request_gets_exactly_those_bytes(served: tuple[ArtifactServer, bytes, Path]) -> None:
    server, data, _ = served
    async with httpx.AsyncClient() as client:
        r = await client.get(_url(server), headers={"Range": "bytes=1000-70999"})
        assert r.status_code == 206
        assert r.headers["content-range"] == f"bytes 1000-70999/{len(data)}"
        assert r.content == data[1000:71000]
        tail = await client.get(_url(server), headers={"Range": "bytes=299990-"})
        assert tail.status_code == 206 and tail.content == data[299_990:]
        whole = await client.get(_url(server))
        assert whole.status_code == 200 and whole.content == data
        head = await client.head(_url(server))
        assert head.status_code == 200 and int(head.headers["content-length"]) == len(data)
    assert server.stats.served == 3 and server.stats.bytes_served == 70_000 + 10 + len(data)


async def test_what_is_not_an_artifact_is_refused(served: tuple[ArtifactServer, bytes, Path]) -> None:
    server, data, _ = served
    async with httpx.AsyncClient() as client:
        assert (await client.get(_url(server, "cd" * 32))).status_code == 404
        assert (await client.get(f"http://127.0.0.1:{server.port}/artifacts/../../etc/passwd")).status_code == 404
        assert (await client.get(f"http://127.0.0.1:{server.port}/")).status_code == 404
        past = await client.get(_url(server), headers={"Range": f"bytes={len(data)}-"})
        assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(data)}"
        assert (await client.post(_url(server), content=b"x")).status_code == 405
        assert (await client.get(_url(server), headers={"Range": "bytes=0-1,5-9"})).status_code == 400
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"\x00\xffnot http\r\n\r\n")
    await writer.drain()
    answer = await reader.read()
    assert answer.startswith(b"HTTP/1.1 400 ")
    writer.close()
    await writer.wait_closed()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 10_000 + b"\r\n\r\n")
    await writer.drain()
    assert (await reader.read()).startswith(b"HTTP/1.1 431 ")
    writer.close()
    await writer.wait_closed()


async def test_beyond_its_bound_it_answers_503_with_retry_after(tmp_path: Path) -> None:
    big = tmp_path / "big.eafw"
    with big.open("wb") as f:
        f.truncate(256 * 1024 * 1024)  # a sparse file: a download of it stays in flight while nobody reads
    server = ArtifactServer(lambda sha: big, host="127.0.0.1", port=0, max_downloads=1, retry_after_s=3)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(f"GET /artifacts/{SHA}.eafw HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        while server.stats.in_flight < 1:  # the first download is being sent (and not read)
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as client:
            busy = await client.get(_url(server), headers={"Range": "bytes=0-99"})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "3"
        assert server.stats.busy == 1 and server.stats.max_concurrent == 1
        writer.close()
        reader.feed_eof()
    finally:
        await server.stop()


async def test_many_downloads_at_once_all_finish_within_the_bound(served: tuple[ArtifactServer, bytes, Path]) -> None:
    server, data, _ = served
    server.retry_after_s = 1

    async def device(client: httpx.AsyncClient) -> bytes:
        while True:
            r = await client.get(_url(server))
            if r.status_code == 503:
                await asyncio.sleep(float(r.headers["retry-after"]) / 10)  # the test need not wait it out
                continue
            assert r.status_code == 200
            return r.content

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=40)) as client:
        got = await asyncio.gather(*(device(client) for _ in range(20)))
    assert all(g == data for g in got)
    assert server.stats.max_concurrent <= 2


def test_under_uvloop_the_body_is_sent_whole(tmp_path: Path) -> None:
    """The leader runs on uvloop, which has no loop.sendfile: the server sends through a duplicate
    of the socket's descriptor instead, and a slow reader still gets every byte."""
    uvloop = pytest.importorskip("uvloop")
    data = random.Random(4).randbytes(8 * 1024 * 1024)
    path = tmp_path / "copy.eafw"
    path.write_bytes(data)

    async def main() -> tuple[bytes, bytes]:
        server = ArtifactServer(lambda sha: path, host="127.0.0.1", port=0)
        await server.start()
        try:
            async with httpx.AsyncClient() as client:
                whole = bytearray()
                async with client.stream("GET", _url(server)) as r:
                    async for block in r.aiter_raw():
                        whole += block
                        await asyncio.sleep(0)  # a reader slower than the sender: the socket fills
                part = await client.get(_url(server), headers={"Range": "bytes=5000000-5999999"})
            return bytes(whole), part.content
        finally:
            await server.stop()

    loop = uvloop.new_event_loop()
    try:
        whole, part = loop.run_until_complete(main())
    finally:
        loop.close()
    assert whole == data and part == data[5_000_000:6_000_000]


async def test_over_tls_a_device_checks_the_servers_certificate(tmp_path: Path) -> None:
    """`[artifacts] tls_cert/tls_key`: https, and a device's mirror client checks the chain
    against `[firmware] mirror_ca` (a server signed by another CA is a transient failure)."""
    import ssl
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "service"))
    from svc_broker import make_pki

    from agent.core.errors import Transient
    from firmware_rollout.artifact.files import read_signed_manifest
    from firmware_rollout.artifact.fixture import make_artifact
    from firmware_rollout.device.http_source import MirrorSource, make_client

    pki = make_pki(tmp_path / "pki", "dev-1")
    artifact, _ = make_artifact(tmp_path, size=40_000, chunk_size=4096)
    signed = read_signed_manifest(artifact)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki.server_cert, pki.server_key)
    server = ArtifactServer(lambda sha: artifact, host="127.0.0.1", port=0, tls=tls)
    await server.start()
    try:
        mirror = f"https://127.0.0.1:{server.port}/artifacts"
        manifest = signed.manifest
        async with make_client(ca=str(pki.ca_cert)) as client:
            source = MirrorSource(client, mirror, manifest, manifest.layout())
            data = b"".join([await source.fetch(i) for i in range(manifest.chunk_count)])
            await source.close()
        assert data == artifact.read_bytes()[signed.size:]
        async with make_client(ca=str(pki.rogue_ca_cert)) as client:
            with pytest.raises(Transient, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
                await MirrorSource(client, mirror, manifest, manifest.layout()).fetch(0)
    finally:
        await server.stop()


async def test_with_client_ca_only_a_device_with_the_fleets_certificate_is_served(tmp_path: Path) -> None:
    """M1, M2. `[artifacts] client_ca`: mutual TLS with the broker's CA. A worker shows its own
    `[mqtt]` certificate and downloads; a client without one, or with one of another CA, gets no
    byte (the handshake fails)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "service"))
    from svc_broker import make_pki

    from agent.core.config import AgentConfig, AgentSection, ArtifactsSection
    from agent.core.errors import Transient
    from agent.service.files import artifact_tls
    from firmware_rollout.artifact.files import read_signed_manifest
    from firmware_rollout.artifact.fixture import make_artifact
    from firmware_rollout.device.http_source import MirrorSource, make_client

    pki = make_pki(tmp_path / "pki", "dev-1")
    rogue = make_pki(tmp_path / "rogue", "dev-1")  # a whole other CA, and a device certificate of it
    artifact, _ = make_artifact(tmp_path, size=40_000, chunk_size=4096)
    signed = read_signed_manifest(artifact)
    config = AgentConfig(agent=AgentSection(device_id="gw", role="leader"), artifacts=ArtifactsSection(
        tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), client_ca=str(pki.ca_cert)))
    server = ArtifactServer(lambda sha: artifact, host="127.0.0.1", port=0, tls=artifact_tls(config))
    await server.start()
    try:
        mirror = f"https://127.0.0.1:{server.port}/artifacts"
        manifest = signed.manifest
        async with make_client(ca=str(pki.ca_cert), client_cert=str(pki.client_cert),
                               client_key=str(pki.client_key)) as client:
            source = MirrorSource(client, mirror, manifest, manifest.layout())
            data = b"".join([await source.fetch(i) for i in range(manifest.chunk_count)])
            await source.close()
        assert data == artifact.read_bytes()[signed.size:]
        for cert, key in (("", ""), (str(rogue.client_cert), str(rogue.client_key))):
            async with make_client(ca=str(pki.ca_cert), client_cert=cert, client_key=key) as client:
                with pytest.raises(Transient):
                    await MirrorSource(client, mirror, manifest, manifest.layout()).fetch(0)
    finally:
        await server.stop()


async def test_one_address_gets_its_share_of_downloads_and_one_that_does_not_read_is_ended(tmp_path: Path) -> None:
    """M1. 32 downloads from one address that never read: that address holds its share of the
    download slots (here 2 of 8), the rest are 503; a device at another address is served at once;
    each stalled download is ended below the minimum rate and its slot given back."""
    big = tmp_path / "big.eafw"
    with big.open("wb") as f:
        f.truncate(256 * 1024 * 1024)  # more than the socket buffers hold
    server = ArtifactServer(lambda sha: big, host="127.0.0.1", port=0, max_downloads=8, min_rate_bps=1024 * 1024,
                            stall_grace_s=0.5)
    await server.start()
    hoard: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        statuses = []
        for _ in range(32):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(f"GET /artifacts/{SHA}.eafw HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            await writer.drain()
            statuses.append((await reader.readline()).split(b" ")[1])
            hoard.append((reader, writer))
        assert statuses.count(b"200") == 2 and statuses.count(b"503") == 30
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2")) as client:
            r = await client.get(_url(server), headers={"Range": "bytes=0-99"})
        assert r.status_code == 206 and r.content == bytes(100)
        while server.stats.in_flight:  # the two that do not read are ended: their slots come back
            await asyncio.sleep(0.05)
        assert server.stats.slow == 2
    finally:
        for _, writer in hoard:
            writer.close()
        await server.stop()
