"""The root application helper: as its own process on a socket, it installs a bundle beside the
running version and refuses what a compromised agent could ask (a bundle of another user, a
changed or unsigned one, a step with no trial); in-process, its record of each application goes
only forward: a trial is committed or taken back, a committed version never."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from apps_support import app_dir, fleet_key
from otheruser import NOBODY, as_user

from agent.core.clock import SystemClock
from app_rollout.bundle import build_bundle, build_removal, read_head
from app_rollout.device.client import AppHelperClient
from app_rollout.device.helper import AppHelper, AppRecord, AppRequest, encode
from app_rollout.device.systemd import Systemd, UnitState
from app_rollout.errors import AppInstallError
from rollout_engine.keys import SigningKey

REPO = Path(__file__).resolve().parents[2]


class Helper:
    def __init__(self, tmp: Path, socket_dir: Path) -> None:
        self.key, _, public = fleet_key(tmp / "keys")
        self.root = tmp / "apps"
        self.units = tmp / "units"
        self.socket = socket_dir / "apps.sock"  # (a directory another user may enter)
        config = tmp / "installer.toml"
        config.write_text(f'[agent]\ndevice_id = "pi-1"\n\n[firmware]\npublic_key = "{public}"\n'
                          f'helper_user = "nobody"\n\n[apps]\nroot = "{self.root}"\nunit_dir = "{self.units}"\n')
        self.log = (tmp / "helper.log").open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "app", "helper", "--config", str(config),
                                      "--socket", str(self.socket)], cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        while not self.socket.exists():
            assert self.proc.poll() is None, (tmp / "helper.log").read_text()
            time.sleep(0.02)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def helper(tmp_path: Path, open_dir: Path) -> Iterator[Helper]:
    h = Helper(tmp_path, open_dir)
    yield h
    h.close()


async def test_a_bundle_is_installed_beside_with_its_files_and_its_sandboxed_unit(tmp_path: Path,
                                                                                 helper: Helper) -> None:
    bundle = tmp_path / "hello.eaapp"
    build_bundle(app_dir(tmp_path / "hello"), helper.key, bundle)
    client = AppHelperClient(helper.socket, clock=SystemClock())
    reply = await client.ask("install", path=str(bundle))
    assert reply.installed == "hello 1.0.0"
    files = helper.root / "hello" / "1.0.0" / "files"
    assert (files / "bin" / "server").stat().st_mode & 0o7777 == 0o755
    assert (files / "share" / "greeting.txt").read_text() == "hi\n"
    assert (files / "share" / "greeting.txt").stat().st_mode & 0o7777 == 0o644
    unit = (helper.root / "hello" / "1.0.0" / "unit").read_text()
    assert f"ExecStart={files}/bin/server --port 8080" in unit and "DynamicUser=yes" in unit
    assert await client.records() == {}  # installed, not started: no record yet
    # starting needs systemd as PID 1 (tests/board); here systemctl fails and nothing is on record
    with pytest.raises(AppInstallError, match="refused start hello"):
        await client.ask("start", "hello", version="1.0.0")
    client.close()


async def test_what_a_compromised_agent_could_ask_is_refused_and_changes_nothing(tmp_path: Path, helper: Helper,
                                                                                 open_dir: Path) -> None:
    bundle = tmp_path / "hello.eaapp"
    build_bundle(app_dir(tmp_path / "hello"), helper.key, bundle)
    changed = tmp_path / "changed.eaapp"
    data = bytearray(bundle.read_bytes())
    data[-2] ^= 1
    changed.write_bytes(bytes(data))
    client = AppHelperClient(helper.socket, clock=SystemClock())
    with pytest.raises(AppInstallError, match="its sha256 differs from the signed manifest"):
        await client.ask("install", path=str(changed))
    other = tmp_path / "other-key.eaapp"
    build_bundle(app_dir(tmp_path / "other"), fleet_key(tmp_path / "other-keys")[0], other)
    with pytest.raises(AppInstallError, match="not the fleet's key"):
        await client.ask("install", path=str(other))
    with pytest.raises(AppInstallError, match="no version is on trial"):
        await client.ask("revert", "hello")
    with pytest.raises(AppInstallError, match="no version is on trial"):
        await client.ask("commit", "hello")
    with pytest.raises(AppInstallError, match="not installed here"):
        await client.ask("start", "hello", version="9.9.9")
    assert not (helper.root / "hello").exists()
    # the agent's user (nobody here) may install only a file it wrote itself
    os.chmod(helper.socket, 0o666)
    root_owned = open_dir / "root.eaapp"
    root_owned.write_bytes(bundle.read_bytes())
    os.chmod(root_owned, 0o644)

    def install_as_agent() -> bytes:
        import asyncio

        agent = AppHelperClient(helper.socket, clock=SystemClock())
        try:
            asyncio.run(agent.ask("install", path=str(root_owned)))
        except AppInstallError as exc:
            return str(exc).encode()
        return b"installed"

    said = as_user(NOBODY, install_as_agent).decode()
    assert "not the asking user's own" in said, said
    assert not (helper.root / "hello").exists()
    # a stranger gets the reason, not a reset
    reply = helper_raw(helper.socket, encode(AppRequest(op="describe")), uid=12345)
    assert "is not the agent's user" in reply
    client.close()


def helper_raw(path: Path, payload: bytes, *, uid: int) -> str:
    from agent.service.helper_socket import HelperConnection

    def ask() -> bytes:
        conn = HelperConnection(path, helper="application helper", max_frame=1 << 20, timeout_s=10,
                                hint=lambda e: "")
        try:
            return conn.call(payload)
        finally:
            conn.close()

    return as_user(uid, ask).decode(errors="replace")


class RecordingSystemd(Systemd):
    """systemctl's answers for the record's steps where systemd is not PID 1: what was asked, and
    the unit reported as `state_of` says (the board test runs the real one)."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.active = "active"

    async def reload(self) -> None:
        self.asked.append("daemon-reload")

    async def restart(self, unit: str) -> None:
        self.asked.append(f"restart {unit}")

    async def stop(self, unit: str) -> None:
        self.asked.append(f"stop {unit}")

    async def state(self, unit: str) -> UnitState:
        return UnitState(self.active, "running", 0, 1, "success")


