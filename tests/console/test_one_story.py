"""One device, one story: a configuration target whose newest release was reverted on the device
reads the same in `status`, `config diff`, `/metrics` and the console's pages. It holds the
version it went back to, unchanged: in sync with what it holds, its last attempt "rolled back"
beside, and counted once (not failed in one place, rolled back in another, in sync in a third)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_console_http import BEARER, request, serving

from agent.core.clock import VirtualClock
from agent.protocol import ConfigState, Heartbeat

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout


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
    try:
        gw.registry.apply_heartbeats([
            Heartbeat(device_id="pi-1", seq=1, uptime_s=1.0,
                      configs={"app": ConfigState(version="1.1.0", state="committed")}),
            # its apply of 1.1.0 reverted: it holds 1.0.0 as it was
            Heartbeat(device_id="pi-2", seq=1, uptime_s=1.0,
                      configs={"app": ConfigState(version="1.0.0", state="rolled_back")}),
        ])
        metrics = parse(render(gw.collectors()["config"]()))  # type: ignore[arg-type]
    finally:
        await gw.stop()

    # /metrics: each device once by what it holds, the attempt beside
    held = {labels["compliance"]: v for labels, v in metrics["ea_config_devices"]["samples"]}
    assert held["in_sync"] == 2.0 and sum(held.values()) == 2.0
    assert metrics["ea_config_last_attempt_failed"]["samples"] == [({"target": "app"}, 1.0)]

    # status: the fleet's line and the device's
    fleet = cli("status", "--db", str(db))
    assert "config app: 2 in sync; the last attempt did not commit on 1" in fleet, fleet
    device = cli("status", "--db", str(db), "--device", "pi-2")
    assert "app: holds 1.0.0; in sync (its last attempt was rolled back)" in device, device

    # config diff against the release it holds: in sync, the attempt beside
    keys = generate_keypair(tmp_path / "keys")
    (tmp_path / "app.toml").write_text("port = 1\n")
    release = tmp_path / "app-1.0.0.eacfg"
    release.write_bytes(build_release("app", "1.0.0", [tmp_path / "app.toml"], load_signing_key(keys.private),
                                      created_ms=1))
    diff = cli("config", "diff", "--device", "pi-2", "--db", str(db), "--key", str(keys.public),
               "--target", "app", "--release", str(release))
    assert re.search(r"holds 1\.0\.0, layers [^:]+: in sync \(its last attempt was rolled back\)", diff), diff

    # the console: the fleet's table and the device's page say the same
    with serving(db) as address:
        _, _, page = request(address, "GET", "/", headers=BEARER)
        row = re.search(r"<tr><td>app</td>(.*?)</tr>", page, re.S)
        assert row is not None
        cells = re.findall(r"<td[^>]*>([^<]*)</td>", row.group(1))
        assert cells == ["2", "0", "0", "0", "0", "1"], cells  # in sync, pending, drifted, damaged, not applied, last
        _, _, page = request(address, "GET", "/devices/pi-2", headers=BEARER)
        row = re.search(r"<tr><td>app</td>(.*?)</tr>", page, re.S)
        assert row is not None
        cells = [c.strip() for c in re.findall(r"<td[^>]*>([^<]*)</td>", row.group(1))]
        assert cells == ["1.0.0", "in sync", "rolled back"], cells
