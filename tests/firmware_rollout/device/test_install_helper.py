"""The root install helper as its own process (`edge-agent install-helper`) around the U-Boot
backend on a file-backed board: the agent's updater through it, and the requests a compromised
agent could send straight to its socket, each refused with the slots and the environment
unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from fwhelpers import CountingSource, Keys, RecordingRebooter, ScriptedHealth, make_artifact
from otheruser import NOBODY, as_user
from test_uboot import REPO, Board

from agent.core.clock import SystemClock
from firmware_rollout.artifact.files import read_image_chunk, read_signed_manifest
from firmware_rollout.artifact.manifest import SignedManifest
from firmware_rollout.device.helper import HelperError, HelperInstaller, HelperReply, HelperRequest, frame
from firmware_rollout.device.updater import Updater
from firmware_rollout.errors import ChunkMismatch, UpdaterError
from firmware_rollout.messages import UpdateOffer

pytestmark = pytest.mark.skipif(not Path("/usr/bin/fw_setenv").exists(), reason="needs Debian's libubootenv-tool")


class Helper:
    def __init__(self, tmp: Path, keys: Keys, *, made_with: str = "1.0.0", reboot_timeout_s: float = 0.5,
                 helper_user: str = "edge-agent", socket_dir: Path | None = None,
                 trust_root: Path | None = None, reboot: list[str] | None = None) -> None:
        self.tmp = tmp
        self.board = Board(tmp / "board")
        self.socket = (socket_dir or tmp) / "installer.sock"
        self.rebooted = tmp / "rebooted"
        self.config = tmp / "device.toml"
        self.log = tmp / "helper.log"
        reboot = reboot or [sys.executable, "-c", f"open({str(self.rebooted)!r}, 'a').write('reboot\\n')"]
        self.config.write_text(f"""
[agent]
device_id = "pi-1"
data_dir = "{tmp / 'data'}"
firmware_version = "{made_with}"

[firmware]
{f'trust_root = "{trust_root}"' if trust_root else f'public_key = "{keys.public_path}"'}
installer = "uboot"
helper_state_dir = "{tmp / 'helper-state'}"
helper_group = "no-such-group-here"
helper_user = "{helper_user}"
reboot_command = {json.dumps(reboot)}
reboot_timeout_s = {reboot_timeout_s}

