"""The console over HTTP: the token on every page, the sign-in cookie, CSRF on controls, and a
hostile device's strings rendered as text, never as markup."""

from __future__ import annotations

import html
import http.client
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main as cli
from agent.console.server import COOKIE, Console, ConsoleConfig, ConsoleServer
from agent.core.clock import SystemClock
from agent.core.sql import StoreTarget
from agent.leader.registry import DeviceRegistry
from agent.leader.rejects import RejectLog
from agent.protocol import Heartbeat

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, int]]:
    db = tmp_path / "leader.db"
    clock = SystemClock()
    with DeviceRegistry.open(db, clock=clock) as reg:
        reg.apply_heartbeats([Heartbeat(device_id="pi-0001", seq=1, uptime_s=1.0, firmware_version="1.0.0"),
                              Heartbeat(device_id="<script>alert(1)</script>", seq=1, uptime_s=1.0,
                                        firmware_version="<b>2</b>", tags=("<i>x</i>",))])
    with RejectLog.open(db, clock=clock) as rejects:
        rejects.record(topic="ea/v1/t/rogue/up", reason="<img src=x onerror=alert(1)>", payload=b"<svg>",
                       sender="rogue")
    with serving(db) as address:
        yield address


@contextmanager
def serving(db: StoreTarget, **config: Any) -> Iterator[tuple[str, int]]:
    """A console over `db` (a leader.db: its outbox and artifact store beside it, unless `config`
    names them) on a free loopback port."""
    if isinstance(db, Path):
        config.setdefault("outbox", db.with_name("outbox.db"))
    console = ConsoleServer(("127.0.0.1", 0), Console(ConsoleConfig(db=db, token=TOKEN, **config)))
    console.serve_in_thread()
    try:
        yield console.server_address[0], console.server_address[1]
    finally:
        console.shutdown()
        console.server_close()


def leader_db_of_one_device(tmp_path: Path) -> Path:
    """A leader's database that has heard one device, "a"."""
    db = tmp_path / "leader.db"
    with DeviceRegistry.open(db, clock=SystemClock()) as reg:
        reg.apply_heartbeats([Heartbeat(device_id="a", seq=1, uptime_s=1.0)])
    return db


