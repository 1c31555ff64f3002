"""The application helper: the one process on a device that installs, starts, checks and takes
back applications, so the agent itself stays unprivileged.

It runs as root (`edge-agent-apps.service`, socket-activated on a Unix socket only the agent's
user may open; `agent.service.helper_socket`) with its own copy of the fleet's key, and does
exactly these steps:

    describe                  every application it keeps: the version running, the one kept
                              to go back to, the one on trial
    install PATH              a bundle file the agent downloaded: taken only when it belongs to
                              the asking user; copied, its signature checked with the helper's
                              own key, its unit checked, each file checked as it is written to
                              ROOT/NAME/VERSION (beside the running version)
    start NAME VERSION        that installed version on trial: its unit written and started
    state NAME                the unit's state (active, restarts) for the agent's health check
    check NAME                the bundle's health command, run as the application runs
    commit NAME               the trial kept: the version before it kept to go back to, older ones removed
    revert NAME               the trial taken back: the version before it started again (or none)
    remove NAME HEAD          a signed removal of NAME (`app removal`) above its committed
                              version: stopped, its unit and versions removed, its data kept,
                              the removal's version on record (nothing at or below it installs)

It refuses anything else: an unsigned or tampered bundle, a file another user wrote, a unit that
asks for more than an application may (`app_rollout.unit`), a version below the committed one
(an application goes forward; an old content comes back as a new version), a start while another
trial runs, a revert or commit with no trial (so a compromised agent cannot undo a committed
fix), a name it does not keep. Each application's record (`record.json`) is written atomically
before the step it allows: a power cut leaves the trial on record, and the agent's next start
checks it again or takes it back. A removal is signed like a bundle, so a compromised agent can
no more remove an application than install one, nor replay an old removal after a reinstall.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from agent.core.clock import Clock, SystemClock
from agent.core.errors import EdgeAgentError
from agent.core.files import atomic_write
from agent.core.tasks import in_thread
from agent.service.helper_socket import HelperSocketServer
from app_rollout.bundle import BUNDLE_MAX, SignedApp, iter_files, read_head, verify_head
from app_rollout.container import device_architecture, render_container_unit
from app_rollout.device.containers import Containers
from app_rollout.device.fetch import KEEP_FREE, check_room
from app_rollout.device.systemd import Systemd, UnitState
from app_rollout.errors import AppBundleError, AppInstallError
from app_rollout.unit import render_unit, service_name
from rollout_engine.keys import Verifier
from rollout_engine.trust import take_trust_document
from rollout_engine.version import Version

log = logging.getLogger(__name__)

HELPER = "application helper"
MAX_FRAME = 128 * 1024
REMOVAL_MAX = 4 * 1024  # a removal's signed head: a manifest with no unit and no file
Op = Literal["describe", "install", "start", "state", "check", "commit", "revert", "remove"]
Name = Annotated[str, msgspec.Meta(pattern=r"^([a-z0-9][a-z0-9-]{0,39})?$")]  # ("" for describe, install)


class AppRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    op: Op
    name: Name = ""
    version: Annotated[str, msgspec.Meta(max_length=64)] = ""
    path: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    # install: the agent's newest trust document; taken only when the helper's own root signed it
    trust: Annotated[bytes, msgspec.Meta(max_length=64 * 1024)] = b""
    # remove: the signed head of the removal (checked with the helper's own key)
    head: Annotated[bytes, msgspec.Meta(max_length=REMOVAL_MAX)] = b""


class AppRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One application as the helper keeps it (`ROOT/NAME/record.json`)."""

    current: str = ""  # the committed version ("" none yet)
    previous: str = ""  # the version kept to go back to
    trial: str = ""  # the version started and not yet committed
    health: str = "active"  # the trial's (or current's) health check: active, http, command
    removed: str = ""  # the version of the removal that took it away (nothing at or below it installs)

    @property
    def installed(self) -> bool:
        return bool(self.current or self.trial)


