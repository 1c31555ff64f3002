#!/usr/bin/env python3
"""MQTT benchmark: raw aiomqtt baseline, our end-to-end path, leader intake, idle worker.

    python scripts/bench_mqtt.py [--quick] [--messages N] [--devices N] [--idle-s S] [--idle-only]

Starts its own mosquitto (``set_tcp_nodelay true``) on a free loopback port and stops it by its
process id. Everything runs against that one broker:

1. raw aiomqtt: one QoS 1 publisher (pipelined) and one subscriber; messages/s delivered.
2. e2e: a worker agent's telemetry through its outbox and relay, over MQTT, into a leader agent
   that answers every envelope; messages/s until the leader's state holds all of them.
3. leader intake: heartbeats from 10,000 simulated devices into a leader agent; heartbeats/s the
   leader answered `accepted`, and the leader process's CPU. The devices are simulated by one
   load generator process that writes pre-encoded MQTT v5 PUBLISH packets (QoS 0, real
   Envelope/Heartbeat payloads with a system sample, a ResponseTopic so the leader answers every
   envelope) over a plain socket, paced at `--intake-rate` messages/s (default 12,000: more than
   the 5,000/s target, below what one mosquitto can route on 2 cores with the leader beside
   it). The figure can therefore not exceed the offered rate; `leader_intake_cpu_percent` says
   how much of a core that took. Then the leader is stopped under whatever backlog is left.
4. idle worker: a real ``edge-agent run`` worker process (and a leader process) idle for 60 s
   (``--quick``) or 10 min: RSS, CPU percent, and disk bytes written, scaled to an hour. The
   worker runs as it is installed: its bytecode compiled first (as the Debian package's postinst
   does; an agent compiling its modules from source at every start holds about 1.4 MB more) and
   with the environment systemd/edge-agent.service gives it (MALLOC_ARENA_MAX=2).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MOSQUITTO_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/bin/mosquitto", "/usr/local/sbin/mosquitto")


def log(message: str) -> None:
    print(f"[bench_mqtt] {message}", file=sys.stderr, flush=True)


# -- broker -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _mosquitto_binary() -> str:
    found = shutil.which("mosquitto")
    if found:
        return found
    for candidate in MOSQUITTO_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("bench_mqtt: mosquitto is not installed (apt-get install mosquitto)")


@contextlib.contextmanager
def mosquitto(workdir: Path) -> Iterator[int]:
    """Run mosquitto on a free loopback port; yield the port; stop it by pid."""
    port = free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        "\n".join(
            [
                f"listener {port} 127.0.0.1",
                "allow_anonymous true",
                "set_tcp_nodelay true",
                "persistence false",
                "max_queued_messages 100000",
                "max_inflight_messages 0",
                "log_type error",
                f"log_dest file {workdir / 'mosquitto.log'}",
                "",
            ]
        )
    )
    proc = subprocess.Popen(
        [_mosquitto_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"bench_mqtt: mosquitto exited with {proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            if time.monotonic() > deadline:
                raise SystemExit("bench_mqtt: mosquitto did not start listening")
            time.sleep(0.02)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


# -- 1. raw aiomqtt baseline --------------------------------------------------------------------
async def raw_aiomqtt(port: int, count: int, *, window: int = 256, payload_bytes: int = 200) -> dict[str, float]:
    """QoS 1 publisher (up to `window` publishes awaiting PUBACK) and QoS 1 subscriber."""
    import aiomqtt
    from paho.mqtt.enums import CallbackAPIVersion  # noqa: F401  (ensures paho 2 is present)

    topic = "bench/raw"
    payload = b"x" * payload_bytes
    received = 0
    done = asyncio.Event()

    async with aiomqtt.Client(
        "127.0.0.1", port, identifier="bench-raw-sub", protocol=aiomqtt.ProtocolVersion.V5
    ) as sub, aiomqtt.Client(
        "127.0.0.1",
        port,
        identifier="bench-raw-pub",
        protocol=aiomqtt.ProtocolVersion.V5,
        max_inflight_messages=window,
    ) as pub:
        pub.pending_calls_threshold = 1 << 30  # no warning per publish beyond 10 in flight
        await sub.subscribe(topic, qos=1)

        async def consume() -> None:
            nonlocal received
            async for _message in sub.messages:
                received += 1
                if received >= count:
                    done.set()
                    return

        consumer = asyncio.create_task(consume(), name="raw-consumer")
        start = time.perf_counter()
        slots = asyncio.Semaphore(window)

        async def one() -> None:
            try:
                await pub.publish(topic, payload, qos=1)
            finally:
                slots.release()

        pending: set[asyncio.Task[None]] = set()
        for _ in range(count):
            await slots.acquire()
            task = asyncio.create_task(one())
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.wait_for(done.wait(), timeout=120)
        elapsed = time.perf_counter() - start
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    return {"raw_aiomqtt_msgs_per_s": count / elapsed, "raw_messages": float(count),
            "raw_lost": float(count - received)}


# -- 2. our worker -> leader path, end to end ---------------------------------------------------
def _config(role: str, device: str, **sections: dict[str, object]):
    from agent.core.config import AgentConfig, convert

    data: dict[str, dict[str, object]] = {"agent": {"role": role, "device_id": device, "fleet": "bench"}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return convert(data, AgentConfig, source="bench")


async def e2e_path(port: int, count: int, workdir: Path) -> dict[str, float]:
    """Telemetry enqueued in a worker's outbox, drained by its relay over MQTT into a leader that
    answers each envelope after committing it; until the leader's state holds all of them."""
    import random

    from agent.app import make_transport
    from agent.core.clock import SystemClock
    from agent.leader.agent import LeaderAgent
    from agent.protocol import Telemetry
    from agent.worker.actors import outbox_message
    from agent.worker.agent import WorkerAgent

    clock = SystemClock()
    url = f"mqtt://127.0.0.1:{port}"
    # One device's path as fast as it goes: the per-device share of the intake is off here.
    lcfg = _config("leader", "gw", mailbox={"capacity": 4096},
                   leader={"heartbeat_deadline_s": 600.0, "device_rate_per_s": 0.0})
    wcfg = _config("worker", "w1", heartbeat={"interval_s": 60.0},
                   relay={"partitions": 1, "reconnect_jitter_s": 0.0, "aimd_initial": 50, "aimd_max": 200},
                   outbox={"classes": {"telemetry": {"max_messages": count + 10}}})
    leader = await LeaderAgent.open(lcfg, transport=make_transport(lcfg, clock=clock, broker_url=url), clock=clock,
                                    data_dir=workdir / "e2e-leader", rng=random.Random(1), inbox_concurrency=128)
    worker = await WorkerAgent.open(wcfg, transport=make_transport(wcfg, clock=clock, broker_url=url), clock=clock,
                                    data_dir=workdir / "e2e-worker", rng=random.Random(2), sampler=None)
    await leader.start()
    await worker.start()
    try:
        while not (worker.transport.connected.is_open and leader.transport.connected.is_open):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        msgs = [outbox_message(worker.ids, "w1", Telemetry(device_id="w1", seq=n + 1, name="bench", ts_ms=n,
                                                           value=float(n)))
                for n in range(count)]
        start = time.perf_counter()
        for i in range(0, count, 500):
            await worker.outbox.enqueue_many(msgs[i:i + 500])

        def applied() -> int:
            record = leader.registry.device("w1")
            return record.telemetry_count if record is not None else 0

        deadline = start + 300
        while applied() < count and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - start
        got = applied()
        while (await worker.outbox.stats()).pending and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        stats = await worker.outbox.stats()
        metrics = worker.relay.metrics() if worker.relay else None
    finally:
        await worker.stop()
        await leader.stop()
    return {
        "e2e_msgs_per_s": got / elapsed, "e2e_messages": float(count), "e2e_lost": float(count - got),
        "e2e_outbox_conservation_ok": bool(stats.conservation_ok), "e2e_pending_after": float(stats.pending),
        "e2e_relay_capacity_rejections": float(metrics.capacity_rejections if metrics else 0),
    }


