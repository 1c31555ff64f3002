"""The worker's updater does not hold the agent up waiting for the root helper.

With `[firmware] helper_socket` the installer asks the helper for its slots when it is made. A
helper's first start is socket-activated and starts RAUC's service on D-Bus: seconds on a small
device, tens of them on an emulated one (the bench boards, under load). The agent is up
meanwhile (READY sent, the watchdog pinged, messages and heartbeats going); the updater opens
when the helper answers, and says once why it cannot yet.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest
from e2e.agent_support import FLEET, worker

from agent.core.clock import SystemClock
from agent.core.codec import decode, decode_envelope
from agent.protocol import KIND_HEARTBEAT, Heartbeat
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker, MemoryTransport
from agent.worker.env import DeviceEnv
from agent.worker.updating import updater_part
from firmware_rollout.device.helper import HelperInstaller, InstallHelper
from firmware_rollout.device.reboot import CommandRebooter
from firmware_rollout.device.slots import DirectoryInstaller
from rollout_engine.keys import SigningKey


async def until(check: object, what: str) -> None:
    for _ in range(6000):  # (events, polled; a generous bound for a loaded machine)
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_the_worker_runs_while_the_helper_is_away_and_the_updater_opens_when_it_answers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = SigningKey.generate()
    (tmp_path / "public.pem").write_bytes(key.public.to_pem())
    path = tmp_path / "helper.sock"
    clock = SystemClock()
    sections = {"firmware": {"public_key": str(tmp_path / "public.pem"), "helper_socket": str(path)},
                "heartbeat": {"interval_s": 300.0}}  # (the shipped idle cadence)
    broker = MemoryBroker(clock=clock)
    beats: list[Heartbeat] = []

    async def heard(message: InboundMessage) -> None:
        envelope = decode_envelope(message.payload)
        if envelope.kind == KIND_HEARTBEAT:
            beats.append(decode(envelope.payload, Heartbeat))

    spy = MemoryTransport(broker, "spy")
    await spy.subscribe(topics.up(FLEET, "pi-1"), heard)
    await spy.start()
    device = await worker(clock, tmp_path, "pi-1", broker=broker, sections=sections)
    serving: asyncio.Task[None] | None = None
    part = None
    try:
        with caplog.at_level(logging.WARNING, logger="agent.worker.updater_actor"):
            part = await updater_part(device, DeviceEnv())  # nothing listens on the socket yet
            assert part is not None
            await part.start()  # the part is up: the agent sends READY without the helper
            actor = part.actor
            assert actor is not None
            await until(lambda: "does not answer" in actor.not_open, "the updater saying why it is not open")
            assert actor.updater is None
            # what it cannot know yet it does not state: no version of the config file's, no slots
            assert device.firmware_version() == "" and device.slot_state() is None
            await until(lambda: beats, "the first heartbeat")
            assert beats[0].full and beats[0].firmware_version == "" and beats[0].slots is None
            said = [r.getMessage() for r in caplog.records if "updater not open" in r.getMessage()]
            assert len(said) == 1 and str(path) in said[0], said  # once per reason, naming the socket

        # the helper comes up (socket activation, RAUC's service): the updater opens on its next try
        (tmp_path / "helper").mkdir()
        helper = InstallHelper(DirectoryInstaller(tmp_path / "slots", verify_key=key.public),
                               CommandRebooter(["true"]), verify_key=key.public, state_dir=tmp_path / "helper",
                               made_with="1.0.0")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen(4)
        serving = asyncio.create_task(helper.serve(sock))
        await until(lambda: actor.updater is not None, "the updater opened once the helper answered")
        assert actor.not_open == ""
        assert isinstance(actor.updater.installer, HelperInstaller)
        assert actor.updater.status().state == "idle"
        # the slots read: a full heartbeat states them at once, not at the next idle beat (300 s)
        await until(lambda: beats[-1].slots is not None, "a full heartbeat with the slots")
        assert beats[-1].full and beats[-1].firmware_version == actor.updater.active_version != ""
    finally:
        if part is not None and part.actor is not None and part.actor.updater is not None:
            installer = part.actor.updater.installer
            assert isinstance(installer, HelperInstaller)
            installer.close()  # (the process's end closes it on a device)
        if serving is not None:
            serving.cancel()
        await device.stop()
        await spy.stop()
