"""The local API tests' setting: a worker (and a leader, online) on the in-memory broker with the
API on a real Unix socket (`start_api`), and raw requests to it (`raw`, `post`). The fixtures
`online` and `offline` are in conftest.py."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import leader, worker

from agent.core.clock import SystemClock
from agent.leader.agent import LeaderAgent
from agent.transport.memory import MemoryBroker
from agent.worker.agent import WorkerAgent
from agent.worker.local_api import LocalApi

CLASSES = {
    "telemetry": {"mode": "append"},
    "state": {"mode": "overwrite"},
    "tiny": {"mode": "append", "max_messages": 2, "full_policy": "reject", "max_payload_bytes": 64},
}


@dataclass
class Setup:
    gw: LeaderAgent | None
    device: WorkerAgent
    api: LocalApi
    socket: Path


async def start_api(tmp: Path, broker: MemoryBroker, *, with_leader: bool, group: str = "edge-agent",
                 socket_dir: Path | None = None, classes: dict[str, dict[str, object]] | None = None) -> Setup:
    clock = SystemClock()
    gw = await leader(clock, tmp, broker=broker) if with_leader else None
    # without a leader a direct try goes unanswered: give up on it soon
    api_section = {} if with_leader else {"direct_timeout_s": 0.1}
    device = await worker(clock, tmp, "pi-1", broker=broker,
                          sections={"classes": {**CLASSES, **(classes or {})}, "local_api": api_section})
    sock = (socket_dir or tmp) / "api.sock"
    api = LocalApi(device.messages, device.message_status, clock=clock, socket_path=sock, group=group,
                   max_body_bytes=64 * 1024, max_batch=10)
    await api.start()
    return Setup(gw, device, api, sock)


async def stop_api(s: Setup) -> None:
    await s.api.stop()
    await s.device.stop()
    if s.gw is not None:
        await s.gw.stop()


async def raw(sock: Path, request: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    reader, writer = await asyncio.open_unix_connection(str(sock))
    writer.write(request)
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers["content-length"]))
    writer.close()
    return int(lines[0].split()[1]), headers, json.loads(body)


def post(path: str, body: bytes, ctype: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body
