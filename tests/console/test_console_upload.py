"""An artifact uploaded in the console: the body goes to a file in the leader's store as it
arrives (never held in memory), is checked against the fleet's key as the leader checks it, and
only a verified copy stays; a request that may not upload never gets a byte written to disk."""

from __future__ import annotations

import http.client
import re
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from test_console_http import BEARER, FORM, TOKEN, request

from agent.console.server import Console, ConsoleConfig, ConsoleServer
from agent.core.clock import VirtualClock
from agent.leader.registry import DeviceRegistry
from firmware_rollout.artifact.fixture import make_artifact


@contextmanager
def console(db: Path, *, public_key: Path | None, max_upload_bytes: int = 1 << 30) -> Iterator[tuple[str, int]]:
    server = ConsoleServer(("127.0.0.1", 0), Console(ConsoleConfig(
        db=db, outbox=db.with_name("outbox.db"), token=TOKEN, public_key=public_key,
        max_upload_bytes=max_upload_bytes)))
    server.serve_in_thread()
    try:
        yield server.server_address[0], server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def put(address: tuple[str, int], body: bytes, headers: dict[str, str], name: str = "fw.eafw") -> tuple[int, str]:
    conn = http.client.HTTPConnection(*address, timeout=30)
    try:
        conn.request("PUT", f"/artifacts/upload?name={name}", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode()
    except (BrokenPipeError, ConnectionResetError):  # refused before the whole body was sent
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _browser(address: tuple[str, int]) -> tuple[dict[str, str], str]:
    """A signed-in browser's cookie and the artifacts page's CSRF value."""
    conn = http.client.HTTPConnection(*address, timeout=30)
    conn.request("POST", "/login", body=f"token={TOKEN}&name=alice", headers=FORM)
    response = conn.getresponse()
    response.read()
    cookie = "; ".join(v.split(";")[0] for k, v in response.getheaders() if k == "Set-Cookie")
    conn.close()
    _, _, page = request(address, "GET", "/artifacts", headers={"Cookie": cookie})
    found = re.search(r'data-csrf="([0-9a-f]+)"', page)
    assert found is not None and 'id="upload-file"' in page
    return {"Cookie": cookie}, found.group(1)


def start_from_form(address: tuple[str, int], artifact: str, rollout_id: str) -> None:
    """The new-rollout form's `start it` for the store's file `artifact`, to every device."""
    form = {"artifact": artifact, "name": "", "id": rollout_id, "select": "all", "values": "", "canary": "1",
            "counts": "1", "soak_s": "0", "step": "start"}
    status, _, body = request(address, "POST", "/rollouts/new", headers={**BEARER, **FORM},
                              body=urllib.parse.urlencode(form))
    assert status == 303, body


def started_kind(db: Path) -> str:
    """The kind of the one start control the console queued."""
    import json

    from rollout_engine.store import RolloutStore

    store = RolloutStore.open(db, clock=VirtualClock())
    try:
        [start] = store.pending_controls()
        assert start.action == "start"
        return str(json.loads(start.arg)["spec"]["rollout"]["kind"])
    finally:
        store.close()


def test_an_uploaded_artifact_is_verified_and_kept_or_refused_with_the_reason(tmp_path: Path) -> None:
    db = tmp_path / "leader.db"
    DeviceRegistry.open(db, clock=VirtualClock()).close()
    artifact, public = make_artifact(tmp_path, chunk_size=4096, size=64 * 1024)
    store = tmp_path / "artifacts"
    good = artifact.read_bytes()
    with console(db, public_key=public) as address:
        browser, csrf = _browser(address)
        status, said = put(address, good, browser)  # no CSRF header: nothing is written
        assert status == 403 and not list(store.glob("*"))
        status, said = put(address, good, {**browser, "X-CSRF-Token": csrf})
        assert status == 201 and "fw.eafw: fw 1.1.0 (64.0 KiB) verified and kept as " in said
        kept = list(store.glob("*.eafw"))
        assert len(kept) == 1 and kept[0].read_bytes() == good
        _, _, page = request(address, "GET", "/artifacts", headers=BEARER)
        assert kept[0].name in page and "<td>1.1.0</td>" in page
        _, _, form = request(address, "GET", "/rollouts/new", headers=BEARER)
        assert f'<option value="{kept[0].name}">fw 1.1.0' in form  # a rollout can start from it at once

        tampered = bytearray(good)
        tampered[-100] ^= 0xFF
        status, said = put(address, bytes(tampered), BEARER, name="evil.eafw")
        assert status == 422 and said.startswith("artifact evil.eafw refused:") and ".upload-" not in said
        status, said = put(address, b"not an artifact", BEARER, name="junk.bin")
        assert status == 422 and "junk.bin" in said
        assert [p.name for p in store.iterdir()] == [kept[0].name]  # no partial file, no temporary one left

        wrong = {"Authorization": "Bearer wrong-token-0123456789"}
        answers = [put(address, good, wrong)[0] for _ in range(6)]
        assert answers == [401] * 5 + [429]  # wrong tokens count as at sign-in
        assert [p.name for p in store.iterdir()] == [kept[0].name]
    with console(db, public_key=public, max_upload_bytes=1024) as address:
        status, said = put(address, good, BEARER)
        assert status == 413 and "over 1024" in said
    with console(db, public_key=None) as address:
        status, said = put(address, good, BEARER)
        assert status == 409 and "started without --public-key" in said
        _, _, page = request(address, "GET", "/artifacts", headers=BEARER)
        assert "started without <code>--public-key</code>" in page and 'id="upload-file"' not in page


def test_a_config_release_is_uploaded_and_offered_as_a_config_rollout(tmp_path: Path) -> None:
    """A config release uploaded: checked against the fleet's key, kept by its id, listed as a
    config release, and the new-rollout form starts a config rollout of it."""
    from agent.leader.registry import DeviceRegistry
    from agent.protocol import Heartbeat
    from config_rollout.release import build_release
    from rollout_engine.keys import generate_keypair, load_signing_key
    from rollout_engine.store import RolloutStore

    keys = generate_keypair(tmp_path / "keys")
    db = tmp_path / "leader.db"
    with DeviceRegistry.open(db, clock=VirtualClock()) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0) for d in ("a", "b")])
    RolloutStore.open(db, clock=VirtualClock()).close()
    (tmp_path / "app.toml").write_text("port = 2\n")
    release = build_release("app", "1.1.0", [tmp_path / "app.toml"], load_signing_key(keys.private), created_ms=1)
    with console(db, public_key=keys.public) as address:
        status, said = put(address, release, BEARER, name="app-1.1.0.eacfg")
        assert status == 201 and "app-1.1.0.eacfg: config release app 1.1.0" in said, said
        kept = [p.name for p in (tmp_path / "artifacts").iterdir()]
        assert len(kept) == 1 and kept[0].endswith(".eacfg")
        _, _, page = request(address, "GET", "/artifacts", headers=BEARER)
        assert "config release for target app: 1 document" in page
        forged = bytearray(release)
        forged[-3] ^= 1
        status, said = put(address, bytes(forged), BEARER, name="evil.eacfg")
        assert status == 422 and "evil.eacfg" in said and ".upload-" not in said
        start_from_form(address, kept[0], "cfg-1")
        assert started_kind(db) == "config"
        # the leader starts it: its page has no image download columns and says a first release
        import asyncio

        from rollout_support import FakePort, engine_kinds

        from rollout_engine.keys import load_verify_key
        from rollout_engine.orchestrator import Orchestrator

        clock = VirtualClock()
        port = FakePort(clock, ["a", "b"])
        store = RolloutStore.open(db, clock=clock)
        try:
            kinds = engine_kinds(port, keys=load_verify_key(keys.public), directory=tmp_path / "artifacts")
            asyncio.run(Orchestrator(store, clock=clock, port=port, kinds=kinds).tick())
        finally:
            store.close()
        status, _, page = request(address, "GET", "/rollouts/cfg-1", headers=BEARER)
        assert status == 200 and 'id="state"' in page, page[-2000:]
        assert "MQTT chunks served" not in page and "<th>download</th>" not in page and "<th>fetched</th>" not in page
        assert "1.1.0 (a first release: the devices held none)" in page and "? →" not in page