# -- 3. leader intake of heartbeats from many devices ---------------------------------------------
def _varint(n: int) -> bytes:
    """MQTT variable byte integer."""
    out = bytearray()
    while True:
        n, digit = n >> 7, n & 0x7F
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _mqtt_string(text: str) -> bytes:
    data = text.encode("utf-8")
    return len(data).to_bytes(2, "big") + data


def _connect_packet(client_id: str, keepalive_s: int = 60) -> bytes:
    """MQTT v5 CONNECT: clean start, no properties, no credentials."""
    body = _mqtt_string("MQTT") + bytes([5, 0x02]) + keepalive_s.to_bytes(2, "big") + _varint(0)
    body += _mqtt_string(client_id)
    return b"\x10" + _varint(len(body)) + body


def _publish_qos0(topic: str, payload: bytes, properties: bytes) -> bytes:
    """MQTT v5 PUBLISH at QoS 0 (no packet id) with pre-encoded properties."""
    body = _mqtt_string(topic) + _varint(len(properties)) + properties + payload
    return b"\x30" + _varint(len(body)) + body


def heartbeat_publisher(port: int, devices: range, seconds: float, rate: float, ready: object, go: object,
               counter: object) -> None:
    """The load generator process: pre-encoded MQTT v5 PUBLISH packets over a plain socket.

    Before `go` it encodes `rounds` of heartbeats for every device of `devices`: a real
    `Envelope` of kind heartbeat (id, sender, seq) around a real `Heartbeat` with a psutil-shaped
    `SystemSample`, on the device's own `up` topic, with the device's own reply topic as its
    ResponseTopic (the only one the leader answers on; nobody listens there: the leader answers
    every envelope and the broker drops the answers). QoS 0 is
    the cheapest load for the broker and for this process; the leader's side is the same work as
    for a real worker's QoS 1 heartbeat, except that it sends no PUBACK. During the window it
    only writes those bytes in batches paced to `rate` messages/s (the kernel's socket buffer
    and the broker's reading set the pace when the rate is higher than that).
    """
    from agent.core.codec import Envelope, encode
    from agent.protocol import Heartbeat, SystemSample, encode_message
    from agent.transport import topics

    per_round = max(1, len(devices))
    rounds = max(1, int(rate * seconds / per_round) + 2)
    packets: list[bytes] = []
    for seq in range(1, rounds + 1):
        for d in devices:
            device = f"dev-{d:05d}"
            props = b"\x08" + _mqtt_string(topics.reply("bench", device, "relay"))  # 0x08 ResponseTopic
            sample = SystemSample(cpu_percent=12.5, mem_total_bytes=1 << 30, mem_available_bytes=600 << 20,
                                  mem_percent=41.0, disk_total_bytes=32 << 30, disk_free_bytes=20 << 30,
                                  disk_percent=37.5, load_1m=0.4, load_5m=0.3, load_15m=0.2,
                                  temperature_c=48.5, uptime_s=86_400.0 + seq)
            hb = Heartbeat(device_id=device, seq=seq, uptime_s=float(seq * 5), firmware_version="1.0.0",
                           sample=sample)
            env = Envelope(id=f"{d:05d}-{seq:08d}", kind="heartbeat", sender=device, receiver="leader",
                           key="heartbeat", conflict="overwrite", seq=seq, payload=encode_message(hb))
            packets.append(_publish_qos0(topics.up("bench", device), encode(env), props))

    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(_connect_packet(f"bench-load-{devices.start}"))
    connack = sock.recv(4)
    if len(connack) < 4 or connack[0] != 0x20 or connack[3] != 0:
        raise SystemExit(f"bench_mqtt: load generator not accepted by the broker: {connack!r}")
    ready.set()  # type: ignore[attr-defined]
    go.wait()  # type: ignore[attr-defined]
    batch = 200
    sent = 0
    start = time.monotonic()
    end = start + seconds
    while sent < len(packets):
        now = time.monotonic()
        if now >= end:
            break
        ahead = sent - (now - start) * rate
        if ahead > 0:
            time.sleep(ahead / rate)
        chunk = packets[sent:sent + batch]
        sock.sendall(b"".join(chunk))
        sent += len(chunk)
    sock.sendall(b"\xe0\x00")  # DISCONNECT, normal
    sock.close()
    with counter.get_lock():  # type: ignore[attr-defined]
        counter.value += sent  # type: ignore[attr-defined]