class InProcess:
    """The helper in this process on `tmp`'s files with a fresh fleet key, systemctl's answers
    recorded; `ask` returns its refusal ("" when it took the step)."""

    def __init__(self, tmp: Path) -> None:
        self.key = fleet_key(tmp / "keys")[0]
        self.systemd = RecordingSystemd()
        self.helper = AppHelper(key=self.key.public, root=tmp / "apps", unit_dir=tmp / "units", hidden=(),
                                systemd=self.systemd)

    async def ask(self, op: str, name: str = "", **fields: object) -> str:
        reply = await self.helper.handle(encode(AppRequest(op=op, name=name, **fields)), 0)  # type: ignore[arg-type]
        return reply.error


async def test_a_trial_is_committed_or_taken_back_and_a_committed_version_stays(tmp_path: Path) -> None:
    in_process = InProcess(tmp_path)
    key, helper, ask = in_process.key, in_process.helper, in_process.ask
    for version in ("1.0.0", "2.0.0", "3.0.0"):
        bundle = tmp_path / f"hello-{version}.eaapp"
        build_bundle(app_dir(tmp_path / f"hello-{version}", version=version), key, bundle)
        assert await ask("install", path=str(bundle)) == ""
    assert await ask("start", "hello", version="1.0.0") == ""
    assert "1.0.0/files/bin/server" in (tmp_path / "units" / "edge-app-hello.service").read_text()
    assert await ask("commit", "hello") == ""
    assert await ask("start", "hello", version="2.0.0") == ""
    assert "on trial" in await ask("start", "hello", version="3.0.0")
    assert await ask("commit", "hello") == ""
    assert helper.record("hello").current == "2.0.0" and helper.record("hello").previous == "1.0.0"
    assert await ask("start", "hello", version="3.0.0") == ""
    assert await ask("revert", "hello") == ""  # 3.0.0 failed: 2.0.0 runs again
    record = helper.record("hello")
    assert (record.current, record.previous, record.trial) == ("2.0.0", "1.0.0", "")
    assert "2.0.0/files/bin/server" in (tmp_path / "units" / "edge-app-hello.service").read_text()
    assert not (tmp_path / "apps" / "hello" / "3.0.0").exists()
    assert "no version is on trial" in await ask("revert", "hello")  # the committed 2.0.0 stays
    assert "below the committed version 2.0.0" in await ask("install", path=str(tmp_path / "hello-1.0.0.eaapp"))