def test_an_application_bundle_or_removal_is_uploaded_and_offered_as_an_app_rollout(tmp_path: Path) -> None:
    """An application bundle uploaded: checked whole against the fleet's key, kept by its hash,
    listed as an application, and the new-rollout form starts an app rollout of it; a removal
    too; a bundle of another key is refused naming the upload."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app_rollout"))
    from apps_support import app_dir, fleet_key

    from agent.protocol import Heartbeat
    from app_rollout.bundle import build_bundle, build_removal
    from app_rollout.kind import describe_bundle
    from rollout_engine.store import RolloutStore

    key, _, public = fleet_key(tmp_path / "keys")
    db = tmp_path / "leader.db"
    with DeviceRegistry.open(db, clock=VirtualClock()) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0) for d in ("a", "b")])
    RolloutStore.open(db, clock=VirtualClock()).close()
    build_bundle(app_dir(tmp_path / "hello", version="1.2.0"), key, tmp_path / "hello.eaapp")
    build_removal("hello", "2.0.0", key, tmp_path / "gone.eaapp")
    build_bundle(app_dir(tmp_path / "other"), fleet_key(tmp_path / "other-keys")[0], tmp_path / "other.eaapp")
    with console(db, public_key=public) as address:
        status, said = put(address, (tmp_path / "hello.eaapp").read_bytes(), BEARER, name="hello-1.2.0.eaapp")
        assert status == 201 and said.startswith("hello-1.2.0.eaapp: application hello 1.2.0 ("), said
        status, said = put(address, (tmp_path / "gone.eaapp").read_bytes(), BEARER, name="gone.eaapp")
        assert status == 201 and "gone.eaapp: the removal of application hello at 2.0.0" in said, said
        status, said = put(address, (tmp_path / "other.eaapp").read_bytes(), BEARER, name="other.eaapp")
        assert status == 422 and said.startswith("other.eaapp: signed by key ") and ".upload-" not in said, said
        kept = sorted(p.name for p in (tmp_path / "artifacts").iterdir())
        assert len(kept) == 2 and all(k.endswith(".eaapp") for k in kept)
        _, _, page = request(address, "GET", "/artifacts", headers=BEARER)
        assert "application hello: 2 files, health active" in page and "removal of application hello" in page
        assert 'accept=".eafw,.eacfg,.eaapp,.earel"' in page  # the file picker offers every kind's files
        bundle = next(k for k in kept if describe_bundle(tmp_path / "artifacts" / k).size)  # not the removal
        start_from_form(address, bundle, "app-1")
    assert started_kind(db) == "app"
