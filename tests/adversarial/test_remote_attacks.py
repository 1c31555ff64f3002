"""Remote sessions under attack, against a real leader and worker (`edge-agent run` on a real
mosquitto): a device that sends the leader session frames of no session of its own, garbage and
an open; garbage and oversized frames to a device; an operator socket fed a length beyond the
bound, bytes that are no frame, data before an open; a flood of sessions beyond the device's and
the operator's bounds. Each is refused with its reason (the leader's rejects, the CLI's message),
and afterwards a shell still runs and an operator closes a session with `devices close`."""

from __future__ import annotations

import asyncio
import os
import pwd
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import REPO, kill, spawn_agent

from agent.leader.readonly import open_leader_db
from agent.remote.frames import FRAME_MAX, Data, Open, encode, framed
from agent.transport import topics

pytestmark = [pytest.mark.mqtt, pytest.mark.timeout(300)]
FLEET = "t"


def cli(tmp_path: Path, *argv: str, wait: bool = True) -> Any:
    command = [sys.executable, "-m", "agent.cli", "devices", argv[0], "--config", str(tmp_path / "gw.toml"),
               *argv[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if wait:
        return subprocess.run(command, capture_output=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            stdin=subprocess.DEVNULL)


async def socket_answer(path: Path, data: bytes) -> bytes:
    """What the leader's operator socket says to `data` before it closes the connection."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


def open_sessions(db: Path) -> list[str]:
    with open_leader_db(db) as leader:
        return [r.sid for r in leader.sessions.sessions(open_only=True)]


async def test_hostile_frames_and_floods_are_refused_and_sessions_are_still_served(
        mosquitto: Any, tmp_path: Path) -> None:
    me = pwd.getpwuid(os.geteuid()).pw_name
    leader = spawn_agent(tmp_path, "leader", "gw", mosquitto.url, agent={"data_dir": str(tmp_path / "gw")},
                         remote={"shell_operators": [me], "forward_operators": [me], "max_sessions": 3})
    worker = spawn_agent(tmp_path, "worker", "pi-1", mosquitto.url, agent={"data_dir": str(tmp_path / "pi-1")},
                         remote={"shell": True, "allow_root": os.geteuid() == 0, "max_sessions": 2})
    other = spawn_agent(tmp_path, "worker", "pi-2", mosquitto.url, agent={"data_dir": str(tmp_path / "pi-2")},
                        remote={"shell": True, "allow_root": os.geteuid() == 0, "max_sessions": 4})
    socket = tmp_path / "gw" / "operator.sock"
    db = tmp_path / "gw" / "leader.db"
    long: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            done = cli(tmp_path, "shell", "pi-1", "--", "echo ready")
            if done.returncode == 0:
                break
            assert time.monotonic() < deadline, done.stderr
            await asyncio.sleep(0.5)

        # a device sends the leader frames of no session of its own, garbage, an open
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="rogue",
                                  protocol=aiomqtt.ProtocolVersion.V5) as rogue:
            up = topics.session_up(FLEET, "rogue", "gw")
            await rogue.publish(up, encode(Data(sid="ab" * 16, seq=1, data=b"x")), qos=1)
            await rogue.publish(up, b"\xc1 not msgpack", qos=1)
            await rogue.publish(up, encode(Open(sid="cd" * 16, device="pi-1", op="shell")), qos=1)
            await rogue.publish(up, b"\x00" * (FRAME_MAX + 1), qos=1)
            # and the device is sent garbage and an oversized frame
            down = topics.session_down(FLEET, "pi-1")
            await rogue.publish(down, b"\xc1", qos=1)
            await rogue.publish(down, b"\x00" * (FRAME_MAX + 1), qos=1)
        deadline = time.monotonic() + 60
        while True:
            with open_leader_db(db) as view:
                reasons = [r.reason for r in view.rejects.newest(device="rogue")]
            if len(reasons) >= 4 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
        assert sum("a session frame of no session of rogue" in r for r in reasons) == 2, reasons
        assert sum("a malformed session frame" in r for r in reasons) == 2, reasons

        # the operator socket: a length beyond the bound, bytes that are no frame, data before an open
        assert await socket_answer(socket, struct.pack(">I", FRAME_MAX + 1) + b"x" * 64) == b""
        assert await socket_answer(socket, struct.pack(">I", 3) + b"\xc1\xc1\xc1") == b""
        refused = await socket_answer(socket, framed(Data(sid="", seq=1, data=b"ls\n")))
        assert b"a session starts with an open" in refused

        # a flood: the device takes 2 at once, the leader 3 per operator
        long = [cli(tmp_path, "shell", "pi-1", "--", "sleep 120", wait=False) for _ in range(2)]
        deadline = time.monotonic() + 60
        while len(open_sessions(db)) < 2:
            assert time.monotonic() < deadline, "the long sessions never opened"
            await asyncio.sleep(0.2)
        third = cli(tmp_path, "shell", "pi-1", "--", "true")
        assert third.returncode == 255 and b"2 sessions are open on this device (remote.max_sessions)" in third.stderr
        # ... and on pi-2, which takes 4, this operator's fourth session is one too many for the leader
        long.append(cli(tmp_path, "shell", "pi-2", "--", "sleep 120", wait=False))
        while len(open_sessions(db)) < 3:
            assert time.monotonic() < deadline, "the third long session never opened"
            await asyncio.sleep(0.2)
        fourth = cli(tmp_path, "shell", "pi-2", "--", "true")
        assert fourth.returncode == 255 and f"operator {me} has 3 sessions open".encode() in fourth.stderr, fourth
        long.append(cli(tmp_path, "forward", "pi-1", "0:127.0.0.1:1", wait=False))  # (a listener: no session)
        assert long[-1].stdout is not None and long[-1].stdout.readline().startswith(b"forwarding")

        # an operator closes one of the long sessions; its CLI ends with the reason
        sid = open_sessions(db)[0]
        closed = cli(tmp_path, "close", sid)
        assert closed.returncode == 0 and f"closed by {me}".encode() in closed.stdout, closed
        deadline = time.monotonic() + 60
        while not (ended := [p for p in long[:3] if p.poll() is not None]):
            assert time.monotonic() < deadline, "the closed session's CLI never ended"
            await asyncio.sleep(0.2)
        assert [p.returncode for p in ended] == [255]
        assert ended[0].stderr is not None and f"closed by {me}".encode() in ended[0].stderr.read()

        # and a shell still runs
        done = cli(tmp_path, "shell", "pi-2", "--", "echo still served")  # (pi-1 still holds its 2)
        assert (done.returncode, done.stdout) == (0, b"still served\n"), done
        assert leader.poll() is None and worker.poll() is None and other.poll() is None
    finally:
        for proc in long:
            proc.kill()
            proc.communicate()  # (and its pipes closed)
        kill(worker)
        kill(other)
        kill(leader)
