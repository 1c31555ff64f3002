"""What a device refuses (`agent.worker.remote`), each answered to the leader with its reason and
written to the device's audit file: sessions off by default, a forward to an address its config
does not list, a shell as root without `allow_root`, more than `max_sessions`, an open naming
another device or no session id; a malformed frame is counted, never answered."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent.core.clock import VirtualClock
from agent.core.config import RemoteSection
from agent.remote.frames import Frame, Open, Refused, decode, encode
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker, MemoryTransport
from agent.worker.remote import RemoteSessions

SID = "0123456789abcdef0123456789abcdef"


async def answers(settings: RemoteSection, tmp_path: Path, *opens: Open | bytes) -> list[Frame]:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    device, leader = MemoryTransport(broker, "pi-1"), MemoryTransport(broker, "gw")
    heard: list[Frame] = []

    def on_frame(message: InboundMessage) -> None:
        heard.append(decode(bytes(message.payload)))

    await leader.subscribe(topics.sessions_up_filter("f", "gw"), on_frame)
    sessions = RemoteSessions(settings, transport=device, fleet="f", device_id="pi-1", data_dir=tmp_path)
    for transport in (device, leader):
        await transport.start()
    await sessions.start()
    await clock.settle()
    for frame in opens:
        await leader.publish(topics.session_down("f", "pi-1"), frame if isinstance(frame, bytes) else encode(frame))
        await clock.settle()
    assert not sessions.sessions
    await sessions.stop()
    for transport in (device, leader):
        await transport.stop()
    return heard


def shell(sid: str = SID, device: str = "pi-1") -> Open:
    return Open(sid=sid, device=device, op="shell", argv=("true",), operator="alice", leader="gw")


@pytest.mark.parametrize(("settings", "frame", "reason"), [
    (RemoteSection(), shell(), "remote shells are off on this device (remote.shell)"),
    (RemoteSection(), Open(sid=SID, device="pi-1", op="forward", host="127.0.0.1", port=80, leader="gw"),
     "port forwarding is off on this device (remote.forward)"),
    (RemoteSection(forward=("127.0.0.1:8080",)),
     Open(sid=SID, device="pi-1", op="forward", host="10.0.0.9", port=22, leader="gw"),
     "10.0.0.9:22 is not among the addresses this device forwards to (remote.forward: 127.0.0.1:8080)"),
    (RemoteSection(shell=True, shell_user="no-such-user-here"), shell(), "no user 'no-such-user-here' on this device"),
    (RemoteSection(shell=True), shell(device="pi-2"), "this is pi-1, not pi-2"),
    (RemoteSection(shell=True), shell(sid=""), "a session needs the leader's id for it"),
])
async def test_a_refused_open_is_answered_with_its_reason_and_audited(
        tmp_path: Path, settings: RemoteSection, frame: Open, reason: str) -> None:
    heard = await answers(settings, tmp_path, frame)
    assert len(heard) == 1 and isinstance(heard[0], Refused) and reason in heard[0].reason, heard
    audit = [json.loads(line) for line in (tmp_path / "remote-audit.jsonl").read_text().splitlines()]
    assert [(a["event"], a["operator"] if frame.operator else "") for a in audit] == [
        ("refused", frame.operator)] and reason in audit[0]["reason"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the agent's own user is root only when the tests run as root")
async def test_a_shell_as_root_needs_allow_root(tmp_path: Path) -> None:
    heard = await answers(RemoteSection(shell=True), tmp_path, shell())
    assert isinstance(heard[0], Refused) and "needs remote.allow_root = true" in heard[0].reason


async def test_a_malformed_frame_is_counted_and_not_answered(tmp_path: Path) -> None:
    assert await answers(RemoteSection(shell=True), tmp_path, b"\xc1", b"\x00" * 40_000) == []


@pytest.mark.parametrize(("frame", "target"), [
    (Open(device="pi-1", op="forward", host="10.0.0.7", port=22), "10.0.0.7:22"),
    (Open(device="pi-1", op="shell"), "(login shell)"),
    (Open(device="pi-1", op="shell", argv=("x" * 400, "y" * 400)), "x" * 400 + " " + "y" * 111),
    (Open(device="pi-1", op="logs", since_s=600), "since 600 s, every unit"),
    (Open(device="pi-1", op="logs", units=("app.service",), bundle="b" * 32, offset=5),
     f"since 3600 s, app.service, bundle {'b' * 32} from 5"),
])
def test_what_an_open_opens_reads_the_same_on_the_device_and_the_leader(frame: Open, target: str) -> None:
    """The audit's and the sessions log's `target`: one function of the open frame for both."""
    assert frame.target == target
