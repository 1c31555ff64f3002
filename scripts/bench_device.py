"""The agent on a booted board: its Debian package on a Debian bookworm board under QEMU (systemd as
PID 1, no KVM), the host's mosquitto and leader reached through QEMU's user networking. Prints
one JSON line:

    arch, boot_s                 kernel start to the agent's READY (the guest's own clock)
    agent_rss_mb, agent_pss_mb   the agent's memory under systemd, idle, once READY
    agent_uss_mb, agent_cpu_percent   (USS and CPU over 20 s idle, read inside the guest)
    power_cuts                   {trials, acknowledged, lost}: QEMU killed with SIGKILL while an
                                 application sends through the local API, the leader away; then
                                 the leader comes and every acknowledged event must reach it
    watchdog_restart_s           a frozen agent (SIGSTOP) to systemd's watchdog starting it again
    rollout                      {state, seconds, bytes}: a new root file system (RAUC bundle in the
                                 fleet's artifact) from the leader to slot B through the root
                                 helper, a reboot, the boot loader's choice, health, commit: the
                                 device's end state, seconds from `rollout start` to the end,
                                 bytes the device downloaded
    bad_image                    {state, boots}: an image whose boot panics, into the other slot:
                                 the boot loader falls back and the device ends `rolled_back`;
                                 the slots the boot loader chose, boot by boot

    python scripts/bench_device.py [--trials 20] [--arch amd64|arm64]

--arch arm64 runs the same on an emulated arm64 board (QEMU's virt machine, Debian's U-Boot).
Needs root, mmdebstrap, qemu-system-x86 (arm64: qemu-system-arm, u-boot-qemu, u-boot-tools,
dosfstools, mtools, and qemu-user-static with binfmt for the base), mosquitto and rauc
(scripts/test.sh and scripts/board.sh install them); the board's base is cached in
/var/cache/edge-agent-bench (arm64's takes about 8 minutes to make, once).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.board_updates import (  # noqa: E402
    artifact,
    bad_image,
    device_files,
    free_port,
    heard_from,
    rauc_bundle,
    rauc_keys,
    rollout_end,
    start_rollout,
)
from tests.e2e.agent_support import db_query, kill, run_agent, wait_for, write_config  # noqa: E402
from tests.identity_broker import cli  # noqa: E402
from tests.mosquitto import Mosquitto  # noqa: E402
from tests.qemu_board import (  # noqa: E402
    HERE,
    HOST_FROM_GUEST,
    QemuBoard,
    build_board,
    build_deb,
    have_board_tools,
)

DEVICE = "board-1"
ACK = re.compile(r"ACK ([0-9a-f]{8}) (\d+)\r?$", re.MULTILINE)


def device_state(status: dict[str, Any]) -> str:
    """The board's own end state in a rollout's status (the rollout's when it lists no device)."""
    return str(status["device_list"][0]["state"]) if status["device_list"] else str(status["state"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="power cuts (default 20)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--arch", choices=("amd64", "arm64"), default="amd64", help="the board's (default amd64)")
    args = parser.parse_args()
    arch = args.arch
    why = have_board_tools(arch)
    if why:
        print(f"bench_device: {why}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        broker = Mosquitto(tmp / "mosquitto").start()
        try:
            keys = tmp / "keys"
            assert cli("firmware", "keygen", "--out", str(keys)).returncode == 0
            rauc_key, rauc_cert = rauc_keys(tmp)
            deb = build_deb(tmp / "debs", arch)
            conf, files = device_files(tmp, "1.0.0", broker.port, keys / "public.pem", heartbeat_s=None)
            images = build_board(deb, conf, tmp / "board", arch=arch, options=("--rauc-keyring", str(rauc_cert)), adds=(
                *files,
                (HERE / "board-sender", "/usr/local/sbin/board-sender:0755"),
                (HERE / "board-sender.service", "/etc/systemd/system/board-sender.service"),
                (HERE / "board-idle", "/usr/local/sbin/board-idle:0755"),
                (HERE / "board-idle.service", "/etc/systemd/system/board-idle.service"),
                (HERE / "board-watchdog", "/usr/local/sbin/board-watchdog:0755"),
                (HERE / "board-watchdog.service", "/etc/systemd/system/board-watchdog.service")))
            conf_2, files_2 = device_files(tmp, "2.0.0", broker.port, keys / "public.pem", heartbeat_s=None)
            v2 = build_board(deb, conf_2, tmp / "v2", adds=files_2, arch=arch,
                             options=("--version", "2.0.0", "--rauc-keyring", str(rauc_cert), "--slot-only"))
            art_2 = artifact(tmp, rauc_bundle(tmp, v2 / "rootfs.img", "2.0.0", rauc_cert, rauc_key), "2.0.0",
                             keys / "private.pem")
            art_3 = artifact(tmp, rauc_bundle(tmp, bad_image(tmp, v2, "3.0.0"), "3.0.0", rauc_cert, rauc_key),
                             "3.0.0", keys / "private.pem")
            first = QemuBoard(images, tmp / "boot-idle", arch).power_on()
            try:
                report = first.report()
                idle = first.wait_for("BOARD: idle_cpu_percent").split()[-1]
                watchdog = first.wait_for("BOARD: watchdog").split()
            finally:
                first.power_cut()
            ready_us = int(report["ready_monotonic_us"].split()[1])
            memory = dict(zip(*[iter(report["agent_pid"].split()[1:])] * 2, strict=True))  # rss_kb N pss_kb N ...
            acked: set[tuple[str, int]] = set()
            for trial in range(args.trials):
                board = QemuBoard(images, tmp / f"boot-{trial}", arch).power_on("board.sender")
                try:
                    board.report()
                    enough = 3 + rng.randrange(6)
                    wait_for(lambda b=board, n=enough: len(ACK.findall(b.text())) >= n, "acknowledged", 900)
                finally:
                    board.power_cut()
                acked |= {(boot, int(n)) for boot, n in ACK.findall(board.text())}
            leader_dir = tmp / "gw"
            db = leader_dir / "leader.db"
            port = free_port()
            leader = run_agent(write_config(
                tmp / "leader.toml", "leader", "gw", agent={"data_dir": str(leader_dir)},
                mqtt={"url": f"mqtt://127.0.0.1:{broker.port}"},
                artifacts={"listen": f"127.0.0.1:{port}", "url": f"http://{HOST_FROM_GUEST}:{port}"},
                firmware={"public_key": str(keys / "public.pem")}), tmp / "leader.log")
            last = QemuBoard(images, tmp / "after", arch).power_on()
            try:
                last.report()

                def arrived() -> set[tuple[str, int]]:
                    rows = db_query(leader_dir / "leader.db", "SELECT payload FROM app_messages WHERE device_id = ?"
                                                              " AND class = 'events'", (DEVICE,))
                    return {(e["boot"], int(e["n"])) for e in (json.loads(bytes(r[0])) for r in rows)}

                deadline = time.monotonic() + 900
                while not acked <= arrived() and time.monotonic() < deadline:
                    time.sleep(1)
                lost = len(acked - arrived())
                wait_for(lambda: heard_from(db), "the board's heartbeat", 900)
                began = time.monotonic()
                start_rollout(tmp, db, "v2", art_2)
                done = rollout_end(db, "v2")
                rollout = {"state": device_state(done), "seconds": round(time.monotonic() - began),
                           "bytes": done["waves"][0]["download"]["bytes_done"]}
                start_rollout(tmp, db, "v3", art_3)
                bad = rollout_end(db, "v3")
                bad_state = device_state(bad)
                slots = last.boots()
            finally:
                last.power_cut()
                kill(leader, signal.SIGTERM)
        finally:
            broker.stop()
    print(json.dumps({
        "arch": arch, "boot_s": round(ready_us / 1e6, 2),
        "agent_rss_mb": round(int(memory["rss_kb"]) / 1024, 1), "agent_pss_mb": round(int(memory["pss_kb"]) / 1024, 1),
        "agent_uss_mb": round(int(memory["uss_kb"]) / 1024, 1), "agent_cpu_percent": float(idle),
        "power_cuts": {"trials": args.trials, "acknowledged": len(acked), "lost": lost},
        "watchdog_restart_s": int(watchdog[watchdog.index("after_s") + 1]),
        "rollout": rollout, "bad_image": {"state": bad_state, "boots": "".join(slots)},
    }))
    return 0 if lost == 0 and rollout["state"] == "succeeded" and bad_state == "rolled_back" else 1


if __name__ == "__main__":
    sys.exit(main())
