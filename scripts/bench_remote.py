"""What a remote session costs and carries: one leader and one worker (`edge-agent run`) on a local
mosquitto, the operator's side in this process on the leader's operator socket.

    python scripts/bench_remote.py [--rounds 200] [--mb 50] [--idle-s 120]

- shell_rtt_ms: one byte typed into a shell running `cat` (no terminal) until it comes back,
  operator -> leader -> broker -> device -> broker -> leader -> operator; median and p95 of
  `--rounds`.
- forward_mb_s: an HTTP download of `--mb` MB from a server on the device's loopback through
  `devices forward`, against the same download straight from the server (direct_mb_s, the
  baseline in the same run).
- idle_session_bytes_per_min: the worker's broker connection (kernel counters, `ss -tin`, TCP/IP
  headers counted) over `--idle-s` with one idle shell open, minus the same worker over the
  same time without one just before: what keeping a session open costs on a metered link (its
  keepalive pings, one each way every 30 s; a window shorter than a minute measures noise).
- rtt_during_forward_ms: the shell round trip, measured while the forward's download runs on the
  same device: how much the copy delays the device's other traffic (the window is what bounds it).

The last line is the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import pwd
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "scripts"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench_air import connection_counters  # noqa: E402 - the path above first
from bench_mqtt import mosquitto, spawn_agent, stop_processes  # noqa: E402

from agent.remote.flow import Receiver, Sender  # noqa: E402
from agent.remote.frames import Accepted, Ack, Data, Open, framed, read_framed  # noqa: E402
from agent.remote.operator import forward  # noqa: E402

SETTLE_S = 20.0


def log(message: str) -> None:
    print(f"[bench_remote] {message}", file=sys.stderr, flush=True)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


class Echo:
    """A shell running `cat` on the device, driven from here: one byte out, one byte back."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    async def __aenter__(self) -> Echo:
        self.reader, self.writer = await asyncio.open_unix_connection(str(self.socket))
        self.writer.write(framed(Open(device="pi-1", op="shell", argv=("cat",))))
        await self.writer.drain()
        answer = await read_framed(self.reader)
        assert isinstance(answer, Accepted), answer
        self.sid = answer.sid

        async def send(frame: Data) -> None:
            self.writer.write(framed(frame))
            await self.writer.drain()

        self.sender = Sender(self.sid, send)
        self.receiver = Receiver(self.sid)
        return self

    async def round_trip(self) -> float:
        start = time.perf_counter()
        await self.sender.send(b"x")
        while True:
            frame = await read_framed(self.reader)
            if isinstance(frame, Data):
                self.receiver.take(frame)
                ack = self.receiver.delivered(len(frame.data))
                if ack is not None:
                    self.writer.write(framed(ack))
                return (time.perf_counter() - start) * 1000
            if isinstance(frame, Ack):
                self.sender.ack(frame)
            elif frame is None:
                raise RuntimeError("the session ended")

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()


async def rtts(socket: Path, rounds: int, stop: asyncio.Event | None = None) -> list[float]:
    async with Echo(socket) as echo:
        for _ in range(3):
            await echo.round_trip()
        found = []
        for _ in range(rounds):
            found.append(await echo.round_trip())
            if stop is not None and stop.is_set():
                break
        return found


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 2), "p95": round(ordered[int(len(ordered) * 0.95) - 1], 2),
            "n": len(ordered)}


