"""The local API on a real Unix socket, in front of a worker and a leader on the in-memory broker."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import worker
from local_api_support import CLASSES, Setup, post, raw, start_api, stop_api

from agent.client import AgentUnavailable, AsyncClient, Client, LocalApiError
from agent.core.clock import SystemClock
from agent.transport.memory import MemoryBroker
from agent.worker.local_api import LocalApi


async def test_a_message_is_answered_after_the_leader_stored_it(online: Setup) -> None:
    client = AsyncClient(online.socket)
    msg_id = await client.send("telemetry", {"t": 21.5})
    assert online.gw is not None and online.gw.messages is not None
    assert online.gw.messages.count("pi-1", "telemetry") == 1  # stored before the 202
    status = await client.status()
    counts = status["classes"]["telemetry"]
    assert (counts["accepted"], counts["direct"], counts["delivered"]) == (1, 1, 1)
    assert status["connected"] is True and isinstance(msg_id, str) and len(msg_id) == 33


async def test_an_overwrite_class_keeps_the_newest_value_per_key(online: Setup) -> None:
    client = AsyncClient(online.socket)
    with pytest.raises(LocalApiError) as missing:
        await client.send("state", "open")
    assert (missing.value.status, missing.value.field) == (400, "key")
    for value in ("open", "closed", "open-again"):
        await client.send("state", value, key="door")
    await client.send("state", 1, key="window")
    assert online.gw is not None and online.gw.messages is not None
    assert online.gw.messages.count("pi-1", "state") == 2


async def test_offline_messages_wait_in_the_outbox_and_a_full_class_answers_429(offline: Setup) -> None:
    client = AsyncClient(offline.socket)
    first = await client.send("tiny", b"a")
    await client.send("tiny", b"b")
    status, headers, body = await raw(offline.socket, post("/v1/messages/tiny", b"c", "text/plain"))
    assert status == 429 and headers["retry-after"] == "5" and "full" in str(body["error"])
    stats = await offline.device.outbox.stats()
    assert stats.by_class["app.tiny"].pending == 2  # what was acknowledged is stored; nothing else
    audit = (await client.status())["classes"]["tiny"]
    assert (audit["accepted"], audit["stored"], audit["refused"]) == (2, 2, {"full": 1})
    assert len(first) == 33


async def test_bad_requests_name_the_field_and_the_api_keeps_serving(offline: Setup) -> None:
    sock = offline.socket
    cases = [
        (post("/v1/messages", b"{not json"), 400, None),
        (post("/v1/messages", b'{"class": "telemetry"}'), 400, "payload"),
        (post("/v1/messages", b'{"class": "nope", "payload": 1}'), 400, "class"),
        (post("/v1/messages", b'{"class": "telemetry", "payload": 1, "colour": "red"}'), 400, "colour"),
        (post("/v1/messages", b'{"class": "telemetry", "payload": 1, "ttl": "soon"}'), 400, "ttl"),
        (post("/v1/messages", b'{"class": "telemetry", "payload_base64": "!!"}'), 400, "payload_base64"),
        (post("/v1/messages", b'{"messages": [{"class": "telemetry", "payload": 1}, {"class": "x", "payload": 2}]}'),
         400, "messages.1.class"),
        (post("/v1/messages/tiny", b"x" * 65, "text/plain"), 413, "payload"),
        (post("/v1/messages", b"[1, 2]"), 400, None),
        (post("/v1/messages", b"x=1", "application/x-www-form-urlencoded"), 415, None),
        (b"GET /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, None),
        (b"GET /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 404, None),
        (b"BLAH\r\n\r\n", 400, None),
        (b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\n", 413, None),
        (b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 411, None),
    ]
    for request, want, field in cases:
        status, _, body = await raw(sock, request)
        assert status == want, (request[:60], status, body)
        assert body.get("field") == field, (request[:60], body)
    stats = await offline.device.outbox.stats()
    assert not [k for k in stats.by_class if k.startswith("app.")]  # the refused batch stored none
    status, _, body = await raw(sock, b"GET /v1/status HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert status == 200 and body["device_id"] == "pi-1"
    assert offline.device.system.problem() is None


def _sync_client_session(sock: Path) -> list[str]:
    with Client(sock) as client:
        ids = client.send_many([{"class": "telemetry", "payload": {"n": i}} for i in range(5)])
        one = client.send("telemetry", b"\x00\x01", content_type="application/octet-stream", ttl="1h")
        again = client.send("telemetry", [1, 2, 3])  # the kept-alive connection, once more
    return [*ids, one, again]


async def test_a_batch_is_stored_whole_and_the_clients_agree(offline: Setup) -> None:
    ids = await asyncio.to_thread(_sync_client_session, offline.socket)  # (the agent's loop runs here)
    assert len(set(ids)) == 7
    stats = await offline.device.outbox.stats()
    assert stats.by_class["app.telemetry"].pending == 7
    with pytest.raises(AgentUnavailable):
        await AsyncClient(offline.socket.parent / "no.sock").status()


# stdlib only, run by the system's python: the repo and its venv need not be readable by nobody
_RAW_CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("unavailable", exc.strerror); sys.exit(4)
body = b'{"class": "telemetry", "payload": 1}'
try:
    s.sendall(b"POST /v1/messages HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\nContent-Length: "
              + str(len(body)).encode() + b"\\r\\nConnection: close\\r\\n\\r\\n" + body)
except OSError:
    pass  # answered (403) and closed before the request was read
print(s.recv(4096).split(b"\\r\\n")[0].decode())
"""


