"""Who did what and when: every control records who asked (the console's operator and address,
the CLI's user), the rollout page and `rollout status` show it, a device page shows its timeline
of states and the controls of its rollouts; the rollout and the fleet are charted by the server;
pages update their live parts from a script of the console's own (no inline script)."""

from __future__ import annotations

import os
import pwd
import re
import urllib.parse
from pathlib import Path

import pytest
from rollout_support import FakePort, engine_kinds
from test_console_http import BEARER, FORM, TOKEN, request, serving

from agent.cli import main as cli
from agent.core.clock import VirtualClock
from agent.leader.registry import DeviceRegistry
from agent.protocol import Heartbeat
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.orchestrator import Orchestrator
from rollout_engine.store import RolloutStore


def _signed_in(address: tuple[str, int], name: str) -> dict[str, str]:
    """A browser's headers after signing in as `name` (both cookies: a dict of headers keeps one)."""
    import http.client

    conn = http.client.HTTPConnection(*address, timeout=30)
    try:
        conn.request("POST", "/login", body=urllib.parse.urlencode({"token": TOKEN, "name": name}), headers=FORM)
        response = conn.getresponse()
        response.read()
        assert response.status == 303
        cookies = [v.split(";")[0] for k, v in response.getheaders() if k == "Set-Cookie"]
    finally:
        conn.close()
    return {"Cookie": "; ".join(cookies), **FORM}


async def test_controls_record_who_asked_and_the_pages_show_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "leader.db"
    clock = VirtualClock()
    with DeviceRegistry.open(db, clock=clock) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, firmware_version="1.0.0") for d in "abc"])
    make_artifact(tmp_path, chunk_size=1024, size=2048)
    (tmp_path / "spec.toml").write_text('[rollout]\nname = "lab"\nartifact = "fw-1.1.0.eafw"\n[waves]\ncounts = [3]\n')
    RolloutStore.open(db, clock=clock).close()
    assert cli(["rollout", "start", str(tmp_path / "spec.toml"), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    port = FakePort(clock, list("abc"))

    async def leader_tick() -> None:
        store = RolloutStore.open(db, clock=clock)
        try:
            await Orchestrator(store, clock=clock, port=port, kinds=engine_kinds()).tick()
        finally:
            store.close()

    await leader_tick()
    store = RolloutStore.open(db, clock=clock)
    try:
        store.set_device("r1", "a", state="downloading", detail="fetching")
        store.set_device("r1", "a", state="downloading", detail="still fetching")  # no change of state: no event
        store.set_device("r1", "a", state="installing")
    finally:
        store.close()

    with serving(db) as address:
        alice = _signed_in(address, "alice")
        status, _, _ = request(address, "POST", "/login", headers=FORM,
                               body=urllib.parse.urlencode({"token": TOKEN, "name": "<b>mallory</b>"}))
        assert status == 400
        # a forged name cookie (alice's MAC, another name) is not believed
        forged = {"Cookie": alice["Cookie"].replace("ea_operator=alice.", "ea_operator=mallory."), **FORM}
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"',
                         request(address, "GET", "/rollouts/r1/confirm?action=pause", headers=alice)[2])
        assert csrf is not None
        status, _, _ = request(address, "POST", "/rollouts/r1/control", headers=alice,
                               body=f"action=pause&csrf={csrf.group(1)}")
        assert status == 303
        await leader_tick()
        status, _, _ = request(address, "POST", "/rollouts/r1/control", headers=forged,
                               body=f"action=resume&csrf={csrf.group(1)}")
        assert status == 303
        await leader_tick()
        status, _, _ = request(address, "POST", "/rollouts/r1/control", headers={**BEARER, **FORM},
                               body="action=next")
        assert status == 409  # one wave: refused before it is queued, so not in the record
    assert cli(["rollout", "cancel", "r1", "--db", str(db), "--no-wait"]) == 0
    await leader_tick()
    store = RolloutStore.open(db, clock=clock)
    try:
        actors = [(c.action, c.actor) for c in store.controls("r1")]
    finally:
        store.close()
    user = pwd.getpwuid(os.getuid()).pw_name
    assert actors[1:3] == [("pause", "alice via the console from 127.0.0.1"),
                           ("resume", "an operator via the console from 127.0.0.1")]
    assert actors[0][0] == "start" and actors[0][1].startswith(f"{user} (uid {os.getuid()}")
    assert "on the CLI" in actors[0][1]
    assert actors[3][0] == "cancel" and "on the CLI" in actors[3][1]

    capsys.readouterr()
    assert cli(["rollout", "status", "r1", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "pause by alice via the console from 127.0.0.1: applied" in out
    assert cli(["rollout", "status", "r1", "--db", str(db), "--json"]) == 0
    import json

    audit = json.loads(capsys.readouterr().out)["audit"]
    assert [(c["action"], c["outcome"]) for c in audit] == [
        ("start", "applied"), ("pause", "applied"), ("resume", "applied"), ("cancel", "applied")]

    with serving(db) as address:
        _, _, page = request(address, "GET", "/rollouts/r1", headers=BEARER)
        assert '<table id="audit" data-live>' in page and "alice via the console from 127.0.0.1" in page
        assert '<svg class="chart" role="img" aria-label="devices of rollout r1 by state over time"' in page
        assert 'class="area canceled"' in page or 'class="area in_progress"' in page
        _, _, device = request(address, "GET", "/devices/a", headers=BEARER)
        timeline = device.split('<table id="timeline" data-live>')[1].split("</table>")[0]
        states = re.findall(r"</a></td><td>([a-z_]+)</td>", timeline)  # newest first
        assert states.index("installing") < states.index("downloading")
        assert states.count("downloading") == 1  # one event per change of state, not per report
        assert "alice via the console from 127.0.0.1" in device.split('<table id="audit" data-live>')[1]


def test_pages_update_their_live_parts_from_the_consoles_own_script(tmp_path: Path) -> None:
    db = tmp_path / "leader.db"
    clock = VirtualClock()
    with DeviceRegistry.open(db, clock=clock) as reg:
        reg.apply_heartbeats([Heartbeat(device_id="a", seq=1, uptime_s=1.0)])
        reg.mark_alive()
    with serving(db) as address:
        status, _, _ = request(address, "GET", "/static/live.js")
        assert status == 401  # like every page, behind the token
        status, headers, script = request(address, "GET", "/static/live.js", headers=BEARER)
        assert status == 200 and headers["Content-Type"].startswith("text/javascript") and "data-live" in script
        _, headers, page = request(address, "GET", "/", headers=BEARER)
        assert '<script src="/static/live.js" defer></script>' in page and 'data-refresh="5"' in page
        assert "<script>" not in page and 'http-equiv="refresh"' not in page  # no inline script, no full reload
        assert '<p id="fleet-summary" data-live>' in page and '<table id="devices" data-live>' in page
        assert "devices online over the last 24 hours: not enough history yet" in page  # one sample so far
        _, _, form = request(address, "GET", "/rollouts/new", headers=BEARER)
        assert "live.js" not in form  # a form being filled in is never replaced
