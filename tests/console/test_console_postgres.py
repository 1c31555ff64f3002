"""The console over the fleet's PostgreSQL database that several leaders share: the whole fleet
on one page, which leader served each device, the rejects of every leader, the configuration
layers every leader offers; what stays each leader's own (its outbox) says so instead of showing
one leader's."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_console_http import BEARER, TOKEN, request, serving, signed_in

from agent.cli import main as cli
from agent.core.clock import SystemClock
from agent.core.sql import ServerUrl
from agent.leader.registry import DeviceRegistry
from agent.leader.rejects import RejectLog
from agent.protocol import Heartbeat
from config_rollout.layer_store import LayerStore


@pytest.fixture
def fleet_console(pg_url: str, tmp_path: Path) -> Iterator[tuple[str, int]]:
    clock = SystemClock()
    for leader, device in (("gw1", "pi-1"), ("gw2", "pi-2")):  # two leaders, each served one device
        with DeviceRegistry.open(pg_url, clock=clock) as registry:
            registry.leader = leader
            registry.mark_alive()
            registry.apply_heartbeats([Heartbeat(device_id=device, seq=1, uptime_s=1.0, firmware_version="1.0.0")])
    with RejectLog.open(pg_url, clock=clock) as rejects:
        rejects.record(topic="ea/v1/t/rogue/up", reason="not a heartbeat", payload=b"x", sender="rogue")
    with serving(ServerUrl(pg_url), outbox=None, artifacts=tmp_path / "artifacts") as address:
        yield address


def test_the_console_shows_the_whole_fleet_of_several_leaders(fleet_console: tuple[str, int], pg_url: str) -> None:
    status, _, body = request(fleet_console, "GET", "/", headers=BEARER)
    assert status == 200 and "pi-1" in body and "pi-2" in body
    leaders = body.split('id="fleet-leaders"')[1].split("</table>")[0]  # each leader, what it serves
    assert "<td>gw1</td><td class=\"online\">running</td>" in leaders and "<td>gw2</td>" in leaders, leaders
    status, _, body = request(fleet_console, "GET", "/devices/pi-2", headers=BEARER)
    assert status == 200 and "leader gw2" in body
    status, _, body = request(fleet_console, "GET", "/rejects", headers=BEARER)
    assert status == 200 and "not a heartbeat" in body
    status, _, body = request(fleet_console, "GET", "/rollouts", headers=BEARER)
    assert status == 200
    status, _, body = request(fleet_console, "GET", "/dead-letters", headers=BEARER)
    assert status == 200 and "each keeps its own outbox" in body
    status, _, body = request(fleet_console, "GET", "/config", headers=BEARER)
    assert status == 200 and "No layer values yet." in body
    csrf, cookie = body.split('name="csrf" value="')[1].split('"')[0], signed_in(fleet_console)
    form = urllib.parse.urlencode({"csrf": csrf, "action": "set", "target": "app", "scope": "tag", "selector": "lab",
                                   "document": "app.toml", "key": "mode", "value": '"x"'})
    status, _, _ = request(fleet_console, "POST", "/config", body=form,
                           headers={"Cookie": cookie, "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 303
    status, _, body = request(fleet_console, "GET", "/config", headers=BEARER)
    assert status == 200 and "<td>mode</td><td><code>&#34;x&#34;</code>" in body
    with LayerStore.open(pg_url) as layers:  # in the fleet's database, where every leader reads it
        assert [(r.selector, r.key, r.value) for r in layers.rows(now_ms=0)] == [("lab", "mode", '"x"')]


def test_a_fleet_database_without_an_artifact_store_is_one_line(pg_url: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    assert cli(["console", "--db", pg_url, "--token-file", str(token), "--listen", "127.0.0.1:8080"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--artifacts" in err[0] and "postgresql://" in err[0]
