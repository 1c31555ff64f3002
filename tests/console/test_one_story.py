"""One device, one story: a configuration target whose newest release was reverted on the device
reads the same in `status`, `config diff`, `/metrics` and the console's pages. It holds the
version it went back to, unchanged: in sync with what it holds, its last attempt "rolled back"
beside, and counted once (not failed in one place, rolled back in another, in sync in a third)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from test_console_http import BEARER, request, serving

from agent.core.clock import VirtualClock
from agent.protocol import ConfigState, Heartbeat

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout


def cells(page: str, table: str, first: str) -> list[str]:
    """The cells after `first` in the row of `table` that starts with it, as text (a button's form
    left out)."""
    found = re.search(rf'<table id="{table}".*?<tr><td>{re.escape(first)}</td>(.*?)</tr>', page, re.S)
    assert found is not None, page
    row = re.sub(r"<form.*?</form>", "", found.group(1), flags=re.S)
    return [c.strip() for c in re.findall(r"<td[^>]*>([^<]*)</td>", row)]


async def test_a_reverted_device_reads_the_same_in_status_config_diff_metrics_and_the_console(
        tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "tests" / "service"))
    from e2e.agent_support import leader
    from promparse import parse

    from agent.service.prom import render
    from config_rollout.release import build_release
    from rollout_engine.keys import generate_keypair, load_signing_key

    clock = VirtualClock()
    gw = await leader(clock, tmp_path)
    db = Path(gw.registry.path)
    keys = generate_keypair(tmp_path / "keys")
    (tmp_path / "app.toml").write_text("port = 1\n")
    release = tmp_path / "app-1.0.0.eacfg"
    release.write_bytes(build_release("app", "1.0.0", [tmp_path / "app.toml"], load_signing_key(keys.private),
                                      created_ms=1))

    def metrics() -> dict[str, Any]:
        return parse(render(gw.collectors()["config"]()))  # type: ignore[no-any-return, arg-type]

    def diff() -> str:
        return cli("config", "diff", "--device", "pi-2", "--db", str(db), "--key", str(keys.public),
                   "--target", "app", "--release", str(release))

    try:
        gw.registry.apply_heartbeats([
            Heartbeat(device_id="pi-1", seq=1, uptime_s=1.0,
                      configs={"app": ConfigState(version="1.1.0", state="committed", attempt=1)}),
            # its apply of 1.1.0 (its second attempt) reverted: it holds 1.0.0 as it was
            Heartbeat(device_id="pi-2", seq=1, uptime_s=1.0,
                      configs={"app": ConfigState(version="1.0.0", state="rolled_back", attempt=2)}),
        ])

        # /metrics: each device once by what it holds, the attempt beside
        found = metrics()
        held = {labels["compliance"]: v for labels, v in found["ea_config_devices"]["samples"]}
        assert held["in_sync"] == 2.0 and sum(held.values()) == 2.0
        assert found["ea_config_last_attempt_failed"]["samples"] == [({"target": "app"}, 1.0)]

        # status: the fleet's line and the device's
        fleet = cli("status", "--db", str(db))
        assert "config app: 2 in sync; the last attempt did not commit on 1" in fleet, fleet
        device = cli("status", "--db", str(db), "--device", "pi-2")
        assert "app: holds 1.0.0; in sync (its last attempt was rolled back)" in device, device

        # config diff against the release it holds: in sync, the attempt beside
        assert re.search(r"holds 1\.0\.0, layers [^:]+: in sync \(its last attempt was rolled back\)", diff()), diff()

        # the console: the fleet's table and the device's page say the same, each with its button
        with serving(db) as address:
            _, _, page = request(address, "GET", "/", headers=BEARER)
            # in sync, pending, drifted, damaged, not applied, last attempt
            assert cells(page, "fleet-config", "app") == ["2", "0", "0", "0", "0", "1"]
            assert 'action="/config/acknowledge"' in page
            _, _, page = request(address, "GET", "/devices/pi-2", headers=BEARER)
            assert cells(page, "configs", "app") == ["1.0.0", "in sync", "rolled back"]
            assert 'name="device" value="pi-2"' in page

        # an operator acknowledges it: every view stops counting it, and says who saw it
        said = cli("config", "acknowledge", "app", "--device", "pi-2", "--db", str(db))
        assert "pi-2 · app: attempt 2 (rolled back, holds 1.0.0) acknowledged" in said, said
        assert metrics()["ea_config_last_attempt_failed"]["samples"] == [({"target": "app"}, 0.0)]
        fleet = cli("status", "--db", str(db))
        assert "config app: 2 in sync\n" in fleet + "\n" and "did not commit" not in fleet, fleet
        device = cli("status", "--db", str(db), "--device", "pi-2")
        assert re.search(r"app: holds 1\.0\.0; in sync \(its last attempt was rolled back; acknowledged by \S+",
                         device), device
        assert re.search(r"in sync \(its last attempt was rolled back; acknowledged by ", diff()), diff()
        with serving(db) as address:
            _, _, page = request(address, "GET", "/", headers=BEARER)
            assert cells(page, "fleet-config", "app") == ["2", "0", "0", "0", "0", "0"]
            assert 'action="/config/acknowledge"' not in page
            _, _, page = request(address, "GET", "/devices/pi-2", headers=BEARER)
            [cell] = cells(page, "configs", "app")[2:]
            assert cell.startswith("rolled back, acknowledged by ") and 'value="pi-2"' not in page, cell

        # its next attempt fails too: counted again without anyone clearing anything, and the
        # console's button acknowledges every open attempt of the target
        gw.registry.apply_heartbeats([
            Heartbeat(device_id="pi-2", seq=2, uptime_s=2.0,
                      configs={"app": ConfigState(version="1.0.0", state="rolled_back", attempt=3)}),
            Heartbeat(device_id="pi-1", seq=2, uptime_s=2.0,
                      configs={"app": ConfigState(version="1.1.0", state="failed", attempt=2)})])
        assert metrics()["ea_config_last_attempt_failed"]["samples"] == [({"target": "app"}, 2.0)]
        with serving(db) as address:
            status, headers, _ = request(address, "POST", "/config/acknowledge", body="target=app",
                                         headers={**BEARER, "Content-Type": "application/x-www-form-urlencoded"})
            assert (status, headers["Location"]) == (303, "/?acknowledged=2")
            status, _, body = request(address, "POST", "/config/acknowledge", body="target=app&device=pi-2",
                                      headers={**BEARER, "Content-Type": "application/x-www-form-urlencoded"})
            assert status == 409 and "pi-2: no attempt at target app to acknowledge" in body
        assert metrics()["ea_config_last_attempt_failed"]["samples"] == [({"target": "app"}, 0.0)]
        refused = subprocess.run([sys.executable, "-m", "agent.cli", "config", "acknowledge", "app", "--device", "pi-9",
                                  "--db", str(db)], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert "--device" in refused.stderr and "pi-9: no attempt at target app to acknowledge" in refused.stderr
        assert "no attempt to acknowledge" in cli("config", "acknowledge", "app", "--all", "--db", str(db))
        trail = cli("audit", "--db", str(db), "--json")
        acks = [json.loads(line) for line in trail.splitlines() if '"acknowledge"' in line]
        assert sorted((a["subject"], a["detail"], a["outcome"]) for a in acks) == [
            ("pi-1 app", "attempt 2, holding 1.1.0", "failed"), ("pi-2 app", "attempt 2, holding 1.0.0", "rolled_back"),
            ("pi-2 app", "attempt 3, holding 1.0.0", "rolled_back")], acks
    finally:
        await gw.stop()