def _as_nobody(sock: Path, groups: str) -> subprocess.CompletedProcess[str]:
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", groups, python, "-I", "-c", _RAW_CLIENT,
                           str(sock)], capture_output=True, text=True, timeout=60, cwd="/")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may traverse (pytest's tmp_path is 0700)."""
    shared = Path(tempfile.mkdtemp(prefix="ea-api-", dir="/tmp"))
    shared.chmod(0o755)
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
async def test_the_socket_refuses_a_process_outside_its_group(tmp_path: Path, shared_dir: Path) -> None:
    # the socket 0660 root:root
    setup = await start_api(tmp_path, MemoryBroker(clock=SystemClock()), with_leader=False, group="root",
                         socket_dir=shared_dir)
    try:
        assert setup.socket.stat().st_mode & 0o777 == 0o660
        outsider = await asyncio.to_thread(_as_nobody, setup.socket, "--clear-groups")
        assert outsider.returncode == 4 and "Permission denied" in outsider.stdout, outsider
        member = await asyncio.to_thread(_as_nobody, setup.socket, "--groups=0")
        assert member.returncode == 0 and "202" in member.stdout, member
        stats = await setup.device.outbox.stats()
        assert stats.by_class["app.telemetry"].pending == 1  # the member's message only
    finally:
        await stop_api(setup)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
async def test_a_socket_widened_by_hand_still_refuses_an_outsider(tmp_path: Path, shared_dir: Path) -> None:
    setup = await start_api(tmp_path, MemoryBroker(clock=SystemClock()), with_leader=False, group="root",
                         socket_dir=shared_dir)
    try:
        setup.socket.chmod(0o666)  # someone "fixed" a permission problem the wrong way
        outsider = await asyncio.to_thread(_as_nobody, setup.socket, "--clear-groups")
        assert "403" in outsider.stdout, outsider  # the peer's credentials are checked on accept
        assert setup.api.refused_peers == 1
        stats = await setup.device.outbox.stats()
        assert "app.telemetry" not in stats.by_class
    finally:
        await stop_api(setup)


_requests = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda line, headers, body: line + b"\r\n" + headers + b"\r\n\r\n" + body,
              st.sampled_from([b"POST /v1/messages HTTP/1.1", b"POST /v1/messages/telemetry HTTP/1.1",
                               b"GET /v1/status HTTP/1.1", b"POST / HTTP/1.0", b"PUT /v1/messages HTTP/1.1"]),
              st.lists(st.sampled_from([b"Content-Length: 5", b"Content-Length: -1", b"Content-Length: 99999999",
                                        b"Content-Type: application/json", b"Content-Type: application/msgpack",
                                        b"Connection: close", b"Transfer-Encoding: chunked", b"X: \xff\xfe",
                                        b"no colon"]), max_size=4).map(b"\r\n".join),
              st.binary(max_size=40)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=_requests)
