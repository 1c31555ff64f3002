"""Fairness benchmark: what one flooding client leaves the others, and what the minimum rate costs.

    python scripts/bench_fairness.py [--quick] [--gb G] [--flood N] [--attempts N]

An `ArtifactServer` (the product's HTTP layer) in its own process, on loopback, serving a 256 MiB
file, twice in the same run: as shipped (connections bounded per address, downloads per address,
a minimum rate of 64 kbit/s sent in 64 KiB pieces) and as the baseline, with those three off
(one address may take every slot; a body goes out in one `sendfile`).

1. Flood: one address (127.0.0.1) opens N connections that each start a request head and stall,
   and 2 x max_downloads downloads it never reads; then another address (127.0.0.2) makes
   `--attempts` range requests, one at a time, each on a new connection: how many are answered
   206 at the first attempt, and their latency.
2. Cost: a client reads G GiB in 8 MiB ranges (what a device's run of chunks is at most); the
   server process's CPU seconds per GiB (user + system, from /proc through psutil).

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RANGE = 8 * 1024 * 1024
SIZE = 256 * 1024 * 1024
SHA = "ab" * 32
MAX_DOWNLOADS = 32

SERVER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from firmware_rollout.orchestration.artifact_server import ArtifactServer

    async def main() -> None:
        blob, port, shipped = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "shipped"
        server = ArtifactServer(lambda sha: blob, host="0.0.0.0", port=port, max_downloads={max_downloads},
                                max_downloads_per_peer=0 if shipped else {max_downloads},
                                min_rate_bps=8000 if shipped else 0)
        if not shipped:  # the baseline: one address may take every connection
            server._http.limits = type(server._http.limits)(**{{**server._http.limits.__dict__,
                                                                 "max_per_peer": server.max_connections}})
        await server.start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""").format(max_downloads=MAX_DOWNLOADS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(path: str, start: int, end: int) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\nRange: bytes={start}-{end}\r\nConnection: close\r\n\r\n").encode()


def status_line(sock: socket.socket) -> int:
    line = sock.makefile("rb").readline()
    return int(line.split(b" ", 2)[1]) if line.startswith(b"HTTP/1.1 ") else 0


def flood_and_measure(port: int, flood: int, attempts: int) -> dict[str, object]:
    path = f"/artifacts/{SHA}.eafw"
    held: list[socket.socket] = []
    try:
        for _ in range(2 * MAX_DOWNLOADS):  # downloads that are never read
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            held.append(sock)
        for _ in range(flood):  # request heads that stall
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            except OSError:
                continue
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            held.append(sock)
        time.sleep(0.5)  # let the server take them all before the other device asks
        answered, latencies = 0, []
        for i in range(attempts):
            began = time.perf_counter()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=30,
                                              source_address=("127.0.0.2", 0)) as sock:
                    sock.sendall(request(path, i * 100, i * 100 + 99))
                    ok = status_line(sock) == 206
            except OSError:
                ok = False
            latencies.append(time.perf_counter() - began)
            answered += ok
        return {"first_attempt_206": answered, "attempts": attempts,
                "p50_ms": round(statistics.median(latencies) * 1000, 2),
                "max_ms": round(max(latencies) * 1000, 2)}
    finally:
        for sock in held:
            sock.close()


def cpu_per_gib(port: int, server: psutil.Process, gib: float) -> float:
    path = f"/artifacts/{SHA}.eafw"
    total = int(gib * 1024 ** 3)
    before = server.cpu_times()
    done, offset = 0, 0
    buf = bytearray(1024 * 1024)
    while done < total:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(request(path, offset, offset + RANGE - 1))
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(4096)
            got = len(head.partition(b"\r\n\r\n")[2])
            while got < RANGE:
                n = sock.recv_into(buf)
                if not n:
                    raise SystemExit("the server closed a range early")
                got += n
        done += RANGE
        offset = (offset + RANGE) % SIZE
    after = server.cpu_times()
    return round(((after.user - before.user) + (after.system - before.system)) / (done / 1024 ** 3), 4)


def run(kind: str, blob: Path, args: argparse.Namespace) -> dict[str, object]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(blob), str(port), kind], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(REPO))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        flood = flood_and_measure(port, args.flood, args.attempts)
        cost = cpu_per_gib(port, psutil.Process(proc.pid), args.gb)
        return {"flood": flood, "server_cpu_s_per_gib": cost}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 GiB, 100 stalled connections, 20 attempts")
    parser.add_argument("--gb", type=float, default=None, help="GiB read for the cost (default 4; quick 1)")
    parser.add_argument("--flood", type=int, default=None, help="stalled connections (default 300; quick 100)")
    parser.add_argument("--attempts", type=int, default=None, help="the other device's requests (default 50)")
    args = parser.parse_args()
    args.gb = args.gb or (1.0 if args.quick else 4.0)
    args.flood = args.flood or (100 if args.quick else 300)
    args.attempts = args.attempts or (20 if args.quick else 50)
    with tempfile.TemporaryDirectory(prefix="ea-bench-fairness-") as work:
        blob = Path(work) / "artifact.eafw"
        with blob.open("wb") as f:
            f.write(os.urandom(SIZE))  # real bytes in the page cache, not a sparse file's zeros
        result = {"shipped": run("shipped", blob, args), "baseline": run("baseline", blob, args)}
    result["config"] = {"max_downloads": MAX_DOWNLOADS, "flood": args.flood, "attempts": args.attempts,
                        "gib": args.gb, "range_mib": RANGE // 2 ** 20}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
