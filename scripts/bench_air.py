"""What an idle device costs on the air: bytes per day on its broker connection, over TLS.

    python scripts/bench_air.py [--idle-s 600] [--quick] [--skip-cut]

One `edge-agent run` worker with configs/worker.toml and one leader with configs/leader.toml,
both on a mosquitto that runs the shipped configs/mosquitto/mosquitto.conf (TLS 1.2, passwords,
the ACL). Once the worker has settled (its outbox empty, the leader has its heartbeat), the
worker's TCP connection to the broker is read from the kernel (`ss -tin`) at the start and the
end of the idle window: bytes sent and received (TLS records included) plus 52 bytes of TCP/IP
headers per segment each way (IPv4 20 + TCP 20 + timestamps 12). The difference, extrapolated
to a day, is what a metered plan pays for an idle device.

Then the worker is frozen (SIGSTOP: its connection goes silent, as when the radio drops) and
the time until the leader marks it offline is measured.

The baseline in the same run is the floor of any MQTT liveness: MQTT PINGREQ/PINGRESP alone at
the worker's keep-alive, over the same TLS and TCP (computed from the measured bytes of one
ping exchange). The last line is the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "scripts", ROOT / "tests", ROOT / "tests" / "service"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench_mqtt import spawn_agent, stop_processes  # noqa: E402 - the path above first

TCP_IP_HEADER_BYTES = 52  # IPv4 20 + TCP 20 + the timestamp option 12
DAY_S = 86_400.0
LEADER = "gateway-01"
DEVICE = "pi-0001"
USERS = {LEADER: "leader-secret", DEVICE: "device-secret"}


def log(message: str) -> None:
    print(f"[bench_air] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Counters:
    """One TCP connection's counters, as the kernel keeps them."""

    local: str
    bytes_sent: int
    bytes_received: int
    segs_out: int
    segs_in: int

    @property
    def on_air(self) -> int:
        return self.bytes_sent + self.bytes_received + TCP_IP_HEADER_BYTES * (self.segs_out + self.segs_in)


_FIELD = re.compile(r"\b(bytes_sent|bytes_received|segs_out|segs_in):(\d+)")


