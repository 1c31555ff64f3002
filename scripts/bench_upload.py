"""Upload benchmark: an artifact uploaded in the console against the same artifact admitted from
disk (what `rollout start` does), in the same run.

    python scripts/bench_upload.py [--mib N] [--runs R]

The console (`edge-agent console`, the product's HTTP layer) runs in its own process on
loopback with the fleet's public key; a client PUTs an N MiB signed artifact to
`/artifacts/upload` (Bearer token) R times. Each upload is written to disk as it arrives, checked
as the leader checks an artifact at admission (signature, manifest, every chunk, the image hash)
and kept. The baseline is `ArtifactStore.admit` on the same file in this process: the copy and
the check alone, no network. Reported: MiB/s of each (median), the ratio, and the console
process's peak resident memory (it must not grow with the artifact: the body never sits in
memory).

The last line is JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKEN = "bench-upload-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the console ended: exit {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the console did not listen within 60 s")


def _upload(port: int, artifact: Path) -> float:
    size = artifact.stat().st_size
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    began = time.perf_counter()
    with artifact.open("rb") as body:
        conn.request("PUT", "/artifacts/upload?name=bench.eafw", body=body,
                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Length": str(size)})
        response = conn.getresponse()
        said = response.read().decode()
    took = time.perf_counter() - began
    conn.close()
    if response.status != 201:
        raise SystemExit(f"upload refused: {response.status} {said}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128)  # (the fixture makes at most 255 MiB)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from agent.core.clock import VirtualClock
    from agent.leader.registry import DeviceRegistry
    from firmware_rollout.artifact.fixture import make_artifact
    from firmware_rollout.orchestration.artifacts import ArtifactStore
    from rollout_engine.keys import load_verify_key

    with tempfile.TemporaryDirectory(prefix="bench-upload-") as tmp:
        work = Path(tmp)
        artifact, public = make_artifact(work, size=args.mib * 1024 * 1024, chunk_size=1024 * 1024)
        size_mib = artifact.stat().st_size / 2**20
        db = work / "gw" / "leader.db"
        db.parent.mkdir()
        DeviceRegistry.open(db, clock=VirtualClock()).close()
        token = work / "console.token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)

        baseline = []
        for n in range(args.runs):
            store = ArtifactStore(work / f"admit-{n}", load_verify_key(public))
            began = time.perf_counter()
            store.admit(artifact)
            baseline.append(time.perf_counter() - began)

        port = _free_port()
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "console", "--db", str(db), "--token-file",
                                 str(token), "--listen", f"127.0.0.1:{port}", "--public-key", str(public)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_listening(port, proc)
            console = psutil.Process(proc.pid)
            rss_idle = console.memory_info().rss
            uploads = []
            peak = rss_idle
            for _ in range(args.runs):
                uploads.append(_upload(port, artifact))
                peak = max(peak, console.memory_info().rss)
            with open(f"/proc/{proc.pid}/status") as status:  # the kernel's high-water mark
                hwm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
        finally:
            proc.terminate()
            proc.wait(30)

    upload_rate = size_mib / statistics.median(uploads)
    admit_rate = size_mib / statistics.median(baseline)
    result = {
        "artifact_mib": round(size_mib, 1),
        "runs": args.runs,
        "console_upload_mib_s": round(upload_rate, 1),
        "baseline_admit_from_disk_mib_s": round(admit_rate, 1),
        "ratio": round(upload_rate / admit_rate, 2),
        "console_rss_idle_mib": round(rss_idle / 2**20, 1),
        "console_rss_peak_mib": round(max(peak, hwm) / 2**20, 1),
    }
    print(f"upload {size_mib:.0f} MiB: {upload_rate:.1f} MiB/s through the console, "
          f"{admit_rate:.1f} MiB/s admitted from disk; console RSS {result['console_rss_idle_mib']} MiB idle, "
          f"{result['console_rss_peak_mib']} MiB at most")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
