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
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from agent.core.clock import Clock, SystemClock
from agent.core.errors import EdgeAgentError
from agent.core.peercred import peer_credentials
from agent.core.ratelog import RateLimitedLog
from agent.core.tasks import in_thread
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
_LENGTH = struct.Struct(">I")
REBOOT_REPLY_TIMEOUT_S = 900.0  # a reboot that returns takes the reboot command's settle time
MAX_PER_PEER = 4  # connections per uid: the agent needs one
IDLE_TIMEOUT_S = 60.0  # a connection that sends no request for this long is closed (the agent reconnects)
FRAME_TIMEOUT_S = 30.0  # the rest of a request, once its first bytes came
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


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def state_of(installer: Installer) -> HelperState:
    return HelperState(name=installer.name, slots=installer.slots, booted=installer.booted_slot(),
                       default=installer.default_slot(), trial=installer.trial_slot(),
                       fell_back=installer.fell_back(), view=dict(installer.describe()))


def _stranger(uid: int, allowed_uids: frozenset[int]) -> str:
    """Why `uid` may not ask the helper at all ("" when it may: root, or an allowed uid)."""
    if allowed_uids and uid != 0 and uid not in allowed_uids:
        return f"refused: uid {uid} is not the agent's user: only it and root may ask the install helper"
    return ""


async def _answer_refusal(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reason: str) -> None:
    """The reason as the answer to the peer's first request (read first, so its client reads the
    answer instead of a reset)."""
    with contextlib.suppress(asyncio.IncompleteReadError, TimeoutError):
        head = await asyncio.wait_for(reader.readexactly(_LENGTH.size), FRAME_TIMEOUT_S)
        (length,) = _LENGTH.unpack(head)
        if length <= MAX_FRAME:
            await asyncio.wait_for(reader.readexactly(length), FRAME_TIMEOUT_S)
    writer.write(frame(_encode(HelperReply(ok=False, error=reason))))
    await writer.drain()


