"""Applications on a booted board: the agent's Debian package on a Debian bookworm board under QEMU
(systemd as PID 1, no KVM), the root application helper installing a service's bundles that the
host's leader rolls out. Prints one JSON line:

    bundle_bytes                 {R1, R2, R3}: each bundle's size (its data: --data-mb in 8 files)
    R1, R2                       {state, seconds, bytes_fetched, bytes_reused, fetch_s, install_s,
                                 health_s}: from `rollout start` to the device's `succeeded`, and
                                 the device's own steps as its report says: fetching the bundle
                                 from the leader's artifact server (R2 changes the server, replaces
                                 one data file of 8 and inserts 64 bytes into the middle of another:
                                 the 6 others are copied from the running version, and of the
                                 patched one the chunks the insertion did not touch),
                                 the helper's install and start, the health check (an HTTP URL
                                 answering 2xx, then settle_s)
    R3                           {state, seconds, health_s, rollback_s}: a version whose health URL
                                 answers 500: the health check's timeout (--timeout-s), then the
                                 helper's revert until the version before runs again
    agent_rss_mb                 the agent's resident memory while the application runs (as the
                                 application read it from /proc)
    baseline                     {fetch_bytes_full, fetch_bytes_whole_files}: what a device fetches
                                 of R2 with nothing reused (the whole bundle), and reusing only
                                 whole files (each file whose sha256 differs fetched whole)

    python scripts/bench_apps.py [--data-mb 4] [--timeout-s 30]

With --release, the same board on A/B slots (RAUC through the root install helper) and a config
target besides, taking three releases of its whole state (tests/board/test_board_release.py's):

    R1, R2                       {state, seconds, parts}: from `rollout start` to `succeeded`, and
                                 each part's time to its hold as the device says it (R1: firmware
                                 1.0.0 runs already; R2: firmware 2.0.0 booted on trial, then the
                                 config and web 2.0.0 on that boot). The application is the
                                 container application web (tests/oci_images.py), run by podman:
                                 an OCI image of busybox and 8 MiB that never change (its base
                                 layer) and a small layer of its own
    R2.fetched                   {firmware, app}: bytes the device downloaded of each part (of the
                                 app: the chunks of the image's changed layer and its manifest)
    R3                           {state, seconds, rollback_s}: web 3.0.0's container fails its
                                 health check on the trial boot of slot A: from the trial boot's
                                 convergence to the board running R2 again in every part (a reboot
                                 back into B)
    baseline                     {firmware_bytes_full, app_bytes_full}: the parts' whole files
    agent_rss_mb                 the agent's resident memory once the container runs (the board's
                                 board-rss@web.service, started with the application's unit)

    python scripts/bench_apps.py --release [--timeout-s 30]

Needs root, mmdebstrap, qemu-system-x86 and mosquitto (scripts/test.sh installs them); the board's
base is cached in /var/cache/edge-agent-bench.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app_rollout.bundle import peek_head, read_head  # noqa: E402
from tests.board_apps import apps_config, device_events, hello_bundle  # noqa: E402
from tests.board_updates import free_port, heard_from, rollout_end, start_rollout  # noqa: E402
from tests.e2e.agent_support import kill, run_agent, wait_for, write_config  # noqa: E402
from tests.identity_broker import cli  # noqa: E402
from tests.mosquitto import Mosquitto  # noqa: E402
from tests.qemu_board import HOST_FROM_GUEST, QemuBoard, build_board, build_deb, have_board_tools  # noqa: E402

FIGURES = re.compile(r"fetched (\d+) bytes, reused (\d+) in ([\d.]+) s; installed and started in ([\d.]+) s;"
                     r" health ([\d.]+) s(?:; taken back in ([\d.]+) s)?")


def steps(db: Path, rid: str, started: float) -> dict[str, Any]:
    """The rollout's end, and the device's steps as its last report says them."""
    done = rollout_end(db, rid)
    device = done["device_list"][0]
    figures: dict[str, Any] = {"state": device["state"], "seconds": round(time.time() - started, 1)}
    said = FIGURES.search(str(device.get("detail", "")))
    if said:
        figures.update(bytes_fetched=int(said.group(1)), bytes_reused=int(said.group(2)),
                       fetch_s=float(said.group(3)), install_s=float(said.group(4)), health_s=float(said.group(5)))
        if said.group(6):
            figures["rollback_s"] = float(said.group(6))
    return figures


HELD = re.compile(r"(firmware [\d.]+ booted on trial|[a-z]+:[A-Za-z0-9_.+-]+ held) after ([\d.]+) s")


def release_steps(db: Path, rid: str, started: float) -> dict[str, Any]:
    """A release rollout's end, and each part's time to its hold as the device's report says."""
    done = rollout_end(db, rid)
    device = done["device_list"][0]
    parts = {("firmware" if what.startswith("firmware") else what.removesuffix(" held")): float(s)
             for what, s in HELD.findall(str(device.get("detail", "")))}
    return {"state": device["state"], "seconds": round(time.time() - started, 1), "parts": parts,
            "detail": str(device.get("detail", ""))}


