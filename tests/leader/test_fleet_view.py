"""`edge-agent status` device by device and `edge-agent rejects`, read-only from a leader's
database: filters, pages, one device in full, the refusals with their first bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from rollout_support import spec_data

from agent.cli import main as cli
from agent.core.clock import SystemClock
from agent.leader.fleet_view import DeviceFilter, device_detail, list_devices
from agent.leader.readonly import open_leader_db
from agent.leader.registry import DeviceRegistry
from agent.leader.rejects import RejectLog
from agent.protocol import Heartbeat, SystemSample
from rollout_engine.spec import spec_from_dict
from rollout_engine.store import RolloutStore


@pytest.fixture
def leader_db(tmp_path: Path) -> Path:
    """Six devices: pi-00..pi-04 on 1.0.0 (pi-03 and pi-04 offline, pi-00 and pi-01 tagged lab),
    pi-05 on 2.0.0 and in rollout r1; three refusals from rogue, one from pi-03."""
    clock = SystemClock()
    path = tmp_path / "leader.db"
    with DeviceRegistry.open(path, clock=clock, heartbeat_deadline_s=60) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=f"pi-0{n}", seq=1, uptime_s=10.0, firmware_version="1.0.0",
                                        tags=("lab", "north") if n < 2 else ("field",), boot="b0",
                                        sample=SystemSample(cpu_percent=12.0, mem_percent=40.0))
                              for n in range(5)])
        reg.apply_heartbeat(Heartbeat(device_id="pi-05", seq=9, uptime_s=1.0, firmware_version="2.0.0",
                                      outbox_pending=12))
        reg.apply_presence("pi-03", False)
        reg.apply_presence("pi-04", False)
    with RejectLog.open(path, clock=clock) as rejects:
        for n in range(3):
            rejects.record(topic="ea/v1/t/rogue/up", reason="seq out of range", payload=b"\x81\xa3seq" + bytes([n]),
                           sender="rogue", msg_id=f"e{n}", kind="heartbeat")
        rejects.record(topic="ea/v1/t/pi-03/up", reason="unknown kind", payload=b"hello", sender="pi-03")
    artifact = tmp_path / "fw.bin"
    artifact.write_bytes(b"x")
    with RolloutStore.open(path, clock=clock) as store:
        store.create_rollout("r1", spec=spec_from_dict(spec_data(artifact)), artifact=str(artifact), version="2.0.0",
                             signed_manifest=b"m", waves=[["pi-05"]], from_versions={"pi-05": "1.0.0"})
    return path


def _ids(db_path: Path, **conditions: object) -> list[str]:
    with open_leader_db(db_path) as db:
        return [d.device_id for d in list_devices(db, DeviceFilter(**conditions)).devices]  # type: ignore[arg-type]


def test_filters_find_the_devices_an_operator_asks_for(leader_db: Path) -> None:
    assert _ids(leader_db, online=False) == ["pi-03", "pi-04"]
    assert _ids(leader_db, version="2.0.0") == ["pi-05"]
    assert _ids(leader_db, tag="lab") == ["pi-00", "pi-01"]
    assert _ids(leader_db, tag="lab", online=False) == []
    assert _ids(leader_db, rollout="r1") == ["pi-05"]
    assert _ids(leader_db, rollout="nope") == []
    assert _ids(leader_db, limit=2, offset=3) == ["pi-03", "pi-04"]
    with open_leader_db(leader_db) as db:
        page = list_devices(db, DeviceFilter(limit=0))
    assert page.matching == 6 and len(page.devices) == 6
    assert (page.devices[5].rollout_id, page.devices[5].rollout_state) == ("r1", "queued")
    assert page.devices[3].offline_reason == "presence" and page.devices[0].tags == ["lab", "north"]


def test_one_device_in_full(leader_db: Path) -> None:
    with open_leader_db(leader_db) as db:
        detail = device_detail(db, "pi-03")
        assert device_detail(db, "pi-99") is None
    assert detail is not None
    assert (detail.heartbeat_seq, detail.boot, detail.device.online) == (1, "b0", False)
    assert detail.sample is not None and detail.sample.cpu_percent == 12.0
    assert [r.reason for r in detail.rejects] == ["unknown kind"]
    assert detail.outbox_pending is None  # pi-03's heartbeat did not report it


def test_the_status_command_lists_pages_and_says_how_to_go_on(leader_db: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["status", "--db", str(leader_db), "--offline"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("DEVICE"):].splitlines()
    assert table[0].split() == ["DEVICE", "STATE", "LAST", "SEEN", "VERSION", "TAGS", "ROLLOUT"]
    assert table[1].split()[:4] == ["pi-03", "offline", "(presence)", "0s"] and table[-1] == "2 devices"
    assert cli(["status", "--db", str(leader_db), "--limit", "2"]) == 0
    assert "devices 1-2 of 6 matching (--offset 2 for the next page, --limit 0 for all)" in capsys.readouterr().out
    assert cli(["status", "--db", str(leader_db), "--json", "--tag", "field"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total"] == 6 and data["devices_matching"] == 3
    assert [(d["device_id"], d["online"]) for d in data["devices"]] == [("pi-02", True), ("pi-03", False),
                                                                      ("pi-04", False)]
    assert cli(["status", "--db", str(leader_db), "--device", "pi-05"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device pi-05: online") and "r1 " in out and "wave 1, queued" in out
    assert "outbox: 12 pending" in out
    assert cli(["status", "--db", str(leader_db), "--device", "pi-99"]) == 1
    assert "no device 'pi-99'" in capsys.readouterr().err


def test_read_commands_leave_the_database_as_it_was(leader_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = hashlib.sha256(leader_db.read_bytes()).hexdigest()
    mtime = leader_db.stat().st_mtime_ns
    for argv in (["status", "--db", str(leader_db)], ["status", "--db", str(leader_db), "--device", "pi-00"],
                 ["rejects", "list", "--db", str(leader_db)], ["rejects", "show", "--db", str(leader_db), "1"]):
        assert cli(argv) == 0
    capsys.readouterr()
    assert hashlib.sha256(leader_db.read_bytes()).hexdigest() == before and leader_db.stat().st_mtime_ns == mtime


def test_rejects_are_counted_by_sender_and_reason_and_shown_with_their_bytes(
        leader_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["rejects", "list", "--db", str(leader_db)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 rejects kept, by sender and reason:")
    assert out.splitlines()[2].split()[:2] == ["rogue", "3"]
    assert cli(["rejects", "list", "--db", str(leader_db), "--device", "pi-03", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(c["sender"], c["count"]) for c in data["counts"]] == [("pi-03", 1)]
    assert [r["reason"] for r in data["rows"]] == ["unknown kind"]
    assert cli(["rejects", "show", "--db", str(leader_db), "1"]) == 0
    out = capsys.readouterr().out
    assert "reason  seq out of range" in out and "0000  81 a3 73 65 71 00" in out and "..seq." in out
    assert cli(["rejects", "show", "--db", str(leader_db), "99"]) == 1
    assert cli(["rejects", "list", "--db", str(leader_db.parent / "missing.db")]) == 2
    assert "missing.db: no such file" in capsys.readouterr().err


def test_a_thousand_devices_one_offline_is_found_in_one_command(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "leader.db"
    with DeviceRegistry.open(path, clock=SystemClock()) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=f"pi-{n:04d}", seq=1, uptime_s=1.0) for n in range(1000)])
        reg.apply_presence("pi-0420", False)
    assert cli(["status", "--db", str(path), "--offline"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("fleet: 1000 devices, 999 online, 1 offline")
    assert [line.split()[0] for line in out[out.index("DEVICE"):].splitlines()[1:-1]] == ["pi-0420"]


def test_a_listing_piped_into_head_ends_quietly(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "leader.db"
    with DeviceRegistry.open(path, clock=SystemClock()) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=f"pi-{n:05d}", seq=1, uptime_s=1.0) for n in range(20_000)])
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen([sys.executable, "-m", "agent.cli", "status", "--db", str(path), "--limit", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(repo),
                             env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert child.stdout is not None and child.stderr is not None
    assert child.stdout.readline().startswith(b"fleet: 20000 devices")
    child.stdout.close()  # as `head -1` does
    err = child.stderr.read()
    child.stderr.close()
    assert child.wait(60) == 0 and b"Traceback" not in err and err == b""
