"""A config release applied to one target of the device, commit-confirmed.

Each step is recorded in the target's journal (written beside, fsynced, renamed, the folder
fsynced) before the next begins; `on_step(name)` is called at each boundary (the tests SIGKILL
the process there):

    stage      the release's documents written into a staging folder of the target's state
               (the agent's own: the target's folder must be writable, never its parent, so a
               sandboxed agent with `ReadWritePaths=/etc/app` can hold /etc/app), each fsynced
    validate   `validate_command` on the staging folder ("{staged}" in it is replaced by its
               path), within `command_timeout_s`; then, with `app_validate_s`, an application's
               verdict through the local API (`reviews`: `config_rollout.device.review`)
    keep       the documents the release replaces copied to the target's last-good folder in the
               state directory, fsynced; the journal says "swapping"
    swap       each staged document written beside its file in the target's folder (fsynced) and
               renamed over it; the folder fsynced
    apply      `apply_command`
    confirm    from `settle_s` after the apply until `confirm_s`: the host's check (connected,
               the leader answered just now: `confirm`) and `health_command` pass, tried again
               every second until then
    commit     the journal says "committed" with the version, the release id and each
               document's sha256; the last-good and staging folders go

A failure before the swap (a document not declared, validation failed) discards the staging
folder: nothing changed. A failure at apply or confirm reverts: the last-good documents written
back the same way (beside, fsync, rename), a document the release added removed, and
`apply_command` run again for the old content; the result is `rolled_back` with the reason.

`resume()`, at the agent's start, finishes what a SIGKILL or a power cut interrupted: before the
swap the staging folder is discarded (the old content stands); from the swap until the commit
the last-good documents are written back, so a swap cut halfway is never left mixed. An apply a
release holds (`hold`: confirmed, waiting for the release's other parts) is left to the release,
which commits it or takes it back (`settle_held`).

The target's folder may be an application's to write in, and so hostile: a document is read
without following a link (`read_document`), so keep-last-good refuses a planted link in one
line before anything changes, drift and an application's view never read through one, and a
revert writes each old document back with the mode (and, where it may, the owner) it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from agent.core.clock import Clock, SystemClock
from agent.core.config import ConfigTargetSection
from agent.core.errors import EdgeAgentError
from agent.core.files import fsync_path
from agent.core.tasks import in_thread
from agent.service.files import write_private_file
from config_rollout.device.review import ConfigReviews
from config_rollout.errors import ConfigReleaseError
from config_rollout.layers import Rendered
from config_rollout.release import ConfigRelease

#: "restarting": swapped in, to be confirmed by the agent's next start, which it asked for
Outcome = Literal["committed", "failed", "rolled_back", "restarting"]
#: The journal's states; "swapping" and "applied" are the ones a restart must revert.
JournalState = Literal["idle", "staged", "swapping", "applied", "committed", "failed", "rolled_back"]
CONFIRM_RETRY_S = 1.0
log = logging.getLogger(__name__)
T = TypeVar("T")
OUTPUT_KEPT = 300  # characters of a failed command's output in the reason


@dataclass(frozen=True)
class ApplyResult:
    state: Outcome
    version: str  # what the target holds now
    detail: str


@dataclass(frozen=True)
class TargetStatus:
    version: str  # "" before the first release
    release_id: str
    state: str
    detail: str
    drifted: tuple[str, ...]  # documents whose content differs from what was applied (a local edit)
    layers: str = ""  # the digest of the leader's layer values applied with the release ("" none)
    attempt: int = 0  # applies begun on the target, counted (the newest one's number; 0: none yet)


#: The journal of a target nothing was ever applied to.
IDLE: dict[str, Any] = {"state": "idle", "version": "", "release_id": "", "hashes": {}, "detail": "", "layers": ""}


def _attempt(j: dict[str, Any]) -> int:
    """The journal's count of applies begun (an operator's acknowledgement names the one it saw)."""
    counted = j.get("attempt", 0)
    return counted if isinstance(counted, int) and 0 <= counted < 2**31 else 0


class ConfigApplier:
    """One target's documents, its journal and its last good content. `confirm` is the host's
    check during the confirm window ("" when fine, else why not); `on_step` is told each step."""

    def __init__(self, name: str, target: ConfigTargetSection, state_dir: Path, *,
                 confirm: Callable[[], Awaitable[str]] | None = None,
                 on_step: Callable[[str], None] | None = None, reviews: ConfigReviews | None = None,
                 clock: Clock | None = None, check: Callable[[dict[str, bytes]], str] | None = None,
                 restarts: Callable[[], None] | None = None) -> None:
        self.name = name
        self.target = target
        self.directory = Path(target.directory)
        self.home = state_dir / "config" / name
        self.journal_path = self.home / "journal.json"
        self.last_good = self.home / "last-good"
        self.staging = self.home / "staged"
        self._confirm = confirm
        self._on_step = on_step or (lambda step: None)
        self._reviews = reviews
        self._check = check  # the host's own validation of the staged documents ("" fine, else why not)
        # the content takes effect at the agent's next start, which this asks for (the built-in
        # target `agent`): the confirm runs in that start (`resume`)
        self._restarts = restarts
        self._clock = clock if clock is not None else SystemClock()  # (the simulator's: virtual time)
        self._mode = int(target.mode, 8)

    # -- the journal ---------------------------------------------------------------------------
    def journal(self) -> dict[str, Any]:
        try:
            loaded = json.loads(self.journal_path.read_text())
        except FileNotFoundError:
            return dict(IDLE)
        except (OSError, ValueError) as exc:
            raise ConfigReleaseError(f"{self.journal_path}: unreadable ({exc}): the target's record is damaged"
                                     ) from None
        return loaded if isinstance(loaded, dict) else dict(IDLE)

    def _record(self, **fields: Any) -> None:
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private_file(self.journal_path, json.dumps({**self.journal(), **fields}, sort_keys=True).encode(), 0o600)
        fsync_path(self.home)

    def status(self) -> TargetStatus:
        """What the target holds and whether a document was changed on the device since."""
        j = self.journal()
        return self._status(j, self._applied_documents(j))

    def _applied_documents(self, j: dict[str, Any]) -> dict[str, bytes | None]:
        """The documents the journal says were applied, as they are on disk (None: gone)."""
        found: dict[str, bytes | None] = {}
        for n in sorted(j.get("hashes") or {}):
            try:
                document = read_document(self.directory / n)
            except ConfigReleaseError:  # a link or no regular file: drifted, and never followed
                document = None
            found[n] = document[0] if document is not None else None
        return found

    def _status(self, j: dict[str, Any], documents: dict[str, bytes | None]) -> TargetStatus:
        hashes: dict[str, str] = j.get("hashes") or {}
        at_rest = j.get("state") in ("idle", "committed", "failed", "rolled_back")  # (mid-apply is no edit)
        drifted = tuple(n for n, data in documents.items()
                        if data is None or hashlib.sha256(data).hexdigest() != hashes[n]) if at_rest else ()
        return TargetStatus(str(j.get("version", "")), str(j.get("release_id", "")), str(j.get("state", "idle")),
                            str(j.get("detail", "")), drifted, str(j.get("layers", "")), _attempt(j))

    def view(self) -> dict[str, Any]:
        """What an application reads (`GET /v1/config/NAME`): the version applied, its state,
        drift, and each applied document as it is on disk now (text, or base64 when not UTF-8)."""
        import base64

        j = self.journal()
        applied = self._applied_documents(j)
        st = self._status(j, applied)
        documents: dict[str, dict[str, str]] = {}
        for n, data in applied.items():
            if data is None:
                continue
            try:
                documents[n] = {"text": data.decode("utf-8")}
            except UnicodeDecodeError:
                documents[n] = {"base64": base64.b64encode(data).decode()}
        return {"target": self.name, "version": st.version, "release_id": st.release_id, "layers": st.layers,
                "state": st.state, "detail": st.detail, "attempt": st.attempt, "drifted": list(st.drifted),
                "documents": documents}

    # -- applying ------------------------------------------------------------------------------
    async def apply(self, release: ConfigRelease, rendered: Rendered | None = None, *,
                    context: dict[str, str] | None = None,
                    hold: Callable[[], Awaitable[str]] | None = None) -> ApplyResult:
        """Apply a verified release (its name is this target's) and confirm it, or revert;
        `rendered`: its documents with the leader's layer values applied (`config_rollout.layers`);
        `context`: kept in the journal (who offered it: a resumed apply reports to them); `hold`:
        once confirmed, asked whether to commit ("") or revert (why): a release commits its parts
        together. While held the journal says `held`: a start finds it so and leaves it to the
        release (`settle_held`)."""
        documents = rendered.documents if rendered is not None else release.documents
        layers = rendered.digest if rendered is not None else ""
        j = self.journal()
        if j.get("state") in ("staged", "swapping", "applied"):
            await self.resume()
            j = self.journal()
        if release.name != self.name:
            return self._fail(f"release {release.name} {release.version} is not for target {self.name}", j)
        undeclared = [n for n in documents if self.target.documents and n not in self.target.documents]
        if undeclared:
            return self._fail(f"target {self.name} takes no document {', '.join(undeclared)}", j)
        too_big = [n for n, data in documents.items() if len(data) > self.target.max_document_kib * 1024]
        if too_big:
            return self._fail(f"document {too_big[0]} is over {self.target.max_document_kib} KiB", j)
        if (release.release_id, layers) == (j.get("release_id"), j.get("layers", "")) and j.get("state") == "committed":
            return ApplyResult("committed", release.version, "already applied")
        previous = {"version": j.get("version", ""), "release_id": j.get("release_id", ""),
                    "hashes": j.get("hashes") or {}, "layers": j.get("layers", "")}
        def stage() -> None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._stage(documents)
            self._record(state="staged", staging_release=release.release_id, staging_version=release.version,
                         previous=previous, detail="", context=context or {}, attempt=_attempt(j) + 1)

        try:
            await self._io(stage)
        except (OSError, EdgeAgentError) as exc:  # a full disk, say: nothing changed, nothing left
            self._discard_staging()
            return self._fail(f"cannot stage {self.name}: {getattr(exc, 'strerror', None) or exc}", j)
        self._on_step("staged")
        problem = await self._run("validate", self.target.validate_command, staged=self.staging)
        if not problem and self._check is not None:
            problem = self._check(documents)
        if not problem and self._reviews is not None and self.target.app_validate_s > 0:
            problem = await self._reviews.ask(self.name, release.version, release.release_id, documents,
                                              self.target.app_validate_s)
        if problem:
            self._discard_staging()
            return self._fail(f"validation refused {release.version}: {problem}", self.journal(), previous=previous)
        self._on_step("validated")
        def keep() -> None:
            kept = self._keep_last_good(documents)
            self._record(state="swapping", documents=sorted(documents), existed=sorted(kept), kept=kept)

        try:
            await self._io(keep)
        except (OSError, EdgeAgentError) as exc:  # before the swap: nothing changed
            self._discard_staging()
            shutil.rmtree(self.last_good, ignore_errors=True)
            return self._fail(f"cannot keep the current documents: {getattr(exc, 'strerror', None) or exc}",
                              self.journal(), previous=previous)
        self._on_step("kept")
        incoming = {"version": release.version, "release_id": release.release_id, "layers": layers,
                    "hashes": {**previous["hashes"], **{n: hashlib.sha256(data).hexdigest()
                                                        for n, data in documents.items()}}}
        deadline_ms = int(self._clock.now_ms() + self.target.confirm_s * 1000)
        restarting = self._restarts is not None  # it takes effect at the next start, where it is confirmed

        def swap() -> None:
            for n in documents:
                self._write(self.directory / n, documents[n])  # (the staged bytes, verified and validated)
                self._on_step(f"swapped {n}")
            fsync_path(self.directory)
            self._discard_staging()
            self._record(state="applied", deadline_ms=deadline_ms, incoming=incoming, restarting=restarting)

        await self._io(swap)
        self._on_step("swapped")
        if self._restarts is not None:
            self._restarts()
            return ApplyResult("restarting", release.version, "applied: confirmed when the agent has started again")
        problem = await self._run("apply", self.target.apply_command)
        if not problem:
            self._on_step("applied")
            problem = await self._confirm_within(self.target.confirm_s, self.target.settle_s)
        if problem:
            return await self._revert(f"{release.version} reverted: {problem}")
        if hold is not None:
            self._record(held=True)
            self._on_step("held")
            problem = await hold()
            if problem:
                return await self._revert(f"{release.version} taken back: {problem}")
        return await self._io(lambda: self._commit(incoming))

    def held(self) -> bool:
        """Applied and confirmed, waiting for its release to commit or take back every part."""
        j = self.journal()
        return j.get("state") == "applied" and bool(j.get("held"))

    async def settle_held(self, *, commit: bool, reason: str = "") -> ApplyResult | None:
        """A held apply committed, or reverted saying `reason` (None: nothing is held)."""
        if not self.held():
            return None
        incoming = self.journal().get("incoming") or {}
        if commit:
            return await self._io(lambda: self._commit(incoming))
        return await self._revert(f"{incoming.get('version', '?')} taken back: {reason}")

    async def _io(self, work: Callable[[], T]) -> T:
        """Blocking file work (writes, fsyncs, renames) off the event loop: a slow card's fsyncs
        stall no heartbeat (on the loop under the simulator's clock: the same run every time)."""
        return await in_thread(self._clock, work)

    def _commit(self, incoming: dict[str, Any]) -> ApplyResult:
        self._record(state="committed", version=incoming["version"], release_id=incoming["release_id"],
                     layers=incoming["layers"], hashes=incoming["hashes"], detail="confirmed", previous={},
                     incoming={}, restarting=False, held=False)
        shutil.rmtree(self.last_good, ignore_errors=True)
        self._on_step("committed")
        return ApplyResult("committed", str(incoming["version"]), "confirmed")

    async def resume(self) -> ApplyResult | None:
        """Finish what an interrupted apply left (at the agent's start): the old content back
        (or, for a target that takes effect at a start, the confirm of what this start runs),
        or nothing to do (None). What it decided is marked for the offer's report
        (`take_unreported`)."""
        result = await self._resume()
        if result is not None:
            self._record(unreported=True)
        return result

    def take_unreported(self) -> tuple[dict[str, str], ApplyResult] | None:
        """What a resume decided and nobody reported yet: (the apply's `context`, the outcome);
        the mark goes."""
        j = self.journal()
        if not j.get("unreported"):
            return None
        self._record(unreported=False)
        state = j.get("state")
        outcome: Outcome = state if state in ("committed", "failed", "rolled_back") else "failed"
        return dict(j.get("context") or {}), ApplyResult(outcome, str(j.get("version", "")), str(j.get("detail", "")))

    async def _resume(self) -> ApplyResult | None:
        j = self.journal()
        state = j.get("state")
        if state == "applied" and j.get("restarting") and self._restarts is not None:
            # the start the apply asked for: its content runs now; confirm it in what is left
            self._record(restarting=False)
            self._on_step("applied")
            incoming = j.get("incoming") or {}
            window = max(0.0, (int(j.get("deadline_ms", 0)) - self._clock.now_ms()) / 1000)
            problem = await self._confirm_within(window, min(self.target.settle_s, window))
            if problem:
                return await self._revert(f"{incoming.get('version', '?')} reverted: {problem}")
            return await self._io(lambda: self._commit(incoming))
        if state == "staged":
            self._discard_staging()
            previous = j.get("previous") or {}
            self._record(state="failed", version=previous.get("version", ""), detail="interrupted before the swap")
            return ApplyResult("failed", str(previous.get("version", "")), "interrupted before the swap")
        if state == "applied" and j.get("held"):
            return None  # confirmed, held by a release: the release's start commits it or takes it back
        if state in ("swapping", "applied"):
            return await self._revert("interrupted before it was confirmed")
        self._discard_staging()
        return None

    # -- the steps -----------------------------------------------------------------------------
    def _stage(self, documents: dict[str, bytes]) -> None:
        self._discard_staging()
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.staging.mkdir(mode=0o700)
        for n, data in documents.items():
            self._write(self.staging / n, data)
        fsync_path(self.staging)

    def _write(self, path: Path, data: bytes, had: list[int] | None = None) -> None:
        """A document written (beside, fsynced, renamed: a link there is replaced, never
        followed) with the target's mode and owner, or with `had` ([mode, uid, gid]: what the
        document it brings back had; its owner where this agent may give it)."""
        if had is not None:
            mode, uid, gid = had
            write_private_file(path, data, mode)
            if (uid, gid) != (os.geteuid(), os.getegid()):
                with contextlib.suppress(PermissionError):
                    os.chown(path, uid, gid)
            return
        write_private_file(path, data, self._mode)
        uid, gid = owner_ids(self.target)
        if (uid, gid) != (-1, -1):
            os.chown(path, uid, gid)

    def _keep_last_good(self, documents: dict[str, bytes]) -> dict[str, list[int]]:
        """Copy the documents the release replaces to last-good; each one's [mode, uid, gid]."""
        shutil.rmtree(self.last_good, ignore_errors=True)
        self.last_good.mkdir(parents=True, mode=0o700)
        kept: dict[str, list[int]] = {}
        for n in documents:
            current = read_document(self.directory / n)
            if current is not None:
                data, st = current
                write_private_file(self.last_good / n, data, 0o600)
                kept[n] = [stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid]
        fsync_path(self.last_good)
        return kept

    def _discard_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    async def _revert(self, reason: str) -> ApplyResult:
        j = self.journal()

        def write_back() -> None:
            self._discard_staging()
            existed = set(j.get("existed") or ())
            kept: dict[str, list[int]] = j.get("kept") or {}
            for n in j.get("documents") or ():
                if n in existed:
                    self._write(self.directory / n, (self.last_good / n).read_bytes(), kept.get(n))
                else:
                    (self.directory / n).unlink(missing_ok=True)
            fsync_path(self.directory)

        await self._io(write_back)
        previous = j.get("previous") or {}
        problem = await self._run("apply", self.target.apply_command)
        detail = reason + (f"; applying the old content again failed too: {problem}" if problem else "")

        def record() -> None:
            self._record(state="rolled_back", version=previous.get("version", ""),
                         release_id=previous.get("release_id", ""), hashes=previous.get("hashes") or {},
                         detail=detail, layers=previous.get("layers", ""), previous={}, incoming={},
                         restarting=False, held=False)
            shutil.rmtree(self.last_good, ignore_errors=True)

        await self._io(record)
        self._on_step("reverted")
        if self._restarts is not None:
            self._restarts()  # the old content runs from the next start
        return ApplyResult("rolled_back", str(previous.get("version", "")), detail)

    def _fail(self, reason: str, j: dict[str, Any], *, previous: dict[str, Any] | None = None) -> ApplyResult:
        version = str((previous or {}).get("version", j.get("version", "")))
        if previous is not None:
            try:
                self._record(state="failed", version=version, release_id=previous.get("release_id", ""),
                             hashes=previous.get("hashes") or {}, detail=reason, layers=previous.get("layers", ""),
                             previous={})
            except (OSError, EdgeAgentError) as exc:  # (a full disk: the next start finishes the record)
                log.warning("config %s: the journal keeps its last state: %s", self.name, exc)
        return ApplyResult("failed", version, reason)

    async def _confirm_within(self, window_s: float, settle_s: float) -> str:
        """"" once the host's check and the health command pass within the window (looked at
        from `settle_s` on), else why not."""
        clock = self._clock
        deadline = clock.monotonic() + window_s
        await clock.sleep(settle_s)
        problem = "not confirmed"
        while True:
            problem = await self._confirm() if self._confirm is not None else ""
            if not problem:
                problem = await self._run("health", self.target.health_command,
                                          timeout_s=max(0.1, min(self.target.command_timeout_s,
                                                                 deadline - clock.monotonic())))
            if not problem:
                return ""
            if clock.monotonic() + CONFIRM_RETRY_S >= deadline:
                return f"not confirmed within {window_s:g} s: {problem}"
            await clock.sleep(CONFIRM_RETRY_S)

    async def _run(self, what: str, command: tuple[str, ...], *, staged: Path | None = None,
                   timeout_s: float | None = None) -> str:
        """Run a target's command: "" when it exits 0, else why not (its exit and output's end)."""
        if not command:
            return ""
        argv = [part.replace("{staged}", str(staged)) if staged is not None else part for part in command]
        limit = timeout_s if timeout_s is not None else self.target.command_timeout_s
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            return f"{what} command {argv[0]}: {exc.strerror or exc}"
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), limit)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return f"{what} command did not finish within {limit:g} s"
        if proc.returncode != 0:
            tail = out.decode("utf-8", "replace").strip()[-OUTPUT_KEPT:]
            return f"{what} command exited {proc.returncode}" + (f": {tail}" if tail else "")
        return ""


def read_document(path: Path) -> tuple[bytes, os.stat_result] | None:
    """A document's bytes and its status, never through a link (None: there is none). A link or
    anything but a regular file is a `ConfigReleaseError` naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise ConfigReleaseError(f"{path} is a symbolic link: refused (a config document is a regular file)"
                                     ) from None
        raise ConfigReleaseError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigReleaseError(f"{path} is not a regular file: refused")
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def owner_ids(target: ConfigTargetSection) -> tuple[int, int]:
    """The target's `owner` and `group` as ids (-1: the agent's own); a `ConfigReleaseError`
    names one this system does not have."""
    import grp
    import pwd

    def look(name: str, table: Callable[[str], Any], what: str) -> int:
        if not name:
            return -1
        if name.isdigit():
            return int(name)
        try:
            return int(table(name)[2])
        except KeyError:
            raise ConfigReleaseError(f"no {what} {name!r} on this system") from None

    return look(target.owner, pwd.getpwnam, "user"), look(target.group, grp.getgrnam, "group")


__all__ = ["ApplyResult", "ConfigApplier", "TargetStatus", "owner_ids", "read_document"]