def bench_release(args: argparse.Namespace, tmp: Path, mosquitto: Mosquitto) -> dict[str, Any]:
    from tests.board_releases import release_board
    from tests.board_updates import rollout_status

    made = release_board(tmp, mosquitto.port, health_timeout_s=args.timeout_s)
    images, public, firmware, apps, releases = made.images, made.public, made.firmware, made.apps, made.releases
    port = free_port()
    db = tmp / "gw" / "leader.db"
    leader = run_agent(write_config(tmp / "leader.toml", "leader", "gw", agent={"data_dir": str(tmp / "gw")},
                                    mqtt={"url": f"mqtt://127.0.0.1:{mosquitto.port}"},
                                    firmware={"public_key": str(public)},
                                    artifacts={"listen": f"127.0.0.1:{port}",
                                               "url": f"http://{HOST_FROM_GUEST}:{port}"}), tmp / "leader.log")
    board = QemuBoard(images, tmp / "console").power_on()
    out: dict[str, Any] = {"arch": "amd64", "mode": "release"}
    try:
        board.report()
        wait_for(lambda: heard_from(db), "the board's heartbeat", limit_s=900)
        for name, document in releases.items():
            mark = board.mark()
            started = time.time()
            start_rollout(tmp, db, name.lower(), document, kind="release")
            out[name] = release_steps(db, name.lower(), started)
            board.wait_for("WEB: 2.0.0 up" if name == "R3" else f"WEB: {apps_of(name)} up", since=mark)
            line = board.wait_for("BOARD-RSS: agent_rss_kb=", since=mark)
            rss = re.search(r"agent_rss_kb=(\d+)", line)
            if rss:
                out["agent_rss_mb"] = round(int(rss.group(1)) / 1024, 1)
            if name == "R2":
                download = rollout_status(db, "r2")["waves"][0]["download"]
                fetched = re.search(r"fetched (\d+) bytes", out[name]["detail"])
                out[name]["fetched"] = {"firmware": int(download["bytes_done"]),
                                        "app": int(fetched.group(1)) if fetched else None}
            if name == "R3":
                events = [(at, state) for at, state, _ in device_events(db, "r3")]
                trial = next((at for at, state in events if state == "verifying"), None)
                end = events[-1][0] if events else None
                out[name]["rollback_s"] = round((end - trial) / 1000, 1) if trial and end else None
        out["baseline"] = {"firmware_bytes_full": firmware["2.0.0"].stat().st_size,
                           "app_bytes_full": apps["2.0.0"].stat().st_size}
    finally:
        board.power_cut()
        kill(leader, signal.SIGTERM)
    for name in ("R1", "R2", "R3"):
        out.get(name, {}).pop("detail", None)
    return out


