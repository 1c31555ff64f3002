"""An idle worker on a device imports only what it uses: `edge-agent run` with the worker config
(no [firmware] key, MQTT transport, no /metrics, the local API listening) loads no leader,
simulator, firmware rollout, rich, in-memory broker or HTTP server library module. Checked in a
fresh interpreter, through the same calls `run` makes, up to an opened (not connected) worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, json, sys
from pathlib import Path

from agent.commands import run as run_cmd  # what `edge-agent run` imports first
from agent.core.clock import SystemClock
from agent.core.config import load_config


async def main(config_path, data_dir):
    from agent.app import assemble, make_transport
    from agent.service import ServiceRuntime, restrict_database_files, set_service_umask  # noqa: F401

    config = load_config(config_path)
    clock = SystemClock()
    transport = make_transport(config, clock=clock, broker_url="mqtt://127.0.0.1:1")
    app = await assemble(config, transport=transport, clock=clock, base=Path(data_dir))  # what `run` assembles
    app.collectors(), app.checks(), app.liveness()  # and what it registers
    api = app.part("local API")
    assert api is not None
    await api.start()
    try:
        return sorted(sys.modules)
    finally:
        await app.discard()


print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
"""

# Packages a worker without [firmware] on a real broker must never load.
FORBIDDEN = (
    "agent.leader",
    "agent.sim",
    "agent.transport.memory",
    "agent.transport._memory_broker",
    "firmware_rollout",
    "app_rollout",
    "release_rollout",
    "rollout_engine",
    "rich",
    # the local API's HTTP layer loads h11 with its first connection, and nothing of the client
    # side (paho itself loads http.client, for proxies)
    "agent.client",
    "http.server",
    "aiohttp",
    "h11",
    # the leader's PostgreSQL backend: gateway-only
    "psycopg",
    "agent.core.postgres",
)


def test_idle_worker_loads_only_what_it_uses(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO / "configs" / "worker.toml"), str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    modules = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "agent.worker.agent" in modules and "agent.outbox.store" in modules  # it did load
    for name in FORBIDDEN:
        loaded = sorted(m for m in modules if m == name or m.startswith(name + "."))
        assert not loaded, f"an idle worker loaded {loaded}"


FIRMWARE_SCRIPT = r"""
import asyncio, json, sys
from pathlib import Path

from agent.core.clock import SystemClock
from agent.core.config import load_config


async def main(config_path, data_dir):
    from agent.app import assemble, make_transport

    config = load_config(config_path)
    clock = SystemClock()
    transport = make_transport(config, clock=clock, broker_url="mqtt://127.0.0.1:1")
    app = await assemble(config, transport=transport, clock=clock, base=Path(data_dir))  # what `run` assembles
    assert app.part("updater") is not None
    try:
        return sorted(sys.modules)
    finally:
        await app.discard()


print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
"""

# What only an update that starts (mirrors: httpx; signatures: cryptography) or an operator's build
# (fastcdc) loads.
FORBIDDEN_UNTIL_AN_UPDATE = ("httpx", "httpcore", "anyio", "h11", "fastcdc", "click", "cryptography", "psutil",
                             "firmware_rollout.device.http_source")


def test_an_idle_worker_with_firmware_updates_loads_no_http_client(tmp_path: Path) -> None:
    from rollout_engine.keys import generate_keypair

    keys = generate_keypair(tmp_path / "keys")
    text = (REPO / "configs" / "worker-firmware.toml").read_text()
    text = text.replace('public_key = "/etc/edge-agent/fleet-public.pem"', f'public_key = "{keys.public}"')
    config = tmp_path / "worker.toml"
    config.write_text(text)
    out = subprocess.run(
        [sys.executable, "-c", FIRMWARE_SCRIPT, str(config), str(tmp_path / "data")],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    modules = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "firmware_rollout.device.updater" in modules  # the updater is there
    for name in FORBIDDEN_UNTIL_AN_UPDATE:
        loaded = sorted(m for m in modules if m == name or m.startswith(name + "."))
        assert not loaded, f"an idle worker with updates loaded {loaded}"
