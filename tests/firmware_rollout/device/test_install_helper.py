"""The root install helper as its own process (`edge-agent install-helper`) around the U-Boot
backend on a file-backed board: the agent's updater through it, and the requests a compromised
agent could send straight to its socket, each refused with the slots and the environment
unchanged."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fwhelpers import CountingSource, Keys, RecordingRebooter, ScriptedHealth, make_artifact
from test_uboot import REPO, Board

from agent.core.clock import SystemClock
from firmware_rollout.artifact.files import read_image_chunk, read_signed_manifest
from firmware_rollout.device.helper import HelperError, HelperInstaller, HelperRequest, frame
from firmware_rollout.device.updater import Updater
from firmware_rollout.errors import ChunkMismatch, UpdaterError
from firmware_rollout.messages import UpdateOffer

pytestmark = pytest.mark.skipif(not Path("/usr/bin/fw_setenv").exists(), reason="needs Debian's libubootenv-tool")


class Helper:
    def __init__(self, tmp: Path, keys: Keys) -> None:
        self.board = Board(tmp / "board")
        self.socket = tmp / "installer.sock"
        self.rebooted = tmp / "rebooted"
        self.config = tmp / "device.toml"
        self.log = tmp / "helper.log"
        reboot = [sys.executable, "-c", f"open({str(self.rebooted)!r}, 'a').write('reboot\\n')"]
        self.config.write_text(f"""
[agent]
device_id = "pi-1"
data_dir = "{tmp / 'data'}"

[firmware]
public_key = "{keys.public_path}"
installer = "uboot"
helper_state_dir = "{tmp / 'helper-state'}"
helper_group = "no-such-group-here"
reboot_command = {json.dumps(reboot)}
reboot_timeout_s = 0.5

[firmware.uboot]
fw_env_config = "{self.board.config}"
slot_a = "{self.board.slots['A']}"
slot_b = "{self.board.slots['B']}"
cmdline_path = "{self.board.cmdline}"
""")
        with self.log.open("wb") as log:  # (the child keeps its own copy of the descriptor)
            self.proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "install-helper", "--config",
                                          str(self.config), "--socket", str(self.socket)],
                                         env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=log)
        deadline = time.monotonic() + 60
        while True:
            try:
                HelperInstaller(self.socket).close()
                break
            except HelperError:
                assert self.proc.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, "the helper did not come up"
                time.sleep(0.05)

    def untouched(self) -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in (self.board.env, *self.board.slots.values())}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def helper(tmp_path: Path, keys: Keys) -> Iterator[Helper]:
    h = Helper(tmp_path, keys)
    try:
        yield h
    finally:
        h.stop()


async def test_an_update_through_the_helper_writes_the_slot_and_arms_uboot(tmp_path: Path, keys: Keys,
                                                                           helper: Helper) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    source = CountingSource(artifact)
    installer = HelperInstaller(helper.socket)
    assert (installer.name, installer.booted_slot(), installer.default_slot()) == ("uboot", "A", "A")
    rebooter = RecordingRebooter()
    updater = await Updater.open(tmp_path / "agent-state", device_id="pi-1", verify_key=keys.verify,
                                 clock=SystemClock(), health=ScriptedHealth(True), rebooter=rebooter,
                                 installer=installer, hardware="rpi4", initial_version="1.0.0")
    report = await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
    await updater.close()
    installer.close()
    assert report.state == "rebooting", report.detail
    image = (tmp_path / "image-1.1.0-1.bin").read_bytes()
    assert helper.board.slots["B"].read_bytes()[:len(image)] == image
    env = helper.board.printenv()
    assert (env["BOOT_ORDER"], env["EA_TRIAL"]) == ("B A", "B")


async def test_the_helper_reads_the_booted_slot_for_a_delta_within_its_bounds(helper: Helper) -> None:
    """A delta copies chunks from the active slot: the unprivileged agent reads it through the
    helper, which bounds the read (a chunk at most) and knows only its own slots."""
    helper.board.slots["A"].write_bytes(bytes(range(256)) * 4096)
    installer = HelperInstaller(helper.socket)
    try:
        assert await installer.read_slot("A", 1000, 300) == (bytes(range(256)) * 4096)[1000:1300]
        with pytest.raises(HelperError, match="length"):
            await installer.read_slot("A", 0, 17 * 1024 * 1024)  # beyond a chunk: refused by the helper
        with pytest.raises(HelperError, match="no slot"):
            await installer.read_slot("C", 0, 10)
    finally:
        installer.close()


async def test_the_helper_reboots_and_a_reboot_that_does_not_happen_is_an_error(helper: Helper) -> None:
    installer = HelperInstaller(helper.socket)
    with pytest.raises(UpdaterError, match="exited 0 but the device was still up"):
        await installer.reboot("trying version 1.1.0 in slot B", trial=True)
    installer.close()
    assert helper.rebooted.read_text() == "reboot\n"  # the helper ran the reboot command


def ask(path: Path, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sock.sendall(frame(payload))
        head = sock.recv(4)
        body = b""
        while len(body) < int.from_bytes(head, "big"):
            body += sock.recv(65536)
        return body


async def test_the_helper_refuses_what_a_compromised_agent_could_ask(tmp_path: Path, keys: Keys,
                                                                      helper: Helper) -> None:
    artifact, signed = make_artifact(tmp_path, keys.signing)
    (tmp_path / "u").mkdir()
    unsigned, _ = make_artifact(tmp_path / "u", None)
    before = helper.untouched()
    installer = HelperInstaller(helper.socket)
    with pytest.raises(HelperError, match="unsigned"):
        await installer.open_slot("B", read_signed_manifest(unsigned).raw)
    with pytest.raises(HelperError, match="no slot 'C' here"):
        await installer.open_slot("C", signed.raw)
    with pytest.raises(HelperError, match="running system booted from it"):
        await installer.open_slot("A", signed.raw)
    await installer.open_slot("B", signed.raw)
    good = read_image_chunk(artifact, signed, 0)
    with pytest.raises(ChunkMismatch, match="tampered chunk"):
        await installer.write_chunk("B", 0, b"\x00" * len(good))  # bytes the manifest does not vouch for
    with pytest.raises(ChunkMismatch, match="tampered chunk"):
        await installer.write_chunk("B", 0, good[:-1])
    with pytest.raises(HelperError, match="not written and checked"):
        await installer.mark_trial("B")  # arming a slot whose image it never read back
    assert helper.untouched() == before  # not a byte of a slot, not a variable of the environment
    installer.close()
    # what is not a request at all, on the raw socket
    import msgspec

    assert b"refused: not a request" in ask(helper.socket, b"\x81\xa2op\xa4wipe")
    assert b"refused: not a request" in ask(helper.socket, msgspec.msgpack.encode({"op": "write_chunk", "x": 1}))
    assert b"ok" in ask(helper.socket, msgspec.msgpack.encode(HelperRequest(op="describe")))
    assert helper.untouched() == before
    # a client hoarding connections gets no more than the bound, and the agent's next one works again
    hoard = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(8)]
    for s in hoard:
        s.connect(str(helper.socket))
    with pytest.raises(HelperError):
        HelperInstaller(helper.socket)
    for s in hoard:
        s.close()
    deadline = time.monotonic() + 60
    while True:
        try:
            HelperInstaller(helper.socket).close()
            break
        except HelperError:
            assert time.monotonic() < deadline, "the helper did not free its connections"
            time.sleep(0.05)
    assert helper.proc.poll() is None  # and it is still serving