async def test_any_bytes_on_the_socket_leave_the_api_serving(offline: Setup, request: bytes) -> None:
    reader, writer = await asyncio.open_unix_connection(str(offline.socket))
    writer.write(request)
    if writer.can_write_eof():
        writer.write_eof()
    await writer.drain()
    answer = await reader.read(65536)  # an answer or a close, never a hang: the request ended
    writer.close()
    if answer:
        status = int(answer.split(b" ", 2)[1])
        assert status in (200, 202, 400, 404, 405, 408, 411, 413, 415, 431), answer[:200]
    status, _, body = await raw(offline.socket, b"GET /v1/status HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert status == 200 and body["device_id"] == "pi-1"


async def test_a_msgpack_body_carries_binary_payloads(offline: Setup) -> None:
    import msgspec

    body = msgspec.msgpack.encode({"class": "telemetry", "payload": b"\x00\xffraw", "ttl": 60})
    status, _, answer = await raw(offline.socket, post("/v1/messages", body, "application/msgpack"))
    assert status == 202 and answer["path"] == "outbox"
    import sqlite3

    from agent.protocol import AppMessage, decode_as

    conn = sqlite3.connect(f"file:{offline.device.outbox.path}?mode=ro", uri=True)
    try:
        payload, expires = conn.execute(
            "SELECT payload, expires_at FROM outbox WHERE kind = 'app.telemetry'").fetchone()
    finally:
        conn.close()
    stored = decode_as(payload, AppMessage)
    assert isinstance(stored, AppMessage)
    assert (stored.payload, stored.content_type) == (b"\x00\xffraw", "application/octet-stream")
    assert expires is not None  # its ttl went with it


async def test_a_second_agent_on_the_same_socket_is_refused_and_a_stale_one_is_replaced(offline: Setup,
                                                                                        tmp_path: Path) -> None:
    from agent.core.errors import ConfigError

    other = LocalApi(offline.device.messages, offline.device.message_status, clock=SystemClock(),
                     socket_path=offline.socket)
    with pytest.raises(ConfigError, match="another agent listens on"):
        await other.start()
    status, _, _ = await raw(offline.socket, b"GET /v1/status HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert status == 200  # the first one still serves
    import socket as sockets

    stale = tmp_path / "stale.sock"
    left = sockets.socket(sockets.AF_UNIX)
    left.bind(str(stale))  # bound, never listening: what a killed agent leaves
    left.close()
    api = LocalApi(offline.device.messages, offline.device.message_status, clock=SystemClock(), socket_path=stale)
    await api.start()
    try:
        status, _, _ = await raw(stale, b"GET /v1/status HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert status == 200
    finally:
        await api.stop()
    assert not stale.exists()


async def test_the_loopback_port_serves_the_same_api(tmp_path: Path) -> None:
    from agent.core.errors import ConfigError

    clock = SystemClock()
    device = await worker(clock, tmp_path, "pi-1", broker=MemoryBroker(clock=clock), relay=False,
                          sections={"classes": CLASSES, "local_api": {"direct_timeout_s": 0.1}})
    api = LocalApi(device.messages, device.message_status, clock=clock, socket_path=None, listen="127.0.0.1:0")
    await api.start()
    try:
        address = api.tcp_address
        assert address is not None and address[0] == "127.0.0.1"
        reader, writer = await asyncio.open_connection(*address)
        writer.write(post("/v1/messages/telemetry", b"21.5", "text/plain"))
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 202")
        writer.close()
    finally:
        await api.stop()
        await device.stop()
    with pytest.raises(ConfigError, match="local_api.listen"):
        LocalApi(device.messages, device.message_status, clock=clock, socket_path=None, listen="0.0.0.0:8731")


async def test_send_takes_a_file_or_standard_input_and_says_why_not_in_its_exit_status(offline: Setup,
                                                                                         tmp_path: Path) -> None:
    async def send(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent.cli", "send", *args, "--socket", str(offline.socket),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        out, err = await proc.communicate(stdin)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    reading = tmp_path / "reading.bin"
    reading.write_bytes(b"\x01\x02")
    code, out, err = await send("telemetry", "--file", str(reading), "--content-type", "application/x-reading")
    assert code == 0 and len(out.strip()) == 33, err
    code, out, _ = await send("state", "--key", "door", "--ttl", "1h", "-", stdin=b"open")
    assert code == 0
    code, _, err = await send("state", "-", stdin=b"open")
    assert code == 2 and "key" in err
    for _ in range(2):
        await send("tiny", "--json", "1")
    code, _, err = await send("tiny", "--json", "1")
    assert code == 3 and "429" in err and "retry after" in err
    code, _, err = await send("telemetry", "--json", "{not json")
    assert code == 2 and "--json: not valid JSON" in err
    # a script that runs the same send again under its --app-id gets the first id back, one copy
    code, first, _ = await send("telemetry", "--json", '{"door": "open"}', "--app-id", "door-7")
    code2, again, err = await send("telemetry", "--json", '{"door": "open"}', "--app-id", "door-7")
    assert (code, code2, again) == (0, 0, first) and "duplicate: door-7 was taken before (path outbox)" in err
    stats = await offline.device.outbox.stats()
    assert stats.by_class["app.telemetry"].pending == 2 and stats.by_class["app.state"].pending == 1


async def test_a_client_outside_the_unit_finds_the_socket_in_systemds_runtime_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under systemd the socket is in RUNTIME_DIRECTORY, which a shell does not have: the client
    reading the same config finds it through DATA_DIR/api.sock, a link the agent keeps."""
    from e2e.agent_support import write_config

    from agent.worker.env import DeviceEnv
    from agent.worker.serving import local_api_part

    runtime = tmp_path / "run"
    runtime.mkdir()
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(runtime))
    clock = SystemClock()
    sections = {"classes": CLASSES, "local_api": {"direct_timeout_s": 0.1}}
    device = await worker(clock, tmp_path, "pi-1", broker=MemoryBroker(clock=clock), relay=False, sections=sections)
    api = await local_api_part(device, DeviceEnv())
    assert api is not None
    await api.start()
    try:
        assert api.socket_path == runtime / "api.sock"
        assert (device.data_dir / "api.sock").resolve() == runtime / "api.sock"
        conf = write_config(tmp_path / "worker.toml", "worker", "pi-1", agent={"data_dir": str(device.data_dir)},
                            **sections)
        monkeypatch.delenv("RUNTIME_DIRECTORY")
        assert len(await AsyncClient.from_config(conf).send("telemetry", 21.5)) == 33  # an id: durable
    finally:
        await api.stop()
    # the same agent started by hand afterwards listens where the link was
    again = await local_api_part(device, DeviceEnv())
    assert again is not None
    await again.start()
    try:
        assert again.socket_path == device.data_dir / "api.sock" and again.socket_path.is_socket()
    finally:
        await again.stop()
        await device.stop()


async def test_starting_the_socket_leaves_the_process_umask_to_everyone_else(tmp_path: Path) -> None:
    """The umask is the whole process's: a folder another part creates while the local API starts
    (on a board: the updater's state folder) gets the service's mode, not the socket's."""
    clock = SystemClock()
    device = await worker(clock, tmp_path, "pi-1", broker=MemoryBroker(clock=clock), relay=False)
    old = os.umask(0o027)
    made: list[int] = []
    starting = asyncio.Event()

    async def make_folders() -> None:
        await starting.wait()
        for i in range(50):  # every turn of the loop while the API starts
            folder = tmp_path / f"folder-{i}"
            await asyncio.to_thread(folder.mkdir)
            made.append(folder.stat().st_mode & 0o777)

    api = LocalApi(device.messages, device.message_status, clock=clock, socket_path=tmp_path / "api.sock")
    folders = asyncio.create_task(make_folders())
    try:
        starting.set()
        await api.start()
        await folders
        assert set(made) == {0o750}, sorted({oct(m) for m in made})
        assert (tmp_path / "api.sock").stat().st_mode & 0o777 == 0o660
    finally:
        os.umask(old)
        await api.stop()
        await device.stop()