def signed_in(address: tuple[str, int]) -> str:
    """The session cookie a browser gets by signing in with the token."""
    _, headers, _ = request(address, "POST", "/login", body=urllib.parse.urlencode({"token": TOKEN}),
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
    return headers["Set-Cookie"].split(";")[0]


def request(address: tuple[str, int], method: str, path: str, *, headers: dict[str, str] | None = None,
            body: str | None = None, source: str = "127.0.0.1") -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection(*address, timeout=30, source_address=(source, 0))
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        conn.close()


BEARER = {"Authorization": f"Bearer {TOKEN}"}


def test_every_page_needs_the_token(server: tuple[str, int]) -> None:
    for n, path in enumerate(("/", "/rollouts", "/dead-letters", "/rejects", "/devices/pi-0001")):
        status, headers, body = request(server, "GET", path)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer") and 'name="token"' in body
        assert "pi-0001" not in body
        status, _, _ = request(server, "GET", path, headers={"Authorization": "Bearer wrong-token-0123456789"},
                               source=f"127.0.1.{n}")  # (wrong tokens are limited per address)
        assert status == 401
        status, _, _ = request(server, "GET", path, headers=BEARER)
        assert status == 200, path
    status, _, body = request(server, "GET", "/", headers=BEARER)
    assert '<a href="/devices/pi-0001">pi-0001</a>' in body


def test_signing_in_sets_a_session_cookie_that_is_not_the_token(server: tuple[str, int]) -> None:
    status, headers, _ = request(server, "POST", "/login", body="token=nope",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 401 and "Set-Cookie" not in headers
    status, headers, _ = request(server, "POST", "/login", body=urllib.parse.urlencode({"token": TOKEN}),
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    cookie = headers["Set-Cookie"]
    assert status == 303 and cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert TOKEN not in cookie
    status, _, body = request(server, "GET", "/", headers={"Cookie": cookie.split(";")[0]})
    assert status == 200 and "pi-0001" in body


def test_a_hostile_devices_strings_are_text(server: tuple[str, int]) -> None:
    _, headers, body = request(server, "GET", "/", headers=BEARER)
    assert "<script>alert(1)</script>" not in body and "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "<b>2</b>" not in body and "<i>x</i>" not in body
    csp = headers["Content-Security-Policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["script-src"] == "'self'" and directives["default-src"] == "'none'"  # no inline script
    _, _, body = request(server, "GET", "/rejects", headers=BEARER)
    assert "<img src=x" not in body and "&lt;img src=x onerror=alert(1)&gt;" in body and "<svg>" not in body


def test_a_control_without_the_forms_csrf_value_is_refused(server: tuple[str, int]) -> None:
    _, headers, _ = request(server, "POST", "/login", body=urllib.parse.urlencode({"token": TOKEN}),
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
    cookie = headers["Set-Cookie"].split(";")[0]
    for extra in ({}, {"Authorization": "Bearer not-the-token"}):  # a Bearer header that proves nothing
        status, headers, body = request(server, "POST", "/rollouts/r1/control", body="action=pause&csrf=forged",
                                        headers={"Cookie": cookie, "Content-Type": "application/x-www-form-urlencoded",
                                                 **extra})
        assert status == 403 and "Location" not in headers and "the form has expired" in body
    status, _, _ = request(server, "POST", "/rollouts/r1/control", body="x" * 5000, headers=BEARER)
    assert status == 413


def test_the_command_refuses_a_readable_token_and_a_bad_listen_address(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o644)
    db = tmp_path / "leader.db"
    DeviceRegistry.open(db, clock=SystemClock()).close()
    assert cli(["console", "--db", str(db), "--token-file", str(token)]) == 2
    assert "group/others can access it" in capsys.readouterr().err
    token.chmod(0o600)
    assert cli(["console", "--db", str(db), "--token-file", str(token), "--listen", "127.0.0.1:0"]) == 2
    assert "port 0 is not 1-65535" in capsys.readouterr().err
    assert cli(["console", "--db", str(tmp_path / "none.db"), "--token-file", str(token)]) == 2
    assert "none.db: no such file" in capsys.readouterr().err


FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def test_wrong_tokens_are_limited_per_address(server: tuple[str, int]) -> None:
    """Five wrong tokens from one address (on /login or as a Bearer header) within a minute: the
    next try from it is 429 with Retry-After, the right token included; another address signs in."""
    for n in range(5):
        if n % 2:
            status, _, _ = request(server, "GET", "/", headers={"Authorization": f"Bearer guess-{n}"})
        else:
            status, _, _ = request(server, "POST", "/login", body=f"token=guess-{n}", headers=FORM)
        assert status == 401
    status, headers, body = request(server, "POST", "/login", body=urllib.parse.urlencode({"token": TOKEN}),
                                    headers=FORM)
    assert status == 429 and 1 <= int(headers["Retry-After"]) <= 60 and "too many wrong tokens" in body
    assert "Set-Cookie" not in headers
    status, _, _ = request(server, "GET", "/", headers=BEARER)
    assert status == 429
    status, headers, _ = request(server, "POST", "/login", body=urllib.parse.urlencode({"token": TOKEN}),
                                 headers=FORM, source="127.0.0.2")
    assert status == 303 and headers["Set-Cookie"].startswith(f"{COOKIE}=")
    status, _, _ = request(server, "GET", "/", source="127.0.0.2")
    assert status == 401  # no token offered: not a guess, nothing counted


def test_wrong_tokens_from_everywhere_do_not_lock_the_operator_out(server: tuple[str, int]) -> None:
    """F9: 30 wrong tokens a minute from 30 addresses: each guesser is slowed, and the operator's
    right token, from an address that did not guess, still signs in and still reads with Bearer."""
    for n in range(31):
        status, _, _ = request(server, "GET", "/", headers={"Authorization": f"Bearer guess-{n}"},
                               source=f"127.0.1.{n + 1}")
        assert status in (401, 429)
    status, _, _ = request(server, "GET", "/", headers={"Authorization": "Bearer guess-again"}, source="127.0.1.1")
    assert status == 429
    status, _, _ = request(server, "GET", "/", headers=BEARER, source="127.0.2.1")
    assert status == 200
    status, headers, _ = request(server, "POST", "/login", body=urllib.parse.urlencode({"token": TOKEN}),
                                 headers=FORM, source="127.0.2.2")
    assert status == 303 and headers["Set-Cookie"].startswith(f"{COOKIE}=")


def test_no_page_shows_text_from_the_url_as_its_own(server: tuple[str, int]) -> None:
    fake = "Your session expired: sign in again at evil.example"
    for path in ("/", "/rollouts", "/rollouts/r1", "/devices/pi-0001"):
        query = urllib.parse.urlencode({"message": fake, "error": fake, "queued": fake})
        _, _, body = request(server, "GET", f"{path}?{query}", headers=BEARER)
        assert "evil.example" not in body, path


def test_the_sign_in_limiter_counts_within_its_window() -> None:
    from agent.console.server import SignInLimiter

    limiter = SignInLimiter(per_address=2, total=3, window_s=3600)
    assert limiter.refuse("a") == 0
    limiter.failed("a")
    limiter.failed("a")
    assert limiter.refuse("a") > 0 and limiter.refuse("b") == 0
    limiter.failed("b")
    assert limiter.refuse("b") > 0  # three in all: b guessed wrong too
    assert limiter.refuse("c") == 0  # c never did: its token is still compared
    assert SignInLimiter(per_address=1, window_s=0.0).refuse("a") == 0


async def test_a_rollout_page_lists_its_devices_with_outcomes_and_a_device_page_reads_as_a_person_would(
        tmp_path: Path) -> None:
    """The rollout page: a bar segment per outcome (not one green bar for every finished device),
    MQTT chunks named as such, its devices from -> to with a state filter; the device page's
    system sample in units, not raw bytes and seconds."""
    from rollout_support import FakePort, engine_kinds

    from agent.core.clock import VirtualClock
    from agent.protocol import AppState, ConfigState, DeviceHealth, SlotState, SystemSample
    from firmware_rollout.artifact.fixture import make_artifact
    from rollout_engine.orchestrator import Orchestrator
    from rollout_engine.store import RolloutStore

    db = tmp_path / "leader.db"
    clock = VirtualClock()
    sample = SystemSample(mem_total_bytes=25_275_990_016, mem_available_bytes=12_000_000_000, mem_percent=52.5,
                          uptime_s=917.713)
    with DeviceRegistry.open(db, clock=clock) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, firmware_version="1.0.0", sample=sample,
                                        slots=SlotState(backend="uboot", booted="A", default="B", trial="B",
                                                        attempts={"A": 3, "B": 2},
                                                        versions={"A": "1.0.0", "B": "partial"}) if d == "a" else None,
                                        configs={"app": ConfigState(version="1.0.0", state="committed",
                                                                    drifted=("app.toml",)),
                                                 "net": ConfigState(version="2.0.0", state="committed")}
                                        if d == "a" else None,
                                        apps={"hello": AppState(version="1.0.0" if d == "c" else "2.0.0",
                                                                trial="2.1.0" if d == "b" else "")}
                                        if d in ("a", "b", "c") else None,
                                        health=DeviceHealth(firmware="1.0.0", operating_s=720_000,
                                                            unexpected_restarts=int(d == "b")))
                              for d in ("a", "b", "c", "d")])
    make_artifact(tmp_path, chunk_size=1024, size=2048)
    (tmp_path / "spec.toml").write_text('[rollout]\nname = "lab"\nartifact = "fw-1.1.0.eafw"\n'
                                        "[waves]\ncanary = 1\ncounts = [3]\n")
    RolloutStore.open(db, clock=clock).close()
    assert cli(["rollout", "start", str(tmp_path / "spec.toml"), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    store = RolloutStore.open(db, clock=clock)
    try:
        port = FakePort(clock, ["a", "b", "c", "d"])
        await Orchestrator(store, clock=clock, port=port, kinds=engine_kinds()).tick()
    finally:
        store.close()
    with serving(db) as address:
        _, _, page = request(address, "GET", "/rollouts/r1", headers=BEARER)
        assert "lab: 1.0.0 → 1.1.0" in page and "MQTT chunks served 0 (0 B)" in page
        assert 'class="seg in_progress" title="in_progress 1"' in page and "0 succeeded of 1, 1 in progress" in page
        assert page.count("1.0.0 → 1.1.0</td>") == 4 and '<option value="queued">queued</option>' in page
        _, _, queued = request(address, "GET", "/rollouts/r1?state=queued", headers=BEARER)
        assert queued.count("1.0.0 → 1.1.0</td>") == 3 and '<option value="queued" selected>' in queued
        _, _, device = request(address, "GET", "/devices/a", headers=BEARER)
        assert "memory 52% used of 23.54 GiB (11.18 GiB free)" in device and "host up 15m17s" in device
        assert "25275990016" not in device
        slots = device.split('<table id="slots" data-live>')[1].split("</table>")[0]
        assert ("<tr><td>A</td><td>1.0.0</td><td>yes</td>\n<td></td><td></td>\n<td>3</td></tr>" in slots
                and "<tr><td>B</td><td>partial</td><td></td>\n<td>yes</td><td>armed</td>\n<td>2</td></tr>" in slots)
        configs = device.split('<table id="configs" data-live>')[1].split("</table>")[0]
        assert "drifted: app.toml changed on the device" in configs and ">in sync</td>" in configs
        _, _, other = request(address, "GET", "/devices/b", headers=BEARER)
        assert 'id="slots">not reported' in other and 'id="configs"' not in other
        _, _, fleet = request(address, "GET", "/", headers=BEARER)  # the fleet's compliance per target
        table = fleet.split('<table id="fleet-config" data-live>')[1].split("</table>")[0]
        assert '<td>app</td><td class="online">0</td><td>0</td>\n<td class="offline">1</td>' in table
        assert '<td>net</td><td class="online">1</td>' in table
        apps = fleet.split('<table id="fleet-apps" data-live>')[1].split("</table>")[0]
        assert "<tr><td>hello</td><td>2.0.0 ×2, 1.0.0 ×1</td>\n<td>1</td>" in apps  # one on trial
        health = fleet.split('<table id="fleet-health" data-live>')[1].split("</table>")[0]  # as `status` says
        assert ('<tr><td>1.0.0</td><td class="online">99.9%</td>\n<td>800</td><td class="offline">1</td>'
                "<td>4</td></tr>") in health


def test_an_operator_starts_a_rollout_from_the_console_after_seeing_its_plan(tmp_path: Path) -> None:
    """The form lists the leader's verified artifacts; `show the plan` prints what `rollout start
    --dry-run` prints; `start it` writes the same start control as `rollout start` (with the
    form's CSRF value); a wrong field is the form again with the key named; nothing else is
    taken from the client (an artifact is chosen by its name in the store, never a path)."""
    import re
    import shutil

    from agent.core.clock import VirtualClock
    from firmware_rollout.artifact.fixture import make_artifact
    from rollout_engine.store import RolloutStore

    db = tmp_path / "leader.db"
    with DeviceRegistry.open(db, clock=VirtualClock()) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, firmware_version="1.0.0")
                              for d in ("a", "b", "c")])
    RolloutStore.open(db, clock=VirtualClock()).close()
    artifact, _ = make_artifact(tmp_path, chunk_size=1024, size=2048)
    (tmp_path / "artifacts").mkdir()
    shutil.copy(artifact, tmp_path / "artifacts" / "0123abcd.eafw")
    csrf = Console(ConsoleConfig(db=db, outbox=tmp_path / "outbox.db", token=TOKEN)).csrf
    with serving(db) as address:
        _, _, page = request(address, "GET", "/rollouts/new", headers=BEARER)
        assert '<option value="0123abcd.eafw">fw 1.1.0' in page
        _, headers, _ = request(address, "POST", "/login", body=urllib.parse.urlencode({"token": TOKEN}), headers=FORM)
        browser = {"Cookie": headers["Set-Cookie"].split(";")[0], **FORM}
        form = {"artifact": "0123abcd.eafw", "name": "lab", "id": "", "select": "devices", "values": "a, b, zz",
                "canary": "1", "counts": "1", "soak_s": "0", "csrf": csrf}

        def post(**changes: str) -> tuple[int, dict[str, str], str]:
            return request(address, "POST", "/rollouts/new", headers=browser,
                           body=urllib.parse.urlencode({**form, **changes}))

        status, _, page = post(step="preview")
        assert status == 200 and "wave 1 (canary): 1 device" in page and "zz  unknown to the leader" in page
        assert "c  not in the list" in page and 'id="start"' in page
        rid = re.search(r'name="id" id="rollout-id" value="([^"]+)"', page)
        assert rid is not None and rid.group(1).startswith("lab-")
        status, _, page = post(step="start", id=rid.group(1), csrf="forged")
        assert status == 403 and "the form has expired" in page
        status, _, page = post(step="preview", select="tags", values="")
        assert status == 400 and "targets.tags" in page
        status, _, page = post(step="preview", artifact="../../etc/passwd")
        assert status == 400 and "choose one of the leader&#39;s artifacts" in page
        # the spec's other fields: a mistake names the spec's key, and keeps what was typed
        status, _, page = post(step="preview", failure_threshold_pct="half")
        assert status == 400 and "gates.failure_threshold_pct" in page and 'value="half"' in page
        status, _, page = post(step="preview", windows="25:00-26:00")
        assert status == 400 and "device.maintenance_windows.0" in page
        status, _, page = post(step="preview", start_at="2026-12-02T01:00:00")
        assert status == 400 and "schedule" in page and "zone" in page
        status, _, page = post(step="preview", rollback_artifact="0123abcd.eafw")  # not signed as a rollback
        assert status == 400 and "rollback artifact" in page
        store = RolloutStore.open(db, clock=VirtualClock())
        try:
            assert store.pending_controls() == []
        finally:
            store.close()
        status, headers, _ = post(step="start", id=rid.group(1))
        assert status == 303 and headers["Location"].startswith(f"/rollouts/{rid.group(1)}?queued=")
        status, _, page = request(address, "GET", headers["Location"], headers=browser)
        assert status == 200 and 'data-page="rollout_starting"' in page  # not a 404 while the leader has not started it
        assert "the leader starts it on its next tick" in page
        store = RolloutStore.open(db, clock=VirtualClock())
        try:
            [queued] = store.pending_controls()
            assert (queued.rollout_id, queued.action) == (rid.group(1), "start")
        finally:
            store.close()


async def test_a_rollout_is_rolled_back_from_the_console_with_a_rollback_artifact_of_the_store(tmp_path: Path) -> None:
    """A rollout whose spec names no rollback artifact: the console offers `rollback` when the
    leader's store holds an artifact signed as a rollback of its version, picked on the
    confirmation page by its name in the store; the control names that copy."""
    import shutil

    from rollout_support import FakePort, engine_kinds

    from agent.core.clock import VirtualClock
    from firmware_rollout.artifact.fixture import make_artifact
    from rollout_engine.orchestrator import Orchestrator
    from rollout_engine.store import RolloutStore

    db = tmp_path / "leader.db"
    clock = VirtualClock()
    with DeviceRegistry.open(db, clock=clock) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, firmware_version="1.0.0") for d in "ab"])
    make_artifact(tmp_path, chunk_size=1024, size=2048)
    back, _ = make_artifact(tmp_path, version="1.0.0", chunk_size=1024, size=2048, rollback=True,
                            rollback_from=("1.1.0",))
    (tmp_path / "artifacts").mkdir()
    shutil.copy(back, tmp_path / "artifacts" / "feedbeef.eafw")
    (tmp_path / "spec.toml").write_text('[rollout]\nname = "lab"\nartifact = "fw-1.1.0.eafw"\n[waves]\ncounts = [2]\n')
    RolloutStore.open(db, clock=clock).close()
    assert cli(["rollout", "start", str(tmp_path / "spec.toml"), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    store = RolloutStore.open(db, clock=clock)
    try:
        await Orchestrator(store, clock=clock, port=FakePort(clock, ["a", "b"]), kinds=engine_kinds()).tick()
    finally:
        store.close()
    with serving(db) as address:
        _, _, page = request(address, "GET", "/rollouts/r1", headers=BEARER)
        assert 'id="control-rollback"' in page
        _, _, confirm = request(address, "GET", "/rollouts/r1/confirm?action=rollback", headers=BEARER)
        assert '<option value="feedbeef.eafw">fw 1.0.0 (replaces 1.1.0)' in confirm
        status, _, page = request(address, "POST", "/rollouts/r1/control", headers={**BEARER, **FORM},
                                  body="action=rollback&artifact=..%2F..%2Fetc%2Fpasswd")
        assert status == 409 and "choose a rollback artifact of the leader&#39;s store" in page
        status, headers, _ = request(address, "POST", "/rollouts/r1/control", headers={**BEARER, **FORM},
                                     body="action=rollback&artifact=feedbeef.eafw")
        assert status == 303 and "queued=" in headers["Location"]
    store = RolloutStore.open(db, clock=clock)
    try:
        [queued] = store.pending_controls()
        assert (queued.action, Path(queued.arg).name) == ("rollback", "feedbeef.eafw")
    finally:
        store.close()


def test_an_operator_sets_and_unsets_configuration_layer_values(tmp_path: Path) -> None:
    """The configuration page: a value set from its form lands in the leader's layers (as `config
    layer set` writes it, with who set it) and is listed; a field the CLI would refuse is the
    form again naming it; a forged form is refused; unset removes it."""
    from config_rollout.layer_store import LayerStore

    db = leader_db_of_one_device(tmp_path)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    with serving(db) as address:
        _, _, page = request(address, "GET", "/config", headers=BEARER)
        assert "No layer values yet." in page
        csrf, cookie = page.split('name="csrf" value="')[1].split('"')[0], signed_in(address)
        values = {"csrf": csrf, "action": "set", "target": "app", "scope": "device", "selector": "a",
                  "document": "app.toml", "key": "limits.max", "value": "20", "expires": "2h"}
        status, headers, _ = request(address, "POST", "/config", body=urllib.parse.urlencode(values),
                                     headers={**form, "Cookie": cookie})
        assert status == 303 and headers["Location"] == "/config?done=1"
        _, _, page = request(address, "GET", "/config?done=1", headers=BEARER)
        assert "saved: offered with the target" in page and "<td>limits.max</td><td><code>20</code>" in page
        rows = LayerStore.open_readonly(db).rows(now_ms=0)
        assert [(r.target, r.scope, r.selector, r.key, r.value) for r in rows] == [("app", "device", "a",
                                                                                   "limits.max", "20")]
        assert rows[0].expires_ms is not None and "via the console" in rows[0].set_by
        for field, bad, said in (("key", "a b", "key: 'a b' is not a valid key"),
                                 ("document", "notes.txt", "document: notes.txt: only a TOML or JSON document"),
                                 ("value", '{"a": 1}', "value: a layer sets one value, not a table")):
            status, _, page = request(address, "POST", "/config", body=urllib.parse.urlencode({**values, field: bad}),
                                      headers={**form, "Cookie": cookie})
            assert status == 400 and html.escape(said, quote=True).replace("&#x27;", "&#39;") in page
        status, _, page = request(address, "POST", "/config", body=urllib.parse.urlencode({**values, "csrf": "x"}),
                                  headers={**form, "Cookie": cookie})
        assert status == 403 and "the form has expired" in page
        unset = {k: values[k] for k in ("csrf", "target", "scope", "selector", "document", "key")}
        status, _, _ = request(address, "POST", "/config", body=urllib.parse.urlencode({**unset, "action": "unset"}),
                               headers={**form, "Cookie": cookie})
        assert status == 303 and LayerStore.open_readonly(db).rows(now_ms=0) == []


def test_an_operator_approves_and_revokes_device_identities(tmp_path: Path) -> None:
    """The identities page: pending enrolments with approve and reject, enrolled devices with
    revoke; a decision is a control for the running leader (as `edge-agent devices` writes it,
    with who decided); a forged form and an unknown device are refused; a leader without
    [identity] says identities are off."""
    from agent.leader.identities import IdentityStore

    db = leader_db_of_one_device(tmp_path)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    with serving(db) as address:
        _, _, page = request(address, "GET", "/identities", headers=BEARER)
        assert "Device identities are off" in page
        with IdentityStore.open(db) as store:
            store.record_request(device="<b>pi-9</b>", fingerprint="ab" * 32, csr="", hw_serial="1000cafe",
                                 machine_id="", agent_version="0.1.0", claim="claim", now_ms=1)
        _, _, page = request(address, "GET", "/identities", headers=BEARER)
        assert "&lt;b&gt;pi-9&lt;/b&gt;" in page and "<b>pi-9</b>" not in page and "1000cafe" in page
        csrf, cookie = page.split('name="csrf" value="')[1].split('"')[0], signed_in(address)
        decision = {"csrf": csrf, "action": "approve", "device": "<b>pi-9</b>"}
        status, headers, _ = request(address, "POST", "/identities", body=urllib.parse.urlencode(decision),
                                     headers={**form, "Cookie": cookie})
        assert status == 303 and headers["Location"].startswith("/identities?queued=")
        controls = IdentityStore.open_readonly(db).controls()
        assert [(c.action, c.device) for c in controls] == [("approve", "<b>pi-9</b>")]
        assert "via the console" in controls[0].by
        _, _, page = request(address, "GET", headers["Location"], headers=BEARER)
        assert "queued as control" in page and "waiting for the leader" in page
        status, _, page = request(address, "POST", "/identities", body=urllib.parse.urlencode(
            {**decision, "device": "nobody"}), headers={**form, "Cookie": cookie})
        assert status == 409 and "no enrolment of" in page
        status, _, page = request(address, "POST", "/identities", body=urllib.parse.urlencode(
            {**decision, "csrf": "x"}), headers={**form, "Cookie": cookie})
        assert status == 403 and "the form has expired" in page
        assert len(IdentityStore.open_readonly(db).controls()) == 1
