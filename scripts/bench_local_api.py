"""Local API benchmark: what the front door costs an idle worker, and how fast it takes messages.

    python scripts/bench_local_api.py [--quick] [--messages N] [--idle-s S]

Against a real mosquitto (started here) and a leader process, two `edge-agent run` workers from
configs/worker.toml idle side by side: one with the local API (the default), one with
`[local_api] enabled = false`, the baseline of the same run. Their RSS and USS after the idle
window give the API's resident cost (the issue's budget: at most 3 MB).

Then, on the first worker's socket, with `agent.client.Client` (one kept-alive connection):

* refused: POST of a message of an unknown class, answered 400 without storing anything: the
  floor of a request (HTTP, JSON, validation), the baseline for the two below;
* direct: one message per request, the leader online (answered once leader.db holds it);
* batch: 100 messages per request, into the outbox in one transaction.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_mqtt import mosquitto, spawn_agent, stop_processes  # noqa: E402


def log(message: str) -> None:
    print(f"[bench_local_api] {message}", file=sys.stderr, flush=True)


def _worker_config(workdir: Path, name: str, port: int, *, local_api: bool) -> Path:
    text = (ROOT / "configs" / "worker.toml").read_text()
    text = text.replace('device_id = "pi-0001"', f'device_id = "{name}"')
    text = text.replace('url = "mqtt://127.0.0.1:1883"', f'url = "mqtt://127.0.0.1:{port}"')
    text = text.replace('data_dir = "/var/lib/edge-agent"', f'data_dir = "{workdir / name}"')
    if not local_api:
        text = text.replace("[local_api]\n", "[local_api]\nenabled = false\n")
    path = workdir / f"{name}.toml"
    path.write_text(text)
    return path


def _wait_socket(sock: Path, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    from agent.client import AgentUnavailable, Client

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench_local_api: the worker exited: {log_path.read_text()[-2000:]}")
        try:
            with Client(sock) as client:
                if client.status()["connected"]:
                    return
        except AgentUnavailable:
            pass
        time.sleep(0.1)
    raise SystemExit("bench_local_api: the local API did not come up in 60 s")


def _rate(n: int, run: object) -> float:
    assert callable(run)
    t0 = time.perf_counter()
    run()
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages, a 20 s idle window")
    parser.add_argument("--messages", type=int, default=None, help="messages per throughput run")
    parser.add_argument("--idle-s", type=float, default=None, help="idle window before the memory is read")
    args = parser.parse_args(argv)
    n = args.messages or (2_000 if args.quick else 10_000)
    idle_s = args.idle_s if args.idle_s is not None else (20.0 if args.quick else 60.0)

    import psutil

    from agent.client import Client, LocalApiError

    result: dict[str, object] = {"quick": bool(args.quick), "messages": n}
    with tempfile.TemporaryDirectory(prefix="bench-api-", dir=str(ROOT)) as tmp:
        workdir = Path(tmp)
        with mosquitto(workdir) as port:
            url = f"mqtt://127.0.0.1:{port}"
            leader_conf = workdir / "leader.toml"
            leader_conf.write_text((ROOT / "configs" / "leader.toml").read_text().replace(
                'listen = "127.0.0.1:9100"', 'listen = ""'))
            procs = [spawn_agent(["run", "--config", str(leader_conf), "--broker", url, "--data-dir",
                                  str(workdir / "leader")], workdir / "leader.log")]
            api_on = _worker_config(workdir, "with-api", port, local_api=True)
            api_off = _worker_config(workdir, "without-api", port, local_api=False)
            with_api = spawn_agent(["run", "--config", str(api_on)], workdir / "with-api.log")
            without = spawn_agent(["run", "--config", str(api_off)], workdir / "without-api.log")
            procs += [with_api, without]
            try:
                sock = workdir / "with-api" / "api.sock"
                _wait_socket(sock, with_api, workdir / "with-api.log")
                log(f"two idle workers, local API on and off: {idle_s:.0f} s")
                time.sleep(idle_s)
                for name, proc in (("with_api", with_api), ("without_api", without)):
                    info = psutil.Process(proc.pid).memory_full_info()
                    result[f"idle_worker_{name}_rss_mb"] = info.rss / (1024 * 1024)
                    result[f"idle_worker_{name}_uss_mb"] = info.uss / (1024 * 1024)
                result["local_api_rss_cost_mb"] = (
                    float(result["idle_worker_with_api_rss_mb"]) - float(result["idle_worker_without_api_rss_mb"]))  # type: ignore[arg-type]
                result["local_api_uss_cost_mb"] = (
                    float(result["idle_worker_with_api_uss_mb"]) - float(result["idle_worker_without_api_uss_mb"]))  # type: ignore[arg-type]
                with Client(sock) as client:

                    def refused() -> None:
                        for _ in range(n):
                            try:
                                client.send("no-such-class", {"t": 21.5})
                            except LocalApiError:
                                pass

                    def direct() -> None:
                        for i in range(n):
                            client.send("telemetry", {"t": 21.5, "i": i})

                    batch_body = [{"class": "telemetry", "payload": {"t": 21.5, "i": i}} for i in range(100)]

                    def batches() -> None:
                        for _ in range(n // 100):
                            client.send_many(batch_body)

                    result["refused_requests_per_s"] = _rate(n, refused)
                    result["direct_msgs_per_s"] = _rate(n, direct)
                    result["batch_msgs_per_s"] = _rate(n // 100 * 100, batches)
                    result["status_after"] = client.status()["classes"]["telemetry"]
            finally:
                stop_processes(*procs, wait_s=30.0)
    result["direct_vs_refused"] = float(result["direct_msgs_per_s"]) / float(result["refused_requests_per_s"])  # type: ignore[arg-type]
    result["targets"] = {"local_api_rss_cost_mb<=3": float(result["local_api_rss_cost_mb"]) <= 3.0}  # type: ignore[arg-type]
    log(f"local API: {result['local_api_rss_cost_mb']:.2f} MB RSS, direct {result['direct_msgs_per_s']:.0f} msg/s,"
        f" batch {result['batch_msgs_per_s']:.0f} msg/s")
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.pop("RUNTIME_DIRECTORY", None)  # the sockets go in the benchmark's data dirs
    raise SystemExit(main())