[firmware.uboot]
fw_env_config = "{self.board.config}"
slot_a = "{self.board.slots['A']}"
slot_b = "{self.board.slots['B']}"
cmdline_path = "{self.board.cmdline}"
""")
        self.start()

    def start(self) -> None:
        with self.log.open("ab") as log:  # (the child keeps its own copy of the descriptor)
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


async def test_a_helper_stopped_by_the_reboot_it_ran_is_a_reboot_under_way(tmp_path: Path, keys: Keys) -> None:
    """On the way down systemd stops the helper before it can answer: the agent waits for its own
    end instead of calling the reboot failed at once (and disarming a trial the boot loader is
    about to take); only a device still up after `settle_s` failed to reboot."""
    stops_helper = [sys.executable, "-c", "import os, signal; os.kill(os.getppid(), signal.SIGTERM)"]
    h = Helper(tmp_path, keys, reboot=stops_helper)
    installer = HelperInstaller(h.socket, settle_s=0.5)
    try:
        with pytest.raises(UpdaterError, match=r"the install helper ended while rebooting and the device was still "
                                               r"up 0.5s later"):
            await installer.reboot("trying version 1.1.0 in slot B", trial=True)
    finally:
        installer.close()
        h.stop()


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
    assert b"refused: not a request" in ask(helper.socket, b"\x81\xa2op\xa4wipe")
    assert b"refused: not a request" in ask(helper.socket, msgspec.msgpack.encode({"op": "write_chunk", "x": 1}))
    assert b"ok" in ask(helper.socket, msgspec.msgpack.encode(HelperRequest(op="describe")))
    assert helper.untouched() == before
    assert helper.proc.poll() is None  # and it is still serving


def versioned(tmp: Path, keys: Keys, version: str, label: str = "", **kwargs: object) -> tuple[Path, SignedManifest]:
    where = tmp / f"artifact-{version}{label}"
    where.mkdir()
    return make_artifact(where, keys.signing, version=version, **kwargs)


async def write_and_check(installer: HelperInstaller, artifact: Path, signed: SignedManifest, slot: str) -> None:
    await installer.open_slot(slot, signed.raw)
    for index in range(signed.manifest.chunk_count):
        await installer.write_chunk(slot, index, read_image_chunk(artifact, signed, index))
    await installer.check_slot(slot)


async def test_the_helper_refuses_an_older_image_unless_a_signed_rollback_names_the_booted_version(
        tmp_path: Path, keys: Keys, helper: Helper) -> None:
    """H1. A compromised agent skips the updater's own version check and asks the helper directly:
    on a device made with 1.0.0, a correctly signed 0.9.0 is refused, and so is a rollback signed
    for another version or for none; a rollback signed to replace 1.0.0 is taken."""
    before = helper.untouched()
    installer = HelperInstaller(helper.socket)
    try:
        _, older = versioned(tmp_path, keys, "0.9.0")
        with pytest.raises(HelperError, match="downgrade refused: image version 0.9.0 is lower than installed 1.0.0"):
            await installer.open_slot("B", older.raw)
        _, elsewhere = versioned(tmp_path, keys, "0.9.0", "-r1", rollback=True, rollback_from=["0.9.5"])
        with pytest.raises(HelperError, match="replaces only version 0.9.5, this device runs 1.0.0"):
            await installer.open_slot("B", elsewhere.raw)
        _, unnamed = versioned(tmp_path, keys, "0.9.0", "-r2", rollback=True)
        with pytest.raises(HelperError, match="does not name the versions it replaces"):
            await installer.open_slot("B", unnamed.raw)
        assert helper.untouched() == before
        artifact, allowed = versioned(tmp_path, keys, "0.9.0", "-r3", rollback=True, rollback_from=["1.0.0"])
        await write_and_check(installer, artifact, allowed, "B")
        assert installer.describe()["helper_records"] == {"A": {"state": "booted", "version": "1.0.0"},
                                                          "B": {"state": "checked", "version": "0.9.0"}}
    finally:
        installer.close()
    assert "refused open_slot of slot B: downgrade refused" in helper.log.read_text()


async def trial_boot(tmp: Path, keys: Keys, helper: Helper, version: str, slot: str) -> HelperInstaller:
    """`version` written, checked and put on trial in `slot`, the board booted into it and the
    helper started again: a connection to it."""
    artifact, signed = versioned(tmp, keys, version)
    installer = HelperInstaller(helper.socket)
    await write_and_check(installer, artifact, signed, slot)
    await installer.mark_trial(slot)
    installer.close()
    helper.stop()
    assert helper.board.boot() == slot
    helper.start()
    return HelperInstaller(helper.socket)


async def test_the_helper_takes_the_booted_version_from_what_it_wrote_not_from_the_agent(
        tmp_path: Path, keys: Keys, helper: Helper) -> None:
    """After a trial boot into 1.1.0 the helper's floor is 1.1.0, whatever config says the device
    was made with: 1.0.5 is refused for the other slot."""
    installer = await trial_boot(tmp_path, keys, helper, "1.1.0", "B")
    try:
        assert installer.booted_slot() == "B"
        assert installer.describe()["helper_records"] == {"A": {"state": "booted", "version": "1.0.0"},
                                                          "B": {"state": "booted", "version": "1.1.0"}}
        _, between = versioned(tmp_path, keys, "1.0.5")
        with pytest.raises(HelperError, match="lower than installed 1.1.0"):
            await installer.open_slot("A", between.raw)
        await installer.revert("A")  # the slot it booted before: a known image, may be the default again
    finally:
        installer.close()


async def test_the_helper_makes_the_default_only_a_checked_or_the_booted_slot(tmp_path: Path, keys: Keys,
                                                                              helper: Helper) -> None:
    """H2. `revert` or `commit` of a slot never written, or written and not read back, is refused
    with the environment untouched; the booted slot and a checked one are taken; a U-Boot revert
    leaves a committed slot's boot attempts alone."""
    env = helper.board.printenv()
    installer = HelperInstaller(helper.socket)
    try:
        with pytest.raises(HelperError, match="refusing to make slot B the default: this helper never wrote"):
            await installer.revert("B")
        with pytest.raises(HelperError, match="refusing to make slot B the default"):
            await installer.commit("B")
        artifact, newer = versioned(tmp_path, keys, "1.1.0")
        await installer.open_slot("B", newer.raw)
        await installer.write_chunk("B", 0, read_image_chunk(artifact, newer, 0))
        with pytest.raises(HelperError, match=r"its image \(1.1.0\) was not read back and checked"):
            await installer.commit("B")
        assert helper.board.printenv() == env
        await installer.commit("A")  # the booted slot: always
        await write_and_check(installer, artifact, newer, "B")
        await installer.commit("B")
        assert (helper.board.printenv()["BOOT_ORDER"], helper.board.printenv()["BOOT_B_LEFT"]) == ("B A", "3")
        await installer.revert("A")
        after = helper.board.printenv()
        assert (after["BOOT_ORDER"], after["BOOT_A_LEFT"], after["BOOT_B_LEFT"]) == ("A B", "3", "3")
    finally:
        installer.close()