async def leader_intake(
    port: int, devices: int, seconds: float, workdir: Path, *, rate: float = 12_000.0, publishers: int = 1
) -> dict[str, float]:
    """Heartbeats/s the leader answered `accepted` while a generator offers `rate` per second."""
    import random

    import psutil

    from agent.app import make_transport
    from agent.core.clock import SystemClock
    from agent.leader.agent import LeaderAgent

    clock = SystemClock()
    url = f"mqtt://127.0.0.1:{port}"
    cfg = _config("leader", "gw", mailbox={"capacity": max(1024, devices + 1024)},
                  leader={"heartbeat_deadline_s": 600.0, "process_interval_s": 0.0})
    leader = await LeaderAgent.open(cfg, transport=make_transport(cfg, clock=clock, broker_url=url), clock=clock,
                                    data_dir=workdir / "intake-leader", rng=random.Random(3), intake_batch_max=2048)
    await leader.start()
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    counter = ctx.Value("q", 0)
    per = (devices + publishers - 1) // publishers
    readies = []
    procs = []
    for i in range(publishers):
        ready = ctx.Event()
        proc = ctx.Process(target=heartbeat_publisher,
                           args=(port, range(i * per, min(devices, (i + 1) * per)), seconds,
                                 rate / publishers, ready, go, counter), daemon=True)
        proc.start()
        readies.append(ready)
        procs.append(proc)
    try:
        while not leader.transport.connected.is_open or not all(r.is_set() for r in readies):
            await asyncio.sleep(0.05)
        me = psutil.Process()
        assert leader.inbox is not None
        before = leader.inbox.stats.accepted
        cpu0 = me.cpu_times()
        t0 = time.perf_counter()
        go.set()
        await asyncio.sleep(seconds)
        taken = leader.inbox.stats.accepted - before
        elapsed = time.perf_counter() - t0
        cpu1 = me.cpu_times()
        for proc in procs:
            await asyncio.get_running_loop().run_in_executor(None, proc.join, 10)
        busy = leader.busy_answers
        intake = leader.intake_stats
        applied = intake.stats.applied if intake is not None else 0
        known = len(leader.registry.devices())
        log(f"leader intake: {taken / elapsed:.0f} accepted/s; published {counter.value}; stopping the leader")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        stop_t0 = time.perf_counter()
        try:  # a leader stopping under a backlog of thousands of envelopes: do not wait forever
            await asyncio.wait_for(leader.stop(), 30)
        except TimeoutError:
            log("leader intake: the leader did not stop within 30 s")
        stop_s = time.perf_counter() - stop_t0
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "leader_intake_hb_per_s": taken / elapsed,
        "leader_intake_cpu_percent": 100.0 * cpu_s / elapsed,
        "leader_intake_devices": float(devices),
        "leader_intake_devices_seen": float(known),
        "leader_intake_published": float(counter.value),
        "leader_intake_applied": float(applied),
        "leader_intake_busy_answers": float(busy),
        "leader_intake_offered_per_s": float(rate),
        "leader_intake_stop_s": stop_s,
    }