def apps_of(release_name: str) -> str:
    return {"R1": "1.0.0", "R2": "2.0.0", "R3": "3.0.0"}[release_name]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-mb", type=float, default=4.0, help="each bundle's data file, MB")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="the unhealthy version's health timeout")
    parser.add_argument("--release", action="store_true",
                        help="releases of the board's whole state (firmware, config, an application) instead")
    args = parser.parse_args()
    why = have_board_tools()
    if why:
        print(json.dumps({"skipped": why}))
        return 0
    if args.release:
        with tempfile.TemporaryDirectory(prefix="bench-release-") as tmp_dir, \
                Mosquitto(Path(tmp_dir) / "mq") as mosquitto:
            print(json.dumps(bench_release(args, Path(tmp_dir), mosquitto)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-apps-") as tmp_dir, Mosquitto(Path(tmp_dir) / "mq") as mosquitto:
        tmp = Path(tmp_dir)
        keys = tmp / "keys"
        assert cli("firmware", "keygen", "--out", str(keys)).returncode == 0
        private = keys / "private.pem"
        images = build_board(build_deb(tmp / "debs"), apps_config(tmp / "agent.toml", mosquitto.port), tmp / "board",
                             adds=((keys / "public.pem", "/etc/edge-agent/fleet-public.pem:0644"),))
        port = free_port()
        db = tmp / "gw" / "leader.db"
        leader = run_agent(write_config(tmp / "leader.toml", "leader", "gw", agent={"data_dir": str(tmp / "gw")},
                                        mqtt={"url": f"mqtt://127.0.0.1:{mosquitto.port}"},
                                        firmware={"public_key": str(keys / "public.pem")},
                                        artifacts={"listen": f"127.0.0.1:{port}",
                                                   "url": f"http://{HOST_FROM_GUEST}:{port}"}), tmp / "leader.log")
        board = QemuBoard(images, tmp / "console").power_on()
        out: dict[str, Any] = {"arch": "amd64", "data_mb": args.data_mb}
        try:
            board.report()
            wait_for(lambda: heard_from(db), "the board's heartbeat", limit_s=900)
            each = int(args.data_mb * 1024 * 1024) // 8
            data = {f"part-{i}": os.urandom(each) for i in range(8)}
            patched = data["part-5"][:each // 2] + os.urandom(64) + data["part-5"][each // 2:]
            changed = {**data, "part-3": os.urandom(each), "part-5": patched}  # R2: two data files of 8 differ
            bundles = {"R1": hello_bundle(tmp, "1.0.0", private, healthy=True, data=data),
                       "R2": hello_bundle(tmp, "2.0.0", private, healthy=True, data=changed),
                       "R3": hello_bundle(tmp, "3.0.0", private, healthy=False, data=changed,
                                          timeout_s=args.timeout_s)}
            out["bundle_bytes"] = {name: path.stat().st_size for name, path in bundles.items()}
            for name, path in bundles.items():
                mark = board.mark()
                started = time.time()
                start_rollout(tmp, db, name.lower(), path, kind="app")
                out[name] = steps(db, name.lower(), started)
                line = board.wait_for("HELLO: 2.0.0 up" if name == "R3" else f"HELLO: {path.stem[6:]} up",
                                      since=mark)
                rss = re.search(r"agent_rss_kb=(\d+)", line)
                if rss:
                    out["agent_rss_mb"] = round(int(rss.group(1)) / 1024, 1)
            r1, r2 = (peek_head(read_head(bundles[name])) for name in ("R1", "R2"))
            held = {f.sha256 for f in r1.files}
            out["baseline"] = {"fetch_bytes_full": out["bundle_bytes"]["R2"],
                               "fetch_bytes_whole_files": sum(f.size for f in r2.files if f.sha256 not in held)}
        finally:
            board.power_cut()
            kill(leader, signal.SIGTERM)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