async def test_idle_connections_do_not_lock_the_agent_out_of_its_helper(helper: Helper) -> None:
    """M5. Eight idle connections of the agent's user: each newcomer at the bound closes that user's
    longest-idle one; the agent's kept connection, closed so, is opened again for its next step."""
    installer = HelperInstaller(helper.socket)
    hoard = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(8)]
    try:
        for s in hoard:
            s.connect(str(helper.socket))
        assert await installer.read_slot("A", 0, 4) == bytes(4)
        HelperInstaller(helper.socket).close()
        assert b"ok" in ask(helper.socket, msgspec.msgpack.encode(HelperRequest(op="describe")))
    finally:
        installer.close()
        for s in hoard:
            s.close()


async def test_a_reboot_under_way_holds_no_lock(tmp_path: Path, keys: Keys) -> None:
    """M5. While the reboot command settles, `describe` is answered and every slot step refused
    with the reason (before, the helper's lock was held for the whole settle time)."""
    h = Helper(tmp_path, keys, reboot_timeout_s=600)
    rebooting = HelperInstaller(h.socket, settle_s=0.1)  # (the helper stopped at the end: a reboot under way)
    task = asyncio.create_task(rebooting.reboot("trying version 1.1.0 in slot B", trial=True))
    try:
        deadline = time.monotonic() + 60
        while not h.rebooted.exists():
            assert time.monotonic() < deadline and not task.done(), "the reboot command did not run"
            await asyncio.sleep(0.02)
        other = HelperInstaller(h.socket)
        assert other.booted_slot() == "A"
        with pytest.raises(HelperError, match="a reboot is under way"):
            await other.commit("A")
        other.close()
    finally:
        h.stop()
        with contextlib.suppress(UpdaterError):
            await task
        rebooting.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a client as another user")
def test_a_process_of_another_user_gets_the_reason_not_a_reset(tmp_path: Path, keys: Keys, open_dir: Path) -> None:
    """M4. The helper answers root and the agent's user (here `daemon`) only, whatever group a
    process is in: one of another user that can open the socket is told why it is refused."""
    h = Helper(tmp_path, keys, helper_user="daemon", socket_dir=open_dir)
    try:
        h.socket.chmod(0o666)  # as if the process were in the socket's group
        describe = msgspec.msgpack.encode(HelperRequest(op="describe"))
        reply = msgspec.msgpack.decode(as_user(NOBODY, lambda: ask(h.socket, describe)), type=HelperReply)
        assert not reply.ok and reply.error.startswith("refused: uid 65534 is not the agent's user"), reply
        HelperInstaller(h.socket).close()  # root is answered
    finally:
        h.stop()
    assert "uid 65534 is not the agent's user" in h.log.read_text()