# -- 4. an idle worker in its own process ---------------------------------------------------------
def spawn_agent(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "agent.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(ROOT),
                                env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)})


#: The project's packages, compiled to bytecode before the idle worker starts.
PACKAGES = ("agent", "firmware_rollout", "config_rollout", "app_rollout", "release_rollout", "rollout_engine")


def compile_bytecode() -> None:
    """Compile the project's modules as the Debian package does at its install, so that the
    idle worker loads bytecode instead of compiling every module at its start."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *PACKAGES], cwd=str(ROOT), check=True,
                   stdout=subprocess.DEVNULL)


def unit_environment() -> dict[str, str]:
    """The `Environment=` the shipped unit (systemd/edge-agent.service) gives the agent."""
    import shlex

    found: dict[str, str] = {}
    for line in (ROOT / "systemd" / "edge-agent.service").read_text().splitlines():
        if line.startswith("Environment="):
            for item in shlex.split(line[len("Environment="):]):
                key, _, value = item.partition("=")
                found[key] = value
    return found


def stop_processes(*procs: subprocess.Popen[bytes], wait_s: float = 15.0) -> None:
    """SIGTERM each (a stopped one is continued first), then SIGKILL what lingers `wait_s`."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _write_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def _outbox_pending(db: Path) -> int:
    """Rows waiting in a worker's outbox (read-only; 0 when there is no file yet)."""
    import sqlite3

    if not db.exists():
        return 0
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])
    except sqlite3.Error:
        return 0
    finally:
        conn.close()