def connection_counters(pid: int, broker_port: int) -> Counters | None:
    """The process's established TCP connection to the broker, from `ss -tinp`."""
    out = subprocess.run(["ss", "-H", "-tinp", "state", "established", f"( dport = :{broker_port} )"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if f"pid={pid}," not in line:
            continue
        detail = lines[i + 1] if i + 1 < len(lines) else ""
        fields = {k: int(v) for k, v in _FIELD.findall(detail)}
        local = line.split()[2]
        return Counters(local, fields.get("bytes_sent", 0), fields.get("bytes_received", 0),
                        fields.get("segs_out", 0), fields.get("segs_in", 0))
    return None


def _config(shipped: str, workdir: Path, user: str, port: int, ca: Path) -> Path:
    """A shipped config pointed at the TLS broker with the user's password file; nothing else changed
    but the ports it would open on this machine."""
    secret = workdir / f"{user}.password"
    secret.write_text(USERS[user] + "\n")
    secret.chmod(0o600)
    text = (ROOT / "configs" / shipped).read_text()
    mqtt = (f'url = "mqtts://127.0.0.1:{port}"\nusername = "{user}"\npassword_file = "{secret}"\n'
            f'tls_ca = "{ca}"')
    text = text.replace('url = "mqtt://127.0.0.1:1883"', mqtt, 1)
    text = text.replace('listen = "127.0.0.1:9100"', 'listen = ""').replace('listen = "127.0.0.1:8093"', 'listen = ""')
    path = workdir / shipped
    path.write_text(text)
    return path


def _device(db: Path):  # type: ignore[no-untyped-def]
    from agent.leader.readonly import open_leader_db

    if not db.exists():
        return None
    try:
        with open_leader_db(db) as view:
            found = view.registry.device(DEVICE)
    except Exception:  # the leader is still creating it
        return None
    return None if found is None else found[0]


def _wait(what: str, predicate, timeout_s: float, step_s: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(step_s)
    raise SystemExit(f"bench_air: {what} not within {timeout_s:.0f}s")


def ping_exchange_bytes(port: int, ca: Path) -> int:
    """Bytes on the air of one MQTT PINGREQ/PINGRESP over this broker's TLS (kernel-counted)."""
    import ssl

    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=LEADER + "-ping", protocol=mqtt.MQTTv5)
    client.username_pw_set(LEADER, USERS[LEADER])
    client.tls_set_context(ssl.create_default_context(cafile=str(ca)))
    client.connect("127.0.0.1", port, keepalive=60)
    client.loop_start()
    try:
        _wait("the ping client's connection", client.is_connected, 30)
        sock = client.socket()
        assert sock is not None
        me = sock.getsockname()

        def counters() -> Counters | None:
            return connection_counters(os.getpid(), port)

        time.sleep(1.0)  # the CONNACK's ACKs settle
        before = counters()
        rounds = 5
        for _ in range(rounds):
            client._send_pingreq()  # noqa: SLF001 - one keep-alive exchange, on demand
            time.sleep(1.0)
        after = counters()
    finally:
        client.loop_stop()
        client.disconnect()
    assert before is not None and after is not None and before.local == after.local == f"127.0.0.1:{me[1]}"
    return (after.on_air - before.on_air) // rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle-s", type=float, default=None, help="the idle window (default 600 s; --quick 120 s)")
    parser.add_argument("--quick", action="store_true", help="a 120 s window: for trying the script, not a figure")
    parser.add_argument("--skip-cut", action="store_true", help="skip the offline measurement")
    args = parser.parse_args()
    idle_s = args.idle_s if args.idle_s is not None else (120.0 if args.quick else 600.0)

    from svc_broker import ExampleBroker, make_pki

    from agent.core.config import AgentConfig, decode_toml

    with tempfile.TemporaryDirectory(prefix="bench-air-") as tmp:
        workdir = Path(tmp)
        pki = make_pki(workdir / "pki", client_cn=DEVICE)
        with ExampleBroker(workdir / "broker", pki, USERS) as broker:
            leader_conf = _config("leader.toml", workdir, LEADER, broker.port, pki.ca_cert)
            worker_conf = _config("worker.toml", workdir, DEVICE, broker.port, pki.ca_cert)
            config = decode_toml(worker_conf, AgentConfig)
            leader = spawn_agent(["run", "--config", str(leader_conf), "--data-dir", str(workdir / "leader")],
                            workdir / "leader.log")
            worker = spawn_agent(["run", "--config", str(worker_conf), "--data-dir", str(workdir / "worker")],
                            workdir / "worker.log")
            db = workdir / "leader" / "leader.db"
            try:
                _wait("the leader's record of the worker", lambda: (d := _device(db)) is not None and d.online, 120)
                first = _wait("the worker's connection", lambda: connection_counters(worker.pid, broker.port), 30)
                time.sleep(15.0)  # settled: the start's messages answered
                log(f"idle for {idle_s:.0f}s on {first.local}")
                start = connection_counters(worker.pid, broker.port)
                t0 = time.monotonic()
                time.sleep(idle_s)
                end = connection_counters(worker.pid, broker.port)
                elapsed = time.monotonic() - t0
                if start is None or end is None or start.local != end.local:
                    raise SystemExit("bench_air: the worker's connection changed during the window "
                                     f"({start and start.local} -> {end and end.local}); see {workdir}/worker.log")
                rss_mb = _rss_mb(worker.pid)
                offline_s = None if args.skip_cut else _offline_after_freeze(worker, db)
            finally:
                stop_processes(worker, leader)
            ping = ping_exchange_bytes(broker.port, pki.ca_cert)
    air = end.on_air - start.on_air
    per_day = air * DAY_S / elapsed
    keepalive = config.mqtt.keepalive_s
    floor = ping * DAY_S / keepalive
    result = {
        "idle_s": round(elapsed, 1),
        "heartbeat_interval_s": config.heartbeat.interval_s,
        "keepalive_s": keepalive,
        "bytes_sent": end.bytes_sent - start.bytes_sent,
        "bytes_received": end.bytes_received - start.bytes_received,
        "segments": (end.segs_out - start.segs_out) + (end.segs_in - start.segs_in),
        "bytes_on_air": air,
        "bytes_per_day": round(per_day),
        "baseline_pings_only_bytes_per_day": round(floor),
        "ping_exchange_bytes": ping,
        # a connection's start as the worker's first reading found it: the TLS handshake, CONNECT,
        # the subscriptions, the birth, the first (full) heartbeat and their answers
        "connection_start_bytes": first.on_air,
        "vs_pings_only": round(per_day / floor, 2) if floor else None,
        "offline_seen_after_s": None if offline_s is None else round(offline_s, 1),
        "worker_rss_mb": round(rss_mb, 2),
        "target_bytes_per_day<1000000": per_day < 1_000_000,
        "target_offline_s<=90": None if offline_s is None else offline_s <= 90,
    }
    print(json.dumps(result), flush=True)


def _rss_mb(pid: int) -> float:
    import psutil

    return float(psutil.Process(pid).memory_info().rss) / (1024 * 1024)


def _offline_after_freeze(worker: subprocess.Popen[bytes], db: Path) -> float:
    """SIGSTOP the worker (its connection goes silent) and time the leader's offline mark."""
    os.kill(worker.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    log("worker frozen: waiting for the leader to mark it offline")
    _wait("the leader's offline mark", lambda: (d := _device(db)) is not None and not d.online, 600, 0.5)
    took = time.monotonic() - t0
    os.kill(worker.pid, signal.SIGCONT)
    return took


if __name__ == "__main__":
    main()