def test_a_helper_that_does_not_answer_is_named_with_what_to_look_at(tmp_path: Path) -> None:
    with pytest.raises(HelperError, match=r"the install helper at .*absent.sock does not answer \(No such file or "
                                          r"directory\): is edge-agent-installer.socket enabled\?"):
        HelperInstaller(tmp_path / "absent.sock")


def test_install_helper_check_says_what_it_would_run_and_who_may_ask(tmp_path: Path, keys: Keys) -> None:
    """`install-helper --check` on the helper's own config: its backend read from the board, the
    one user it answers besides root, and a missing socket group named (exit 1); nothing served."""
    h = Helper(tmp_path, keys, helper_user="daemon")
    h.stop()
    done = subprocess.run([sys.executable, "-m", "agent.cli", "install-helper", "--config", str(h.config), "--check"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120,
                          check=False)
    assert done.returncode == 1, done.stderr
    assert "backend: uboot: slots A/B, booted A, default A" in done.stdout
    assert "answers: root and daemon (uid 1)" in done.stdout
    assert "socket group: no group 'no-such-group-here'" in done.stdout


def test_config_check_knows_the_helpers_own_config(tmp_path: Path, keys: Keys, capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    """`config check installer.toml` checks it as the helper's config (its backend, its user and
    group, its key), not as a worker's; a worker's config is still checked as a worker's."""
    from agent.cli import main as cli

    h = Helper(tmp_path, keys, helper_user="daemon")
    h.stop()
    text = h.config.read_text()
    assert cli(["config", "check", str(h.config)]) == 2  # its socket group does not exist here
    assert "firmware.helper_group: no group 'no-such-group-here'" in capsys.readouterr().err
    h.config.write_text(text.replace('helper_group = "no-such-group-here"', 'helper_group = "daemon"'))
    assert cli(["config", "check", str(h.config)]) == 0
    out = capsys.readouterr().out
    assert "ok (the install helper's own config: the uboot backend, answers root and daemon, socket group daemon" in out
    h.config.write_text(text.replace('helper_group = "no-such-group-here"', 'helper_group = "daemon"')
                        .replace('helper_user = "daemon"', 'helper_user = "nobody-by-that-name"'))
    assert cli(["config", "check", str(h.config)]) == 2
    assert "firmware.helper_user: no user 'nobody-by-that-name'" in capsys.readouterr().err


async def test_a_helper_on_a_trust_root_takes_only_documents_its_own_root_signed(tmp_path: Path, keys: Keys) -> None:
    from rollout_engine.keys import SigningKey
    from rollout_engine.trust import TrustedKeys, make_trust_document

    root, stranger = SigningKey.generate(), SigningKey.generate()
    (tmp_path / "root.pem").write_bytes(root.public.to_pem())
    now = int(time.time() * 1000)

    def trust(version: int, signer: SigningKey) -> bytes:
        return make_trust_document(version=version, roots=[root.public], keys=[(keys.verify, now + 86_400_000)],
                                   signers=[signer], issued_ms=now)

    h = Helper(tmp_path, keys, trust_root=tmp_path / "root.pem")
    try:
        artifact, signed = versioned(tmp_path, keys, "1.1.0")
        forged = HelperInstaller(h.socket, trust=lambda: trust(1, stranger))  # an agent carrying a forged document
        with pytest.raises(HelperError, match="not signed by a trusted root"):
            await forged.open_slot("B", signed.raw)
        forged.close()
        bare = HelperInstaller(h.socket)  # no document yet: the helper knows no signing key
        with pytest.raises(HelperError, match="no trust document is held yet"):
            await bare.open_slot("B", signed.raw)
        bare.close()
        agent_keys = TrustedKeys([root.public], now_ms=lambda: now)
        agent_keys.accept(trust(1, root))
        installer = HelperInstaller(h.socket, trust=lambda: agent_keys.document.raw)  # type: ignore[union-attr]
        await write_and_check(installer, artifact, signed, "B")
        installer.close()
        assert (tmp_path / "helper-state" / "trust" / "trust.json").exists()  # kept in the helper's own state
        agent_keys.accept(trust(2, root))
        newer = HelperInstaller(h.socket, trust=lambda: agent_keys.document.raw)  # type: ignore[union-attr]
        await newer.open_slot("B", signed.raw)
        newer.close()
        older = HelperInstaller(h.socket, trust=lambda: trust(1, root))  # an agent going back to v1, sent straight
        with pytest.raises(HelperError, match=r"trust document v1 is not newer than the one held \(v2\)"):
            await older.open_slot("B", signed.raw)
        older.close()
    finally:
        h.stop()


async def test_after_a_commit_the_helper_refuses_the_older_slot_unless_a_signed_rollback_is_there(
        tmp_path: Path, keys: Keys, helper: Helper) -> None:
    """F4. 1.1.0 booted on trial may be reverted to 1.0.0; once the helper committed it, `revert A`
    and `mark_trial A` of the 1.0.0 it replaced are refused with the environment untouched (a
    compromised agent cannot undo a fix), until a rollback signed to replace 1.1.0 is written there."""
    installer = await trial_boot(tmp_path, keys, helper, "1.1.0", "B")
    try:
        with pytest.raises(HelperError, match="running system booted from it"):
            await installer.mark_trial("B")
        await installer.commit("B")
        env = helper.board.printenv()
        for step in (installer.revert, installer.mark_trial):
            with pytest.raises(HelperError, match="it holds 1.0.0, older than the committed 1.1.0"):
                await step("A")
        assert helper.board.printenv() == env
        rollback, signed = versioned(tmp_path, keys, "1.0.1", rollback=True, rollback_from=["1.1.0"])
        await write_and_check(installer, rollback, signed, "A")
        await installer.mark_trial("A")
    finally:
        installer.close()
    assert "refused revert of slot A: refusing to make slot A the default" in helper.log.read_text()


def test_a_helper_whose_backend_cannot_start_answers_why_and_tries_again(tmp_path: Path, keys: Keys) -> None:
    """On a booted board RAUC's service may not answer yet (or not be installed): the helper does
    not end at once (systemd's start limit would then fail its socket for good, and the agent
    would only see a refused connection); it answers every request with the reason for a while,
    then ends, so the next request starts it afresh."""
    config = tmp_path / "installer.toml"
    config.write_text(f"""
[agent]
device_id = "pi-1"
firmware_version = "1.0.0"

[firmware]
public_key = "{keys.public_path}"
installer = "rauc"
helper_state_dir = "{tmp_path / 'helper-state'}"
helper_user = "root"

[firmware.rauc]
rauc = "/bin/false"
""")
    sock = tmp_path / "installer.sock"
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "install-helper", "--config", str(config),
                             "--socket", str(sock)], env={**os.environ, "PYTHONPATH": str(REPO)},
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # until the helper listens (a missing socket is not yet its answer)
            try:
                HelperInstaller(sock)
            except HelperError as exc:
                if "cannot start" in str(exc):
                    assert "the install helper refused describe: the rauc installer cannot start: /bin/false " \
                           "status --output-format=json exited 1" in str(exc), exc
                    break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the helper did not answer"
            time.sleep(0.05)
        with pytest.raises(HelperError, match="cannot start"):  # every request, not only the first
            HelperInstaller(sock)
        assert proc.poll() is None  # it lingers, answering
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=30)
    assert "the rauc installer cannot start" in err