async def test_only_a_signed_removal_above_the_running_version_removes_an_application(tmp_path: Path) -> None:
    """A removal is signed like a bundle and goes forward like a version: one of another key, of
    another application, at or below the committed version, or replayed is refused; the one that
    is taken stops the unit and removes the versions, keeps the data, and nothing at or below it
    installs again."""
    in_process = InProcess(tmp_path)
    key, systemd, helper, ask = in_process.key, in_process.systemd, in_process.helper, in_process.ask
    for version in ("1.0.0", "2.0.0"):
        build_bundle(app_dir(tmp_path / f"hello-{version}", version=version), key, tmp_path / f"{version}.eaapp")
        assert await ask("install", path=str(tmp_path / f"{version}.eaapp")) == ""
    assert await ask("start", "hello", version="1.0.0") == "" and await ask("commit", "hello") == ""

    def removal(name: str, version: str, signer: SigningKey = key) -> bytes:
        return build_removal(name, version, signer, tmp_path / f"{name}-removed-{version}.eaapp", force=True).head

    assert "not the fleet's key" in await ask("remove", "hello", head=removal("hello", "3.0.0", fleet_key(
        tmp_path / "other")[0]))
    assert "not a removal of hello" in await ask("remove", "hello", head=removal("other", "3.0.0"))
    bundle_head = read_head(tmp_path / "2.0.0.eaapp")
    assert "a bundle of hello 2.0.0, not a removal" in await ask("remove", "hello", head=bundle_head)
    assert "not above its committed version 1.0.0" in await ask("remove", "hello", head=removal("hello", "1.0.0"))
    assert "a removal of hello, not a bundle" in await ask("install", path=str(tmp_path /
                                                                                "hello-removed-1.0.0.eaapp"))
    assert await ask("start", "hello", version="2.0.0") == ""
    assert "2.0.0 is on trial" in await ask("remove", "hello", head=removal("hello", "3.0.0"))
    assert await ask("revert", "hello") == ""
    assert helper.record("hello").current == "1.0.0"  # nothing of the refusals changed it
    assert await ask("remove", "hello", head=removal("hello", "3.0.0")) == ""
    assert not (tmp_path / "units" / "edge-app-hello.service").exists()
    assert systemd.asked[-2:] == ["stop edge-app-hello.service", "daemon-reload"]
    assert [p.name for p in (tmp_path / "apps" / "hello").iterdir()] == ["record.json"]
    assert helper.record("hello") == AppRecord(removed="3.0.0") and not helper.record("hello").installed
    assert "removed at 3.0.0 already" in await ask("remove", "hello", head=removal("hello", "3.0.0"))
    assert "hello was removed at 3.0.0" in await ask("install", path=str(tmp_path / "2.0.0.eaapp"))
    build_bundle(app_dir(tmp_path / "hello-4.0.0", version="4.0.0"), key, tmp_path / "4.0.0.eaapp")
    assert await ask("install", path=str(tmp_path / "4.0.0.eaapp")) == ""
    assert await ask("start", "hello", version="4.0.0") == "" and await ask("revert", "hello") == ""
    assert helper.record("hello") == AppRecord(removed="3.0.0", health="active")  # the floor stays


