"""The operators' audit trail (`edge-agent audit`, the console's Audit page): a rollout control, an
identity revocation, a layer set, unset and order, and a remote session, each with who did it,
merged in time order from the stores that own them, exported as JSON lines."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import pytest

from agent.cli import main as cli
from agent.console.server import Console, ConsoleConfig, ConsoleServer
from agent.core.clock import SystemClock
from agent.leader.identities import IdentityStore
from agent.leader.registry import DeviceRegistry
from agent.leader.session_log import SessionLog
from config_rollout.layer_store import LayerStore
from rollout_engine.store import RolloutStore

TOKEN = "0123456789abcdef0123456789abcdef"


def leader_db(tmp_path: Path) -> Path:
    db = tmp_path / "leader.db"
    clock = SystemClock()
    with DeviceRegistry.open(db, clock=clock):
        pass
    with RolloutStore.open(db, clock=clock) as rollouts:
        rollouts.add_control("cam-1", "pause", "", actor="alice (uid 1000) on the CLI at gw")
    now = int(time.time() * 1000) + 10
    with IdentityStore.open(db) as identities:
        identities.add_control("revoke", "pi-3", by="bob via the console from 10.0.0.5", now_ms=now + 1,
                               reason="stolen")
    with LayerStore.open(db) as layers:
        layers.set_value("app", "tag", "lab", "app.toml", "port", 3, set_by="carol", now_ms=now + 2)
        layers.order("app", ["lab"], by="carol", now_ms=now + 3)
        assert layers.unset("app", "tag", "lab", "app.toml", "port", by="carol", now_ms=now + 4)
    with SessionLog.open(db, clock=clock) as sessions:
        time.sleep(0.1)
        sessions.opened(sid="ab" * 16, leader="gw", device_id="pi-1", operator="dave", op="shell", target="uptime")
        sessions.ended("ab" * 16, state="closed", bytes_to_device=0, bytes_from_device=42, exit_code=0,
                       reason="the device closed it: ended")
    return db


def test_every_kind_of_action_with_its_actor_in_time_order_as_json_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = leader_db(tmp_path)
    assert cli(["audit", "--db", str(db), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["area"], e["action"], e["actor"].split()[0]) for e in lines] == [
        ("rollout", "pause", "alice"), ("identity", "revoke", "bob"), ("layers", "set", "carol"),
        ("layers", "order", "carol"), ("layers", "unset", "carol"), ("session", "shell", "dave")]
    assert [e["at_ms"] for e in lines] == sorted(e["at_ms"] for e in lines)
    assert lines[1]["subject"] == "pi-3" and lines[1]["outcome"] == "not applied yet"
    assert lines[2]["subject"] == "app tag lab app.toml port" and lines[2]["detail"] == "3"
    assert "uptime (0 bytes to the device, 42 from it, exit 0)" in lines[5]["detail"]
    assert lines[5]["outcome"].startswith("closed")
    assert cli(["audit", "--db", str(db), "--since", "soon"]) == 2
    assert "'soon' is not a duration" in capsys.readouterr().err


def test_the_console_shows_the_newest_first(tmp_path: Path) -> None:
    db = leader_db(tmp_path)
    console = ConsoleServer(("127.0.0.1", 0), Console(ConsoleConfig(db=db, token=TOKEN, outbox=tmp_path / "o.db")))
    console.serve_in_thread()
    try:
        conn = http.client.HTTPConnection(*console.server_address[:2], timeout=30)
        try:
            conn.request("GET", "/audit", headers={"Authorization": f"Bearer {TOKEN}"})
            response = conn.getresponse()
            page = response.read().decode()
        finally:
            conn.close()
    finally:
        console.shutdown()
        console.server_close()
    assert response.status == 200
    assert page.index("dave") < page.index("carol") < page.index("bob via the console") < page.index("alice")
