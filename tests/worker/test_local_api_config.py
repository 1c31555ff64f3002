"""Applications read their configuration through the local API: `GET /v1/config/NAME` answers
the target's applied release (documents as text, drift), and a long poll (`?version=V&wait=S`)
answers as soon as another version is applied; the Python client's `watch_config` yields each."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import worker
from local_api_support import raw

from agent.client import AsyncClient, LocalApiError
from agent.core.clock import SystemClock
from agent.transport.memory import MemoryBroker
from agent.worker.local_api import LocalApi
from agent.worker.serving import config_reader
from config_rollout.device.apply import ConfigApplier
from config_rollout.release import build_release, parse_release
from rollout_engine.keys import SigningKey

KEY = SigningKey.generate()


def release(tmp: Path, version: str, text: str) -> bytes:
    src = tmp / f"src-{version}"
    src.mkdir()
    (src / "app.toml").write_text(text)
    return build_release("app", version, [src / "app.toml"], KEY, created_ms=1)


async def test_an_application_reads_and_watches_its_configuration(tmp_path: Path, broker: MemoryBroker) -> None:
    clock = SystemClock()
    etc = tmp_path / "etc" / "app"
    device = await worker(clock, tmp_path, "pi-1", broker=broker,
                          sections={"config_targets": {"app": {"directory": str(etc), "settle_s": 0}}})
    sock = tmp_path / "api.sock"
    api = LocalApi(device.messages, device.message_status, clock=clock, socket_path=sock,
                   configs=config_reader(device))
    await api.start()
    plain = LocalApi(device.messages, device.message_status, clock=clock, socket_path=tmp_path / "plain.sock")
    await plain.start()
    try:
        client = AsyncClient(sock)
        first = await client.config("app")
        assert (first["version"], first["documents"], first["changed"]) == ("", {}, True)
        for name, status in (("web", 404), ("a%2Fb", 400)):
            try:
                await client.config(name)
            except LocalApiError as exc:
                assert exc.status == status
            else:
                raise AssertionError(f"{name} answered")
        status, _, body = await raw(tmp_path / "plain.sock", b"GET /v1/config/app HTTP/1.1\r\nHost: x\r\n"
                                                              b"Connection: close\r\n\r\n")
        assert status == 404 and "declares no configuration targets" in str(body["error"])

        applier = ConfigApplier("app", device.config.config_targets["app"], device.data_dir)
        assert (await applier.apply(parse_release(release(tmp_path, "1.0.0", "port = 1\n"), KEY.public))).state \
            == "committed"
        seen: list[dict[str, object]] = []
        got_first = asyncio.Event()

        async def watch() -> None:
            async for view in client.watch_config("app", wait_s=30):
                seen.append(view)
                got_first.set()
                if len(seen) == 2:
                    return

        watcher = asyncio.create_task(watch())
        await asyncio.wait_for(got_first.wait(), 30)
        assert seen[0]["version"] == "1.0.0" and seen[0]["documents"] == {"app.toml": {"text": "port = 1\n"}}
        await applier.apply(parse_release(release(tmp_path, "1.1.0", "port = 2\n"), KEY.public))
        await asyncio.wait_for(watcher, 30)  # the long poll answered the change, not its 30 s
        assert seen[1]["version"] == "1.1.0" and seen[1]["documents"] == {"app.toml": {"text": "port = 2\n"}}
        (etc / "app.toml").write_text("port = 9\n")  # edited on the device
        drifted = await client.config("app")
        assert drifted["drifted"] == ["app.toml"] and drifted["documents"]["app.toml"]["text"] == "port = 9\n"
        status, _, body = await raw(sock, b"GET /v1/config/app?version=1.1.0&wait=0.2 HTTP/1.1\r\nHost: x\r\n"
                                          b"Connection: close\r\n\r\n")
        assert status == 200 and body["changed"] is False  # nothing new within the wait
        status, _, body = await raw(sock, b"GET /v1/config/app?wait=soon HTTP/1.1\r\nHost: x\r\n"
                                          b"Connection: close\r\n\r\n")
        assert status == 400 and body["field"] == "wait"
    finally:
        await api.stop()
        await plain.stop()
        await device.stop()


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


async def test_an_application_accepts_or_vetoes_a_staged_config(tmp_path: Path, broker: MemoryBroker) -> None:
    """A target with app_validate_s holds each staged release for an application's verdict: it
    reads the staged documents, a veto's reason refuses the release (nothing changes), an accept
    lets it apply, and no verdict in time is a refusal too."""
    from agent.worker.config_targets import config_reviews

    clock = SystemClock()
    etc = tmp_path / "etc" / "app"
    device = await worker(clock, tmp_path, "pi-1", broker=broker, sections={"config_targets": {"app": {
        "directory": str(etc), "settle_s": 0, "app_validate_s": 30}}})
    sock = tmp_path / "api.sock"
    reviews = config_reviews(device)
    api = LocalApi(device.messages, device.message_status, clock=clock, socket_path=sock,
                   configs=config_reader(device), reviews=reviews)
    await api.start()
    try:
        client = AsyncClient(sock)
        assert await client.staged_config("app", wait_s=0.1) is None  # nothing staged
        applier = ConfigApplier("app", device.config.config_targets["app"], device.data_dir, reviews=reviews)

        async def judged(version: str, text: str, accept: bool, reason: str = "") -> str:
            applying = asyncio.create_task(applier.apply(parse_release(release(tmp_path, version, text), KEY.public)))
            staged = await client.staged_config("app", wait_s=30)
            assert staged is not None and staged["version"] == version
            assert staged["documents"] == {"app.toml": {"text": text}}
            for bad, field in ((b'{"review": "x", "accept": "no"}', "accept"), (b'{"accept": true}', "review"),
                               (b'{"review": "x", "accept": true, "reason": 5}', "reason")):
                status, _, body = await raw(sock, post("/v1/config/app/verdict", bad))
                assert status == 400 and body["field"] == field
            status, _, body = await raw(sock, post("/v1/config/app/verdict", b'{"review": "stale", "accept": true}'))
            assert status == 409
            await client.judge_config("app", staged["review"], accept=accept, reason=reason)
            result = await applying
            try:
                await client.judge_config("app", staged["review"], accept=True)  # the first verdict decided
            except LocalApiError as exc:
                assert exc.status == 409
            else:
                raise AssertionError("a second verdict was taken")
            return f"{result.state}: {result.detail}"

        assert await judged("1.0.0", "port = 1\n", True) == "committed: confirmed"
        assert await judged("1.1.0", "port = 80\n", False, "port 80 is taken") == (
            "failed: validation refused 1.1.0: the application vetoed it: port 80 is taken")
        assert (etc / "app.toml").read_text() == "port = 1\n"  # nothing changed
        hurried = ConfigApplier("app", msgspec.structs.replace(device.config.config_targets["app"], app_validate_s=0.2),
                                device.data_dir, reviews=reviews)
        result = await hurried.apply(parse_release(release(tmp_path, "1.2.0", "port = 3\n"), KEY.public))
        assert result.state == "failed" and "no application gave a verdict within 0.2 s" in result.detail
        assert (etc / "app.toml").read_text() == "port = 1\n"
    finally:
        await api.stop()
        await device.stop()
