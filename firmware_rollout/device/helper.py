"""The privileged install helper: the one process on a device that writes slots, switches the
boot target and reboots, so the agent itself stays unprivileged and sandboxed.

The helper runs as root (`edge-agent-installer.service`, socket-activated on a Unix socket only
the `edge-agent-installer` group may open, and answering only root and the agent's uid) around
one installer backend built from its own root-owned config with its own copy of the pinned key.
It performs exactly the installer's steps and a reboot:

    describe                        the backend's view: slots, booted, default, trial, fell back
    open_slot SLOT SIGNED_MANIFEST  the signature checked against the helper's key
    write_chunk SLOT INDEX BYTES    the chunk's sha256 checked against that manifest
    check_slot SLOT                 the whole image read back and checked
    read_slot SLOT OFFSET LENGTH    bytes of a slot as they are (a delta copies from the active one)
    mark_trial | commit | revert SLOT
    reboot TRIAL

and refuses anything else: an unknown request, a slot it does not manage, the booted slot, a
chunk the manifest does not vouch for, arming a slot whose image it has not read back, an image
older than the booted one (unless signed as a rollback naming the booted version), making the
default a slot it did not read back and check (except the booted one), or, once the booted image
is committed, a slot holding an older one (unless signed as its rollback). So a compromised agent
can neither write arbitrary bytes to a block device nor downgrade the device, nor undo a fix.

Frames both ways: a 4-byte big-endian length, then a msgpack map (`HelperRequest`, `HelperReply`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from agent.core.clock import Clock, SystemClock
from agent.core.errors import EdgeAgentError
from agent.core.tasks import in_thread
from agent.service import helper_socket
from agent.service.helper_socket import HelperClosed, HelperConnection, HelperSocketServer, HelperUnreachable, frame
from firmware_rollout.artifact.manifest import (
    HEADER_SIZE,
    MAX_CHUNK_SIZE,
    MAX_MANIFEST_SIZE,
    SIGNATURE_BLOCK_SIZE,
    Manifest,
    check_policy,
    verify_signed_manifest,
)
from firmware_rollout.device.reboot import Rebooter
from firmware_rollout.device.slot_records import SlotRecords
from firmware_rollout.device.slots import Installer, SlotView
from firmware_rollout.errors import ChunkMismatch, Downgrade, InstallError, UpdaterError
from rollout_engine.keys import Verifier
from rollout_engine.trust import take_trust_document
from rollout_engine.version import Version

log = logging.getLogger(__name__)

Op = Literal["describe", "open_slot", "write_chunk", "check_slot", "read_slot", "mark_trial", "commit", "revert",
             "reboot"]
SlotName = Annotated[str, msgspec.Meta(max_length=16)]
MAX_FRAME = MAX_CHUNK_SIZE + 64 * 1024  # one chunk and its envelope
MAX_MANIFEST = HEADER_SIZE + MAX_MANIFEST_SIZE + SIGNATURE_BLOCK_SIZE  # the largest signed manifest
REBOOT_REPLY_TIMEOUT_S = 900.0  # a reboot that returns takes the reboot command's settle time
HELPER = "install helper"
# a helper whose backend cannot start answers with why for this long, then ends: the next
# request starts it again and tries the backend afresh, slower than systemd's start limit
UNAVAILABLE_LINGER_S = 30.0


class HelperRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    op: Op
    slot: SlotName = ""
    index: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 0
    offset: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)] = 0
    length: Annotated[int, msgspec.Meta(ge=0, le=MAX_CHUNK_SIZE)] = 0
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_CHUNK_SIZE)] = b""
    signed_manifest: Annotated[bytes, msgspec.Meta(max_length=MAX_MANIFEST)] = b""
    # open_slot: the agent's newest trust document; the helper takes it only when its own root
    # (installer.toml trust_root) signed it and it is newer than the helper's (never the agent's word)
    trust: Annotated[bytes, msgspec.Meta(max_length=64 * 1024)] = b""
    trial: bool = False
    reason: Annotated[str, msgspec.Meta(max_length=200)] = ""


class HelperState(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    slots: tuple[str, str]
    booted: str
    default: str
    trial: str | None
    fell_back: bool
    view: dict[str, object]


class HelperReply(msgspec.Struct, kw_only=True, frozen=True):
    ok: bool
    error: str = ""
    mismatch: bool = False  # the refusal is a chunk or an image that differs from the signed manifest
    state: HelperState | None = None
    data: bytes = b""  # what read_slot read


_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(HelperRequest).decode
_decode_reply = msgspec.msgpack.Decoder(HelperReply).decode


def state_of(installer: Installer) -> HelperState:
    return HelperState(name=installer.name, slots=installer.slots, booted=installer.booted_slot(),
                       default=installer.default_slot(), trial=installer.trial_slot(),
                       fell_back=installer.fell_back(), view=dict(installer.describe()))


def _refusal(reason: str) -> bytes:
    return _encode(HelperReply(ok=False, error=reason))


async def serve_unavailable(sock: socket.socket, reason: str, *, allowed_uids: frozenset[int],
                            linger_s: float = UNAVAILABLE_LINGER_S) -> None:
    """The backend could not start (RAUC's service not answering yet, a slot device missing):
    every request of the agent is answered with `reason` for `linger_s`, then this returns
    (`agent.service.helper_socket.serve_unavailable`)."""
    await helper_socket.serve_unavailable(sock, _refusal(reason), helper=HELPER, refusal=_refusal,
                                          max_frame=MAX_FRAME, allowed_uids=allowed_uids, linger_s=linger_s)


class InstallHelper:
    """Serves one installer and one rebooter on a listening Unix socket; requests of all
    connections run one at a time.

    It decides for itself what a compromised agent could abuse: it keeps its own record of what
    each slot holds (`SlotRecords` in `state_dir`), refuses an image older than the booted one
    unless the signed manifest is a rollback that names the booted version, and makes the
    default only a slot it read back and checked, or the booted one. `allowed_uids`: who besides
    root may connect (the agent's user; empty: whoever the socket's mode lets in); a refused
    peer gets the reason as a reply. At most `MAX_PER_PEER` connections per uid: a newcomer at
    the bound closes that uid's longest-idle connection, so idle connections cannot lock the
    agent out of its helper."""

    def __init__(self, installer: Installer, rebooter: Rebooter, *, verify_key: Verifier, state_dir: Path,
                 made_with: str, allowed_uids: frozenset[int] = frozenset(), image: str | None = None,
                 hardware: str | None = None) -> None:
        self._installer = installer
        self._rebooter = rebooter
        self._key = verify_key
        self._image = image
        self._hardware = hardware
        self._allowed_uids = allowed_uids
        self.records = SlotRecords(state_dir, slots=installer.slots, booted=installer.booted_slot(),
                                   made_with=made_with)
        self._manifests: dict[str, Manifest] = {}  # slot -> the manifest it was opened for
        self._lock = asyncio.Lock()
        self._rebooting = False
        self.server = HelperSocketServer(self._answer, _refusal, helper=HELPER, max_frame=MAX_FRAME,
                                         allowed_uids=allowed_uids)

    @property
    def refused(self) -> int:
        """Connections and requests refused."""
        return self.server.refused

    @refused.setter
    def refused(self, value: int) -> None:
        self.server.refused = value

    @property
    def evicted(self) -> int:
        """Idle connections closed to make room for a newer one of the same uid."""
        return self.server.evicted

    async def serve(self, sock: socket.socket) -> None:
        await self.server.serve(sock)

    async def _answer(self, payload: bytes, _uid: int) -> bytes:
        return _encode(await self.handle(payload))

    async def handle(self, payload: bytes) -> HelperReply:
        try:
            request = _decode_request(payload)
        except msgspec.DecodeError as exc:  # ValidationError is one
            self.refused += 1
            return HelperReply(ok=False, error=f"refused: not a request ({exc})")
        try:
            if request.op == "describe":
                return HelperReply(ok=True, state=self._state())
            if self._rebooting:
                raise InstallError("a reboot is under way")
            if request.op == "reboot":
                await self._reboot(request)
                return HelperReply(ok=True, state=self._state())
            async with self._lock:
                data = await self._do(request)
        except (EdgeAgentError, OSError) as exc:
            self.refused += 1
            log.warning("refused %s of slot %s: %s", request.op, request.slot or "-", exc)
            return HelperReply(ok=False, error=str(exc), mismatch=isinstance(exc, ChunkMismatch),
                               state=self._state())
        return HelperReply(ok=True, state=self._state(), data=data)

    def _state(self) -> HelperState:
        state = state_of(self._installer)
        return msgspec.structs.replace(state, view={**state.view, "helper_records": self.records.describe()})

    async def _reboot(self, r: HelperRequest) -> None:
        """Runs the reboot command once no slot step is under way; the wait for the system to go
        down holds no lock (`describe` is still answered, every other step refused)."""
        async with self._lock:
            if self._rebooting:
                raise InstallError("a reboot is under way")
            self._rebooting = True
        log.info("reboot%s asked for: %s", " into the trial" if r.trial else "", r.reason)
        try:
            await self._rebooter.reboot(r.reason or "asked by the agent", trial=r.trial)
        finally:
            self._rebooting = False

    async def _do(self, r: HelperRequest) -> bytes:
        installer = self._installer
        if r.slot not in installer.slots:
            raise InstallError(f"no slot {r.slot!r} here (this helper manages {', '.join(installer.slots)})")
        if r.op == "open_slot":
            # the agent carries the document; this helper's own root must have signed it
            take_trust_document(self._key, r.trust, came_with="the agent's install request")
            manifest = verify_signed_manifest(r.signed_manifest, self._key).manifest
            check_policy(manifest, hardware=self._hardware, image=self._image,
                         installed_version=self.records.booted_version)
            if manifest.rollback and manifest.parsed_version() < Version.parse(self.records.booted_version) \
                    and not manifest.rollback_from:
                raise Downgrade(f"rollback refused: the rollback to {manifest.version} does not name the versions it "
                                f"replaces, and this device runs {self.records.booted_version}")
            await installer.open_slot(r.slot, r.signed_manifest)
            self.records.opening(r.slot, manifest)
            self._manifests[r.slot] = manifest
        elif r.op == "write_chunk":
            await installer.write_chunk(r.slot, r.index, r.data)
        elif r.op == "check_slot":
            await installer.check_slot(r.slot)
            opened = self._manifests.get(r.slot)
            if opened is None:
                raise InstallError(f"slot {r.slot} was not opened for an image")
            self.records.checked(r.slot, opened)
        elif r.op == "read_slot":
            return await installer.read_slot(r.slot, r.offset, r.length)
        elif r.op == "mark_trial":
            if r.slot == installer.booted_slot():
                raise InstallError(f"refusing to put slot {r.slot} on trial: the running system booted from it")
            self.records.refuse_older(r.slot, what="the next boot's")
            await installer.mark_trial(r.slot)
        else:  # commit, revert: the slot becomes the default
            self.records.refuse_default(r.slot)
            await (installer.commit(r.slot) if r.op == "commit" else installer.revert(r.slot))
            if r.op == "commit":
                self.records.committed(r.slot)
        return b""


class HelperError(InstallError):
    """The helper refused a request, or cannot be reached."""


class HelperInstaller:
    """The `Installer` (and `Rebooter`) of an unprivileged agent: every step is a request to the
    root helper on `socket_path`; the helper's state after each step answers the queries."""

    def __init__(self, socket_path: str | Path, *, clock: Clock | None = None, timeout_s: float = 600.0,
                 trust: Callable[[], bytes] | None = None, settle_s: float = 120.0) -> None:
        self._path = str(socket_path)
        self._trust = trust  # the agent's newest trust document, sent with open_slot
        self._clock = clock or SystemClock()
        self._settle_s = settle_s  # ([firmware] reboot_timeout_s) a reboot the helper went down with
        self._conn = HelperConnection(socket_path, helper=HELPER, max_frame=MAX_FRAME, timeout_s=timeout_s,
                                      hint=_connect_hint)
        self._state: HelperState
        try:
            self._call(HelperRequest(op="describe"))  # sets self._state
        except HelperError:
            self.close()  # (nobody holds an installer that did not start to close it later)
            raise

    def _call(self, request: HelperRequest, *, timeout_s: float | None = None) -> HelperReply:
        """One request and its reply (`HelperConnection.call`: resent once on a new connection)."""
        try:
            reply = _decode_reply(self._conn.call(_encode(request), timeout_s=timeout_s))
        except (HelperUnreachable, msgspec.DecodeError) as exc:
            self.close()
            raise HelperError(str(exc)) from None
        return self._take(request, reply)

    def _take(self, request: HelperRequest, reply: HelperReply) -> HelperReply:
        """The helper's state from `reply`; a refusal raised."""
        if reply.state is not None:
            self._state = reply.state
        if not reply.ok:
            if reply.mismatch:
                raise ChunkMismatch(f"the install helper refused {request.op}: {reply.error}")
            raise HelperError(f"the install helper refused {request.op}: {reply.error}")
        return reply

    async def _ask(self, request: HelperRequest, *, timeout_s: float | None = None) -> bytes:
        return await in_thread(self._clock, self._do_call, request, timeout_s)

    def _do_call(self, request: HelperRequest, timeout_s: float | None) -> bytes:
        return self._call(request, timeout_s=timeout_s).data

    def close(self) -> None:
        self._conn.close()

    # -- Installer ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._state.name

    @property
    def slots(self) -> tuple[str, str]:
        return self._state.slots

    def booted_slot(self) -> str:
        return self._state.booted

    def default_slot(self) -> str:
        return self._state.default

    def trial_slot(self) -> str | None:
        return self._state.trial

    def fell_back(self) -> bool:
        return self._state.fell_back

    async def open_slot(self, slot: str, signed_manifest: bytes) -> None:
        await self._ask(HelperRequest(op="open_slot", slot=slot, signed_manifest=signed_manifest,
                                      trust=self._trust() if self._trust is not None else b""))

    async def write_chunk(self, slot: str, index: int, data: bytes) -> None:
        await self._ask(HelperRequest(op="write_chunk", slot=slot, index=index, data=data))

    async def check_slot(self, slot: str) -> None:
        await self._ask(HelperRequest(op="check_slot", slot=slot))

    async def read_slot(self, slot: str, offset: int, length: int) -> bytes:
        return await self._ask(HelperRequest(op="read_slot", slot=slot, offset=offset, length=length))

    async def mark_trial(self, slot: str) -> None:
        await self._ask(HelperRequest(op="mark_trial", slot=slot))

    async def commit(self, slot: str) -> None:
        await self._ask(HelperRequest(op="commit", slot=slot))

    async def revert(self, slot: str) -> None:
        await self._ask(HelperRequest(op="revert", slot=slot))

    def describe(self) -> SlotView:
        return {**self._state.view, "helper": self._path}

    # -- Rebooter ----------------------------------------------------------------------------
    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        """The helper runs the reboot command and waits for the system to go down. systemd stops
        the helper (and this agent) on the way down, so the connection ending unanswered is the
        reboot under way, not a failure: the agent waits for its own end like `CommandRebooter`,
        and only a device still up `settle_s` later failed to reboot."""
        request = HelperRequest(op="reboot", trial=trial, reason=reason[:200])
        try:
            went_down = await in_thread(self._clock, self._ask_reboot, request)
        except HelperError as exc:
            raise UpdaterError(str(exc)) from None
        if went_down:
            await self._clock.sleep(self._settle_s)  # the shutdown ends this process meanwhile
            raise UpdaterError(f"the install helper ended while rebooting and the device was still up "
                               f"{self._settle_s:g}s later")

    def _ask_reboot(self, request: HelperRequest) -> bool:
        """True when the helper's connection ended before it answered. Asked on a new connection,
        never resent: a kept one the helper closed while idle would end unanswered too."""
        self.close()
        try:
            reply = _decode_reply(self._conn.exchange(_encode(request), REBOOT_REPLY_TIMEOUT_S))
        except HelperClosed:
            return True
        except (HelperUnreachable, msgspec.DecodeError) as exc:
            raise HelperError(str(exc)) from None
        finally:
            self.close()
        self._take(request, reply)
        return False


def _connect_hint(exc: OSError) -> str:
    """What to look at when the helper's socket cannot be opened."""
    if isinstance(exc, PermissionError):
        return "is the agent's user in the socket's group (edge-agent-installer)?"
    return "is edge-agent-installer.socket enabled? (systemctl enable --now edge-agent-installer.socket)"


def listening_socket(path: str | Path | None) -> socket.socket:
    """systemd's socket when activated by it, else a new one bound at `path` (mode 0660)."""
    sock = helper_socket.listening_socket(path)
    if sock is None:
        raise UpdaterError("no socket: not started by systemd's socket unit and no --socket given")
    return sock


__all__ = ["HelperError", "HelperInstaller", "HelperReply", "HelperRequest", "HelperState", "InstallHelper", "frame",
           "listening_socket", "state_of"]