def download(url: str) -> tuple[int, float]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=300) as response:
        size = 0
        while chunk := response.read(1 << 20):
            size += len(chunk)
    return size, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--idle-s", type=float, default=120.0)
    args = parser.parse_args()
    me = pwd.getpwuid(os.geteuid()).pw_name
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        work = Path(tmp)
        site = work / "site"
        site.mkdir()
        (site / "big.bin").write_bytes(os.urandom(1 << 20) * args.mb)

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                return None

        web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: Quiet(*a, directory=str(site)))
        threading.Thread(target=web.serve_forever, daemon=True).start()
        web_port = web.server_address[1]
        with mosquitto(work) as port:
            url = f"mqtt://127.0.0.1:{port}"
            common = f'[mqtt]\nurl = "{url}"\n[heartbeat]\ninterval_s = 300\n'
            gw = write_config(work / "gw.toml", f'[agent]\nrole = "leader"\ndevice_id = "gw"\n'
                              f'data_dir = "{work / "gw"}"\nuse_uvloop = false\n{common}[remote]\n'
                              f'shell_operators = ["{me}"]\nforward_operators = ["{me}"]\n')
            pi = write_config(work / "pi-1.toml", f'[agent]\nrole = "worker"\ndevice_id = "pi-1"\n'
                              f'data_dir = "{work / "pi-1"}"\nuse_uvloop = false\n{common}[remote]\nshell = true\n'
                              f'allow_root = {"true" if os.geteuid() == 0 else "false"}\n'
                              f'forward = ["127.0.0.1:{web_port}"]\n')
            procs = [spawn_agent(["run", "--config", str(c)], work / f"{c.stem}.log")
                     for c in (gw, pi)]
            try:
                socket = work / "gw" / "operator.sock"
                result = asyncio.run(measure(args, socket, web_port, procs[1].pid, port))
            finally:
                stop_processes(*procs)
                web.shutdown()
                web.server_close()
    print(json.dumps(result, sort_keys=True))
    return 0


async def measure(args: argparse.Namespace, socket: Path, web_port: int, worker_pid: int,
                  broker_port: int) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        try:
            await rtts(socket, 1)
            break
        except (OSError, AssertionError, RuntimeError):
            if time.monotonic() > deadline:
                raise SystemExit("bench_remote: the leader never took a session") from None
            await asyncio.sleep(0.5)
    log(f"shell round trips: {args.rounds}")
    idle_rtt = summary(await rtts(socket, args.rounds))

    size_direct, took_direct = await asyncio.to_thread(download, f"http://127.0.0.1:{web_port}/big.bin")
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    forwarding = asyncio.get_running_loop().create_task(
        forward(socket, "pi-1", ("127.0.0.1", 0), "127.0.0.1", web_port, ready=bound.set_result))
    local = await bound
    log(f"forwarding 127.0.0.1:{local}: {args.mb} MB through the broker, round trips beside it")
    stop = asyncio.Event()
    beside = asyncio.get_running_loop().create_task(rtts(socket, 10_000, stop))
    size_fwd, took_fwd = await asyncio.to_thread(download, f"http://127.0.0.1:{local}/big.bin")
    stop.set()
    during = summary(await beside)
    forwarding.cancel()
    assert size_fwd == size_direct == args.mb << 20, (size_fwd, size_direct)

    log(f"idle: {args.idle_s:.0f} s without a session, then {args.idle_s:.0f} s with one")
    await asyncio.sleep(SETTLE_S)  # (the worker's fast heartbeats after the activity end first)
    without = await idle_bytes(worker_pid, broker_port, args.idle_s)
    async with Echo(socket):
        await asyncio.sleep(5)  # (its opening frames pass first)
        with_session = await idle_bytes(worker_pid, broker_port, args.idle_s)
    per_min = (with_session - without) * 60.0 / args.idle_s
    mb = 1 << 20
    return {"shell_rtt_ms": idle_rtt, "rtt_during_forward_ms": during,
            "forward_mb_s": round(size_fwd / mb / took_fwd, 1), "direct_mb_s": round(size_direct / mb / took_direct, 1),
            "forward_mb": args.mb, "idle_session_bytes_per_min": round(per_min),
            "idle_worker_bytes_per_min": round(without * 60.0 / args.idle_s), "idle_s": args.idle_s}


async def idle_bytes(pid: int, broker_port: int, seconds: float) -> int:
    before = connection_counters(pid, broker_port)
    await asyncio.sleep(seconds)
    after = connection_counters(pid, broker_port)
    if before is None or after is None:
        raise SystemExit("bench_remote: the worker's broker connection is not in `ss -tin`")
    return after.on_air - before.on_air


if __name__ == "__main__":
    sys.exit(main())