async def serve_unavailable(sock: socket.socket, reason: str, *, allowed_uids: frozenset[int],
                            linger_s: float = UNAVAILABLE_LINGER_S) -> None:
    """The backend could not start (RAUC's service not answering yet, a slot device missing):
    every request of the agent is answered with `reason` for `linger_s`, then this returns. The
    agent logs the real cause instead of a refused connection, and the next request after the
    helper ended starts it again (socket activation) and tries the backend afresh."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            _pid, uid, _gid = peer_credentials(writer.get_extra_info("socket"))
            await _answer_refusal(reader, writer, _stranger(uid, allowed_uids) or reason)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(answer, sock=sock)
    async with server:
        await asyncio.sleep(linger_s)


@dataclass(eq=False)
class _Peer:
    """One open connection: whose it is, and whether a request of it is being read or run."""

    uid: int
    writer: asyncio.StreamWriter
    busy: bool = False
    since: float = field(default_factory=time.monotonic)


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
        self._peers: set[_Peer] = set()
        self._refusals = RateLimitedLog(log, SystemClock(), interval_s=60.0)
        self.refused = 0
        self.evicted = 0

    async def serve(self, sock: socket.socket) -> None:
        server = await asyncio.start_unix_server(self._connection, sock=sock)
        async with server:
            await server.serve_forever()

    def _admit(self, uid: int) -> str:
        """Why a connection of `uid` is refused ("" when it is taken)."""
        refusal = _stranger(uid, self._allowed_uids)
        if refusal:
            return refusal
        mine = [p for p in self._peers if p.uid == uid]
        if len(mine) < MAX_PER_PEER:
            return ""
        idle = [p for p in mine if not p.busy]
        if not idle:
            return f"refused: uid {uid} has {MAX_PER_PEER} connections with requests under way"
        oldest = min(idle, key=lambda p: p.since)
        self._peers.discard(oldest)
        self.evicted += 1
        oldest.writer.transport.abort()  # its task sees the connection end
        return ""

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer: _Peer | None = None
        try:
            pid, uid, _gid = peer_credentials(writer.get_extra_info("socket"))
            refusal = self._admit(uid)
            if refusal:
                self.refused += 1
                self._refusals.warning(f"uid-{uid}", f"install helper: {refusal} (pid {pid})")
                await _answer_refusal(reader, writer, refusal)
                return
            peer = _Peer(uid, writer)
            self._peers.add(peer)
            while True:
                peer.busy, peer.since = False, time.monotonic()
                try:
                    head = await asyncio.wait_for(reader.readexactly(_LENGTH.size), IDLE_TIMEOUT_S)
                except (asyncio.IncompleteReadError, TimeoutError):
                    return
                peer.busy = True
                (length,) = _LENGTH.unpack(head)
                if length > MAX_FRAME:
                    writer.write(frame(_encode(HelperReply(ok=False, error=f"request of {length} bytes is over "
                                                                          f"the {MAX_FRAME} limit"))))
                    await writer.drain()
                    return
                reply = await self.handle(await asyncio.wait_for(reader.readexactly(length), FRAME_TIMEOUT_S))
                writer.write(frame(_encode(reply)))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            return
        finally:
            if peer is not None:
                self._peers.discard(peer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

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
        self._timeout_s = timeout_s
        self._settle_s = settle_s  # ([firmware] reboot_timeout_s) a reboot the helper went down with
        self._sock: socket.socket | None = None
        self._state: HelperState
        try:
            self._call(HelperRequest(op="describe"))  # sets self._state
        except HelperError:
            self.close()  # (nobody holds an installer that did not start to close it later)
            raise

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            try:
                sock.connect(self._path)
            except OSError as exc:
                sock.close()
                raise HelperError(f"the install helper at {self._path} does not answer ({exc.strerror or exc}): "
                                  f"{_connect_hint(exc)}") from None
            self._sock = sock
        return self._sock

    def _call(self, request: HelperRequest, *, timeout_s: float | None = None) -> HelperReply:
        """One request and its reply. A kept connection the helper closed meanwhile (idle, or to
        make room) is opened again and the request sent once more: every step is idempotent."""
        reused = self._sock is not None
        try:
            reply = self._exchange(request, timeout_s)
        except _Closed as exc:
            if not reused:
                raise HelperError(f"install helper at {self._path}: {exc}") from None
            try:
                reply = self._exchange(request, timeout_s)
            except _Closed as again:
                raise HelperError(f"install helper at {self._path}: {again}") from None
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

    def _exchange(self, request: HelperRequest, timeout_s: float | None) -> HelperReply:
        sock = self._connect()
        try:
            sock.settimeout(timeout_s or self._timeout_s)
            try:
                sock.sendall(frame(_encode(request)))
                head = _recv_exact(sock, _LENGTH.size)
            except (BrokenPipeError, ConnectionResetError, _Closed) as exc:
                raise _Closed(str(exc) or "the install helper closed the connection") from None
            (length,) = _LENGTH.unpack(head)
            if length > MAX_FRAME:
                raise HelperError(f"the install helper answered {length} bytes")
            return _decode_reply(_recv_exact(sock, length))
        except _Closed:
            self.close()
            raise
        except (OSError, msgspec.DecodeError, HelperError) as exc:
            self.close()
            raise HelperError(f"install helper at {self._path}: {exc}") from None

    async def _ask(self, request: HelperRequest, *, timeout_s: float | None = None) -> bytes:
        return await in_thread(self._clock, self._do_call, request, timeout_s)

    def _do_call(self, request: HelperRequest, timeout_s: float | None) -> bytes:
        return self._call(request, timeout_s=timeout_s).data

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

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
            reply = self._exchange(request, REBOOT_REPLY_TIMEOUT_S)
        except _Closed:
            return True
        finally:
            self.close()
        self._take(request, reply)
        return False


def _connect_hint(exc: OSError) -> str:
    """What to look at when the helper's socket cannot be opened."""
    if isinstance(exc, PermissionError):
        return "is the agent's user in the socket's group (edge-agent-installer)?"
    return "is edge-agent-installer.socket enabled? (systemctl enable --now edge-agent-installer.socket)"


class _Closed(Exception):
    """The helper closed the connection before answering."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise _Closed("the install helper closed the connection")
        buf += part
    return bytes(buf)


def listening_socket(path: str | Path | None) -> socket.socket:
    """systemd's socket (LISTEN_FDS, fd 3) when activated by it, else a new one bound at `path`
    (mode 0660: the group decides who may ask)."""
    if os.environ.get("LISTEN_PID") == str(os.getpid()) and int(os.environ.get("LISTEN_FDS", "0")) >= 1:
        return socket.socket(fileno=3)
    if path is None:
        raise UpdaterError("no socket: not started by systemd's socket unit and no --socket given")
    target = Path(path)
    with contextlib.suppress(FileNotFoundError):
        target.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(target))
    os.chmod(target, 0o660)
    sock.listen(8)
    return sock


__all__ = ["HelperError", "HelperInstaller", "HelperReply", "HelperRequest", "HelperState", "InstallHelper",
           "listening_socket", "state_of"]