class AppReply(msgspec.Struct, kw_only=True, frozen=True):
    ok: bool
    error: str = ""
    apps: dict[str, AppRecord] = {}
    root: str = ""  # describe: where the helper keeps each version (ROOT/NAME/VERSION/files, readable)
    installed: str = ""  # install: NAME VERSION of the bundle taken
    active: str = ""  # state: ActiveState
    sub: str = ""
    restarts: int = 0
    since_us: int = 0
    result: str = ""
    status: int = 0  # state: the main process's last exit code
    exit_code: int = 0  # check: the health command's
    output: str = ""


encode = msgspec.msgpack.Encoder().encode
decode_request = msgspec.msgpack.Decoder(AppRequest).decode
decode_reply = msgspec.msgpack.Decoder(AppReply).decode


def _refusal(reason: str) -> bytes:
    return encode(AppReply(ok=False, error=reason))


class AppHelper:
    """Keeps applications under `root`, their units in `unit_dir`; checks bundles with `key`.
    `hidden`: the paths no application may see. `allowed_uids`: who besides root may ask."""

    def __init__(self, *, key: Verifier, root: Path, unit_dir: Path, hidden: tuple[str, ...],
                 allowed_uids: frozenset[int] = frozenset(), systemd: Systemd | None = None,
                 durable: bool = True, clock: Clock | None = None, keep_free: int = KEEP_FREE,
                 containers: Containers | None = None) -> None:
        self.key = key
        self.clock = clock or SystemClock()  # (a virtual one runs the file work inline: the simulator's)
        self.durable = durable  # (the simulator's devices share one disk: no sync of it per install)
        self.root = root
        self.unit_dir = unit_dir
        self.hidden = hidden
        self.keep_free = keep_free  # what an install leaves free on the disk of `root`
        self.systemd = systemd or Systemd()
        self.containers = containers or Containers()
        self._lock = asyncio.Lock()
        root.mkdir(parents=True, exist_ok=True, mode=0o755)
        self.server = HelperSocketServer(self._answer, _refusal, helper=HELPER, max_frame=MAX_FRAME,
                                         allowed_uids=allowed_uids)

    async def serve(self, sock: object) -> None:
        async with self._lock:
            await self.restore()
        await self.server.serve(sock)  # type: ignore[arg-type]

    async def restore(self) -> list[str]:
        """At the helper's start: each application's unit written again where the root file
        system booted lacks it, or holds another version's (a new slot of an A/B device: the
        applications and their data live on the data partition, the units in the slot's /etc), and
        started. What it restored, as "name version"."""
        restored = []
        for name, record in self.records().items():
            version = record.trial or record.current
            if not version:
                continue
            try:
                wanted = (self._version_dir(name, version) / "unit").read_bytes()
                unit = self.unit_dir / self.unit_name(name)
                if unit.is_file() and unit.read_bytes() == wanted:
                    continue
                await self._run_unit(name, version)
            except (OSError, EdgeAgentError) as exc:
                log.warning("%s %s: its unit could not be restored: %s", name, version, exc)
                continue
            restored.append(f"{name} {version}")
            log.info("restored the unit of %s %s (this root file system lacked it)", name, version)
        return restored

    async def _answer(self, payload: bytes, uid: int) -> bytes:
        return encode(await self.handle(payload, uid))

    async def handle(self, payload: bytes, uid: int) -> AppReply:
        try:
            request = decode_request(payload)
        except msgspec.DecodeError as exc:
            self.server.refused += 1
            return AppReply(ok=False, error=f"refused: not a request ({exc})")
        try:
            async with self._lock:
                return await self._do(request, uid)
        except (EdgeAgentError, OSError) as exc:
            self.server.refused += 1
            log.warning("refused %s %s: %s", request.op, request.name or "-", exc)
            return AppReply(ok=False, error=str(exc), apps=self.records())

    # -- records -------------------------------------------------------------------------------
    def records(self) -> dict[str, AppRecord]:
        found: dict[str, AppRecord] = {}
        for path in sorted(self.root.glob("*/record.json")):
            try:
                found[path.parent.name] = msgspec.json.decode(path.read_bytes(), type=AppRecord)
            except (OSError, msgspec.DecodeError):
                log.warning("%s: unreadable: the application is left as it is", path)
        return found

    def record(self, name: str) -> AppRecord:
        path = self.root / name / "record.json"
        try:
            return msgspec.json.decode(path.read_bytes(), type=AppRecord)
        except FileNotFoundError:
            return AppRecord()
        except (OSError, msgspec.DecodeError) as exc:
            raise AppInstallError(f"{path}: unreadable ({exc})") from None

    def _keep(self, name: str, record: AppRecord) -> None:
        atomic_write(self.root / name / "record.json", msgspec.json.encode(record), mode=0o644)

    def _version_dir(self, name: str, version: str) -> Path:
        Version.parse(version)  # (also: no path in it)
        return self.root / name / version

    def unit_name(self, name: str) -> str:
        return service_name(name)

    # -- steps ---------------------------------------------------------------------------------
    async def _do(self, r: AppRequest, uid: int) -> AppReply:
        if r.op == "describe":
            return AppReply(ok=True, apps=self.records(), root=str(self.root))
        if r.op == "install":
            take_trust_document(self.key, r.trust, came_with="the agent's install request")
            app = await in_thread(self.clock, self._install, r.path, uid)
            return AppReply(ok=True, installed=f"{app.name} {app.version}", apps=self.records())
        if not r.name:
            raise AppInstallError(f"{r.op}: which application? (name)")
        record = self.record(r.name)
        if r.op == "start":
            await self._start(r.name, r.version, record)
        elif r.op == "state":
            state = await self.systemd.state(self.unit_name(r.name))
            return _state_reply(state, self.records())
        elif r.op == "check":
            return await self._check(r.name, record)
        elif r.op == "commit":
            await self._commit(r.name, record)
        elif r.op == "revert":
            await self._revert(r.name, record)
        else:
            await self._remove(r.name, r.head, record)
        return AppReply(ok=True, apps=self.records())

    def _install(self, path: str, uid: int) -> SignedApp:
        """The bundle at `path` (the asking user's own file) copied, verified and unpacked."""
        incoming = self.root / ".incoming"
        incoming.mkdir(exist_ok=True, mode=0o700)
        copy = incoming / uuid.uuid4().hex
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise AppInstallError(f"install {path}: {exc.strerror or exc}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise AppInstallError(f"install {path}: not a regular file")
            if uid != 0 and info.st_uid != uid:
                raise AppInstallError(f"install {path}: the file is not the asking user's own (owner uid"
                                      f" {info.st_uid}): the helper takes only a bundle the agent downloaded")
            if info.st_size > BUNDLE_MAX:
                raise AppInstallError(f"install {path}: {info.st_size} bytes, over {BUNDLE_MAX}")
            # its copy, then its files beside the running version
            check_room(self.root, 2 * info.st_size, self.keep_free, what=f"install {path}")
            with os.fdopen(fd, "rb", closefd=False) as src, copy.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)  # checked from here on: the agent may change its file
        finally:
            os.close(fd)
        try:
            return self._unpack(copy, source=path)
        finally:
            copy.unlink(missing_ok=True)

    def _unpack(self, copy: Path, *, source: str) -> SignedApp:
        try:
            head = read_head(copy)
            app = verify_head(head, self.key, source=source)
        except AppBundleError as exc:
            raise AppInstallError(str(exc).replace(str(copy), source)) from None
        m = app.manifest
        if m.runtime == "removed":
            raise AppInstallError(f"install {source}: a removal of {m.name}, not a bundle to install")
        record = self.record(m.name)
        if record.removed and Version.parse(m.version) <= Version.parse(record.removed):
            raise AppInstallError(f"install {m.name} {m.version}: {m.name} was removed at {record.removed} (it comes"
                                  " back as a version above that)")
        if record.current and Version.parse(m.version) < Version.parse(record.current):
            raise AppInstallError(f"install {m.name} {m.version}: below the committed version {record.current} (an"
                                  " application goes forward: an old content comes back as a new version)")
        target = self._version_dir(m.name, m.version)
        if (target / "head").exists():
            if (target / "head").read_bytes() == app.head:
                return app  # installed already
            raise AppInstallError(f"install {m.name} {m.version}: another bundle of that version is installed")
        partial = target.with_name(f".{m.version}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        files = partial / "files"
        files.mkdir(parents=True, mode=0o755)
        size = copy.stat().st_size
        if size != app.size:
            raise AppInstallError(f"{source}: {size} bytes, the manifest says {app.size}")
        try:
            with copy.open("rb") as f:
                f.seek(len(head))
                for entry, blocks in iter_files(f, m, source=source):
                    out = files / entry.path
                    out.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
                    with out.open("wb") as dst:
                        for block in blocks:
                            dst.write(block)
                    os.chmod(out, entry.mode)
        except AppBundleError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            with contextlib.suppress(OSError):
                partial.parent.rmdir()  # (an application never installed leaves nothing)
            raise AppInstallError(str(exc)) from None
        if m.container is not None:
            spec = m.container
            machine = device_architecture(os.uname().machine)
            try:
                if spec.architecture and spec.architecture != machine:
                    raise AppInstallError(f"install {m.name} {m.version}: its image is for {spec.architecture}, this"
                                          f" device is {machine}")
                self.containers.load(files / spec.image, spec.image_id, what=f"install {m.name} {m.version}")
            except AppInstallError:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            unit = render_container_unit(spec, app=m.name, version=m.version, runtime=self.containers.runtime)
            (partial / "image").write_text(spec.image_id)
        else:
            assert app.unit is not None  # (a removal was refused above)
            unit = render_unit(app.unit, name=m.name, version=m.version, files_dir=str(target / "files"),
                               hidden=self.hidden)
        (partial / "unit").write_text(unit)
        (partial / "health").write_bytes(msgspec.json.encode(m.health))
        (partial / "head").write_bytes(app.head)
        if self.durable:
            os.sync()
        os.rename(partial, target)
        log.info("installed %s %s (%d files)", m.name, m.version, len(m.files))
        return app

    async def _start(self, name: str, version: str, record: AppRecord) -> None:
        target = self._version_dir(name, version)
        if not (target / "unit").exists():
            raise AppInstallError(f"start {name} {version}: not installed here")
        if record.trial and record.trial != version:
            raise AppInstallError(f"start {name} {version}: {name} {record.trial} is on trial (commit or revert it"
                                  " first)")
        if version == record.current and not record.trial:
            await self._run_unit(name, version)  # running it again: nothing to try
            return
        health = msgspec.json.decode((target / "health").read_bytes(), type=_Health)
        self._keep(name, msgspec.structs.replace(record, trial=version, health=health.check))
        await self._run_unit(name, version)

    async def _run_unit(self, name: str, version: str) -> None:
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.unit_dir / self.unit_name(name), (self._version_dir(name, version) / "unit").read_bytes(),
                     mode=0o644)
        await self.systemd.reload()
        await self.systemd.restart(self.unit_name(name))
        log.info("started %s %s", name, version)

    async def _check(self, name: str, record: AppRecord) -> AppReply:
        version = record.trial or record.current
        if not version:
            raise AppInstallError(f"check {name}: not installed here")
        target = self._version_dir(name, version)
        health = msgspec.json.decode((target / "health").read_bytes(), type=_Health)
        if health.check == "container":
            code, out = await self.containers.healthcheck(name, timeout_s=health.timeout_s)
            return AppReply(ok=True, exit_code=code, output=out[-500:], apps=self.records())
        if health.check != "command":
            raise AppInstallError(f"check {name}: its health check is {health.check}, not a command")
        argv = list(health.command)
        if not argv[0].startswith("/"):
            argv[0] = str(target / "files" / argv[0])
        code, out = await self.systemd.run_as(name, argv, directory=str(target / "files"),
                                              timeout_s=health.timeout_s, hidden=self.hidden)
        return AppReply(ok=True, exit_code=code, output=out[-500:], apps=self.records())

    async def _commit(self, name: str, record: AppRecord) -> None:
        if not record.trial:
            raise AppInstallError(f"commit {name}: no version is on trial")
        kept = AppRecord(current=record.trial, previous=record.current, health=record.health, removed=record.removed)
        self._keep(name, kept)
        await self._prune_below(name, kept.previous or kept.current)
        log.info("committed %s %s (kept %s to go back to)", name, kept.current, kept.previous or "nothing")

    async def _revert(self, name: str, record: AppRecord) -> None:
        if not record.trial:
            raise AppInstallError(f"revert {name}: no version is on trial (a committed version is not taken back)")
        back = AppRecord(current=record.current, previous=record.previous, removed=record.removed)
        if record.current:
            health = msgspec.json.decode((self._version_dir(name, record.current) / "health").read_bytes(),
                                         type=_Health)
            back = msgspec.structs.replace(back, health=health.check)
            self._keep(name, back)
            await self._run_unit(name, record.current)
        else:
            self._keep(name, back)
            await self._drop_unit(name)
        await self._drop_versions(name, [self._version_dir(name, record.trial)])
        log.info("reverted %s %s: %s", name, record.trial, f"back on {record.current}" if record.current else "removed")

    async def _remove(self, name: str, head: bytes, record: AppRecord) -> None:
        """`name` stopped and its versions removed, when `head` is the fleet's signed removal of it
        above its committed version; its data directory kept."""
        try:
            removal = verify_head(head, self.key, source=f"the removal of {name}")
        except AppBundleError as exc:
            raise AppInstallError(str(exc)) from None
        m = removal.manifest
        if m.runtime != "removed" or m.name != name:
            raise AppInstallError(f"remove {name}: the head is {'a removal' if m.runtime == 'removed' else 'a bundle'}"
                                  f" of {m.name} {m.version}, not a removal of {name}")
        if record.trial:
            raise AppInstallError(f"remove {name}: {record.trial} is on trial (revert it first)")
        below = Version.parse(m.version)
        if record.removed and below <= Version.parse(record.removed):
            raise AppInstallError(f"remove {name} at {m.version}: removed at {record.removed} already")
        if record.current and below <= Version.parse(record.current):
            raise AppInstallError(f"remove {name} at {m.version}: not above its committed version {record.current} (a"
                                  " removal goes forward too)")
        if record.installed:
            await self._drop_unit(name)
        await self._drop_versions(name, [p for p in (self.root / name).iterdir() if p.is_dir()]
                                  if (self.root / name).is_dir() else [])
        (self.root / name).mkdir(parents=True, exist_ok=True, mode=0o755)
        self._keep(name, AppRecord(removed=m.version))
        log.info("removed %s at %s (its data in /var/lib/%s is kept)", name, m.version, f"edge-apps/{name}")

    async def _drop_unit(self, name: str) -> None:
        await self.systemd.stop(self.unit_name(name))
        (self.unit_dir / self.unit_name(name)).unlink(missing_ok=True)
        await self.systemd.reload()

    async def _prune_below(self, name: str, oldest_kept: str) -> None:
        """The versions below `oldest_kept` removed (newer ones installed and not started stay)."""
        floor = Version.parse(oldest_kept)
        older = []
        for path in (self.root / name).iterdir():
            try:
                if path.is_dir() and Version.parse(path.name) < floor:
                    older.append(path)
            except EdgeAgentError:
                continue
        await self._drop_versions(name, older)

    async def _drop_versions(self, name: str, paths: list[Path]) -> None:
        """The version directories `paths` of `name` removed, and each container image only they
        used removed from the runtime's storage (its volumes, the application's data, stay)."""
        def image(path: Path) -> str:
            try:
                return (path / "image").read_text().strip()
            except OSError:
                return ""

        dropped = {image(p) for p in paths} - {""}
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        if not dropped:
            return
        still = {image(p) for p in (self.root / name).iterdir() if p.is_dir()} if (self.root / name).is_dir() else set()
        for image_id in sorted(dropped - still):
            await self.containers.forget(image_id)


class _Health(msgspec.Struct, frozen=True):
    check: str = "active"
    timeout_s: float = 120.0
    command: tuple[str, ...] = ()


def _state_reply(state: UnitState, apps: dict[str, AppRecord]) -> AppReply:
    return AppReply(ok=True, active=state.active, sub=state.sub, restarts=state.restarts, since_us=state.since_us,
                    result=state.result, status=state.status, apps=apps)


__all__ = ["HELPER", "MAX_FRAME", "AppHelper", "AppRecord", "AppReply", "AppRequest", "decode_reply", "encode"]