def idle_worker(port: int, seconds: float, workdir: Path, warmup_s: float = 10.0) -> dict[str, float]:
    """`edge-agent run` with configs/worker.toml (heartbeat every 5 s) beside a leader process."""
    import psutil

    url = f"mqtt://127.0.0.1:{port}"
    leader_conf = workdir / "idle-leader.toml"
    leader_conf.write_text((ROOT / "configs" / "leader.toml").read_text().replace(
        'listen = "127.0.0.1:9100"', 'listen = ""'))
    leader = spawn_agent(["run", "--config", str(leader_conf), "--broker", url,
                          "--data-dir", str(workdir / "idle-leader")], workdir / "idle-leader.log")
    compile_bytecode()
    worker = spawn_agent(["run", "--config", str(ROOT / "configs" / "worker.toml"), "--broker", url,
                          "--data-dir", str(workdir / "idle-worker")], workdir / "idle-worker.log",
                         env=unit_environment())
    try:
        time.sleep(warmup_s)
        if worker.poll() is not None:
            raise SystemExit(f"bench_mqtt: the idle worker exited: {(workdir / 'idle-worker.log').read_text()[-2000:]}")
        # idle means settled: what the start left in the outbox (heartbeats made before the leader
        # listened) delivered, so the window measures what an idle device writes hour after hour
        deadline = time.monotonic() + 120
        while _outbox_pending(workdir / "idle-worker" / "outbox.db") and time.monotonic() < deadline:
            time.sleep(0.5)
        proc = psutil.Process(worker.pid)
        cpu0 = proc.cpu_times()
        io0 = _write_bytes(worker.pid)
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        cpu1 = proc.cpu_times()
        io1 = _write_bytes(worker.pid)
        rss = proc.memory_info().rss
        uss = proc.memory_full_info().uss
        beats = 0
        db = workdir / "idle-leader" / "leader.db"
        if db.exists():
            from agent.leader.readonly import open_leader_db

            with open_leader_db(db) as view:
                found = view.registry.device("pi-0001")
            beats = (found[1].heartbeat_seq or 0) % 1_000_000_000 if found is not None else 0
    finally:
        stop_processes(worker, leader)
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "idle_worker_rss_mb": rss / (1024 * 1024),
        "idle_worker_uss_mb": uss / (1024 * 1024),
        "idle_worker_cpu_percent": 100.0 * cpu_s / elapsed,
        "idle_worker_write_bytes_per_hour": (io1 - io0) * 3600.0 / elapsed,
        "idle_worker_seconds": elapsed,
        "idle_worker_heartbeats_applied": float(beats),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="short runs; idle worker measured over 60 s")
    parser.add_argument("--messages", type=int, default=None, help="messages for the raw and e2e runs")
    parser.add_argument("--devices", type=int, default=10_000, help="simulated devices for leader intake")
    parser.add_argument("--intake-s", type=float, default=None, help="leader intake window in seconds")
    parser.add_argument("--intake-rate", type=float, default=12_000.0, help="heartbeats/s the generator offers")
    parser.add_argument("--idle-s", type=float, default=None, help="idle worker window in seconds")
    parser.add_argument("--skip-idle", action="store_true", help="skip the idle worker measurement")
    parser.add_argument("--idle-only", action="store_true", help="measure only the idle worker")
    args = parser.parse_args(argv)
    messages = args.messages or (10_000 if args.quick else 50_000)
    idle_s = args.idle_s if args.idle_s is not None else (60.0 if args.quick else 600.0)
    intake_s = args.intake_s if args.intake_s is not None else (10.0 if args.quick else 30.0)

    from agent.actors import run as run_loop

    result: dict[str, object] = {"quick": bool(args.quick)}
    with tempfile.TemporaryDirectory(prefix="bench-mqtt-", dir=str(ROOT)) as tmp:
        workdir = Path(tmp)
        with mosquitto(workdir) as port:
            log(f"mosquitto on 127.0.0.1:{port} (set_tcp_nodelay true)")
            if args.idle_only:
                idle = idle_worker(port, idle_s, workdir)
                print(json.dumps(idle), flush=True)
                return 0
            raw = max((run_loop(raw_aiomqtt(port, messages, window=w)) for w in (16, 64)),
                      key=lambda r: r["raw_aiomqtt_msgs_per_s"])
            log(f"raw aiomqtt QoS 1: {raw['raw_aiomqtt_msgs_per_s']:.0f} msg/s")
            result.update(raw)
            e2e = run_loop(e2e_path(port, messages, workdir))
            log(f"worker -> leader, acknowledged: {e2e['e2e_msgs_per_s']:.0f} msg/s")
            result.update(e2e)
            result["ratio_vs_raw"] = e2e["e2e_msgs_per_s"] / raw["raw_aiomqtt_msgs_per_s"]
            intake = run_loop(leader_intake(port, args.devices, intake_s, workdir, rate=args.intake_rate))
            log(f"leader intake: {intake['leader_intake_hb_per_s']:.0f} heartbeats/s,"
                f" {intake['leader_intake_cpu_percent']:.0f}% CPU")
            result.update(intake)
            if not args.skip_idle:
                log(f"idle worker: measuring for {idle_s:.0f}s")
                idle = idle_worker(port, idle_s, workdir)
                log(f"idle worker: {idle['idle_worker_rss_mb']:.1f} MB RSS, {idle['idle_worker_cpu_percent']:.2f}% CPU,"
                    f" {idle['idle_worker_write_bytes_per_hour'] / 1e6:.1f} MB written per hour")
                result.update(idle)
    result["lost"] = int(result.get("raw_lost", 0)) + int(result.get("e2e_lost", 0))
    result["targets"] = {
        "ratio_vs_raw>=0.3": result["ratio_vs_raw"] >= 0.3,  # type: ignore[operator]
        "leader_intake_hb_per_s>=5000": result["leader_intake_hb_per_s"] >= 5000,  # type: ignore[operator]
        "idle_worker_rss_mb<=30": result.get("idle_worker_rss_mb", 0) <= 30,  # type: ignore[operator]
        "idle_worker_cpu_percent<1": result.get("idle_worker_cpu_percent", 0) < 1,  # type: ignore[operator]
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn", force=True)
    sys.exit(main())