def test_doctor_asks_the_helper_what_it_keeps_and_names_its_socket_door(tmp_path: Path, helper: Helper) -> None:
    """`doctor`'s apps check describes through the real socket; a worker whose config names a
    socket that is not there, or no fleet key, is refused by `config check` in one line."""
    import grp

    from agent.commands.doctor import _apps
    from agent.commands.preflight import preflight
    from agent.core.config import load_config
    from agent.core.errors import ConfigError

    (helper.root / "hello").mkdir(parents=True)
    (helper.root / "hello" / "record.json").write_text('{"current": "1.0.0", "previous": "", "trial": "2.0.0"}')
    (helper.root / "old").mkdir(parents=True)
    (helper.root / "old" / "record.json").write_text('{"removed": "3.0.0"}')
    public = tmp_path / "keys" / "public.pem"
    worker = tmp_path / "worker.toml"
    text = (f'[agent]\nrole = "worker"\ndevice_id = "pi-1"\nfleet = "f"\ndata_dir = "{tmp_path / "data"}"\n\n'
            f'[mqtt]\nurl = "memory://f"\n\n[firmware]\npublic_key = "{public}"\nhelper_user = "root"\n\n'
            f'[apps]\nhelper_socket = "{helper.socket}"\n')
    worker.write_text(text)
    config = load_config(worker)
    ours = grp.getgrgid(helper.socket.stat().st_gid).gr_name
    said = _apps(config, timeout_s=5.0)
    assert said.ok is False and f"belongs to group {ours!r}, not 'edge-agent-apps'" in said.text
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("agent.commands.doctor._helper_door", lambda *_: "")
        said = _apps(config, timeout_s=5.0)
    assert said.ok is True, said
    assert said.text == (f"the application helper at {helper.socket} keeps 1 application(s): hello 1.0.0"
                         f" (trial 2.0.0) (removed: old at 3.0.0) in {helper.root}")
    assert preflight(worker).apps.helper_socket == str(helper.socket)
    worker.write_text(text.replace(str(helper.socket), str(tmp_path / "absent.sock")))
    with pytest.raises(ConfigError) as absent:
        preflight(worker)
    assert str(absent.value) == (f"{worker}: apps.helper_socket: {tmp_path / 'absent.sock'}: no socket there (is"
                                 " edge-agent-apps.socket enabled?)")
    worker.write_text(text.replace(f'public_key = "{public}"\n', ""))
    with pytest.raises(ConfigError, match="apps.helper_socket: applications are checked with the fleet's key"):
        preflight(worker)


async def test_a_root_file_system_without_the_units_gets_them_back_at_the_helpers_start(tmp_path: Path) -> None:
    """A new slot of an A/B device boots with its own /etc: the applications (on the data
    partition) are there, their units are not; the helper writes and starts them again."""
    in_process = InProcess(tmp_path)
    key, systemd, helper, ask = in_process.key, in_process.systemd, in_process.helper, in_process.ask
    build_bundle(app_dir(tmp_path / "hello"), key, tmp_path / "hello.eaapp")
    assert await ask("install", path=str(tmp_path / "hello.eaapp")) == ""
    assert await ask("start", "hello", version="1.0.0") == "" and await ask("commit", "hello") == ""
    unit = tmp_path / "units" / "edge-app-hello.service"
    written = unit.read_bytes()
    assert await helper.restore() == []  # the unit is there: nothing to do
    unit.unlink()
    systemd.asked.clear()
    assert await helper.restore() == ["hello 1.0.0"]
    assert unit.read_bytes() == written and systemd.asked == ["daemon-reload", "restart edge-app-hello.service"]
