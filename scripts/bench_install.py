"""Install benchmark: what the updater's streamed install into a slot costs against writing the
same image into the same slot raw, in the same run.

    python scripts/bench_install.py [--quick] [--mb N] [--chunk-kib K]

A signed artifact of N MB of random bytes (chunks of K KiB) and a file-backed U-Boot board (a
libubootenv environment file, two slot files, a kernel command line; Debian's fw_setenv):

* raw: each chunk `pwrite` into the slot file and fsynced, nothing checked: the floor a flash
  write with a durable resume point per chunk costs;
* install: the real `Updater` with the `UBootInstaller`, chunks from the artifact file: each
  chunk's sha256 checked by the updater and again by the installer, written and fsynced, the
  progress row committed in SQLite, the whole image read back and checked, the trial armed in
  the U-Boot environment.

Both are reported as MB/s of image and CPU seconds per GB; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.core.clock import SystemClock  # noqa: E402
from firmware_rollout.artifact.files import build_artifact, read_image_chunk, read_signed_manifest  # noqa: E402
from firmware_rollout.device.health import HealthResult  # noqa: E402
from firmware_rollout.device.sources import ArtifactChunkSource  # noqa: E402
from firmware_rollout.device.uboot import UBootInstaller  # noqa: E402
from firmware_rollout.device.updater import Updater  # noqa: E402
from firmware_rollout.messages import UpdateOffer  # noqa: E402
from rollout_engine.keys import generate_keypair, load_signing_key, load_verify_key  # noqa: E402


def log(message: str) -> None:
    print(f"[bench_install] {message}", file=sys.stderr, flush=True)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Healthy:
    async def check(self, clock: object, timeout_s: float) -> HealthResult:
        return HealthResult(True, "bench")


class NoReboot:
    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        return None


def board(work: Path, slot_bytes: int) -> dict[str, Path]:
    env = work / "uboot.env"
    env.write_bytes(bytes(16 * 1024))
    config = work / "fw_env.config"
    config.write_text(f"{env} 0x0000 0x4000\n")
    defaults = work / "defaults"
    defaults.write_text("BOOT_ORDER=A B\nBOOT_A_LEFT=3\nBOOT_B_LEFT=3\n")
    subprocess.run(["fw_setenv", "-c", str(config), "-f", str(defaults), "BOOT_ORDER", "A B"], check=True,
                   capture_output=True)
    slots = {s: work / f"slot-{s.lower()}.img" for s in "AB"}
    for path in slots.values():
        with path.open("wb") as f:
            f.truncate(slot_bytes)
    cmdline = work / "cmdline"
    cmdline.write_text("rauc.slot=A\n")
    return {"config": config, "A": slots["A"], "B": slots["B"], "cmdline": cmdline}


def raw(artifact: Path, slot: Path) -> tuple[float, float]:
    signed = read_signed_manifest(artifact)
    m = signed.manifest
    t0, c0 = time.perf_counter(), cpu_s()
    fd = os.open(slot, os.O_WRONLY)
    try:
        for i in range(m.chunk_count):
            os.pwrite(fd, read_image_chunk(artifact, signed, i), i * m.chunk_size)
            os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0, cpu_s() - c0


async def install(artifact: Path, b: dict[str, Path], state: Path, public: Path) -> tuple[float, float, str]:
    key = load_verify_key(public)
    clock = SystemClock()
    installer = UBootInstaller(fw_env_config=b["config"], slot_a=b["A"], slot_b=b["B"], cmdline_path=b["cmdline"],
                               clock=clock, verify_key=key)
    updater = await Updater.open(state, device_id="bench", verify_key=key, clock=clock, health=Healthy(),
                                 rebooter=NoReboot(), installer=installer, initial_version="1.0.0")
    source = ArtifactChunkSource(artifact, clock=clock)
    t0, c0 = time.perf_counter(), cpu_s()
    report = await updater.offer(UpdateOffer(rollout_id="bench", signed_manifest=source.signed_manifest), source)
    elapsed, cpu = time.perf_counter() - t0, cpu_s() - c0
    await updater.close()
    return elapsed, cpu, report.state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 32 MB image (default 256 MB)")
    parser.add_argument("--mb", type=int, default=None, help="image size in MB")
    parser.add_argument("--chunk-kib", type=int, default=128, help="chunk size (default 128, the default)")
    args = parser.parse_args()
    mb = args.mb or (32 if args.quick else 256)
    with tempfile.TemporaryDirectory(prefix="bench-install-") as tmp:
        work = Path(tmp)
        keys = generate_keypair(work / "keys")
        image = work / "image.bin"
        with image.open("wb") as f:
            for _ in range(mb):
                f.write(os.urandom(1024 * 1024))
        artifact = work / "fw.eafw"
        build_artifact(image, artifact, name="bench", version="1.1.0", key=load_signing_key(keys.private),
                       created_ts=0, chunk_size=args.chunk_kib * 1024)
        b = board(work, mb * 1024 * 1024)
        log(f"{mb} MB image in {args.chunk_kib} KiB chunks: raw writes into slot A")
        raw_s, raw_cpu = raw(artifact, b["A"])
        log("the updater's streamed install into slot B")
        inst_s, inst_cpu, state = asyncio.run(install(artifact, b, work / "state", keys.public))
        gb = mb / 1024
        result = {
            "image_mb": mb, "chunk_kib": args.chunk_kib, "install_state": state,
            "raw_mb_per_s": round(mb / raw_s, 1), "install_mb_per_s": round(mb / inst_s, 1),
            "install_vs_raw": round(raw_s / inst_s, 3),
            "raw_cpu_s_per_gb": round(raw_cpu / gb, 2), "install_cpu_s_per_gb": round(inst_cpu / gb, 2),
        }
    print(json.dumps(result))
    return 0 if state == "rebooting" else 1


if __name__ == "__main__":
    raise SystemExit(main())
