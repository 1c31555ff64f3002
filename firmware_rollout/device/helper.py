"""The privileged install helper: the one process on a device that writes slots, switches the
boot target and reboots, so the agent itself stays unprivileged and sandboxed.

The helper runs as root (`edge-agent-installer.service`, socket-activated on a Unix socket only
the `edge-agent` group may open) around one installer backend built from the device's config
with its own copy of the pinned key. It performs exactly the installer's steps and a reboot:

    describe                        the backend's view: slots, booted, default, trial, fell back
    open_slot SLOT SIGNED_MANIFEST  the signature checked against the helper's key
    write_chunk SLOT INDEX BYTES    the chunk's sha256 checked against that manifest
    check_slot SLOT                 the whole image read back and checked
    read_slot SLOT OFFSET LENGTH    bytes of a slot as they are (a delta copies from the active one)
    mark_trial | commit | revert SLOT
    reboot TRIAL

and refuses anything else: an unknown request, a slot it does not manage, the booted slot, a
chunk the manifest does not vouch for, arming a slot whose image it has not read back. So a
compromised agent cannot write arbitrary bytes to a block device.

Frames both ways: a 4-byte big-endian length, then a msgpack map (`HelperRequest`, `HelperReply`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from agent.core.clock import Clock, SystemClock
from agent.core.errors import EdgeAgentError
from firmware_rollout._fs import in_thread
from firmware_rollout.artifact.manifest import HEADER_SIZE, MAX_CHUNK_SIZE, MAX_MANIFEST_SIZE, SIGNATURE_BLOCK_SIZE
from firmware_rollout.device.reboot import Rebooter
from firmware_rollout.device.slots import Installer, SlotView
from firmware_rollout.errors import ChunkMismatch, InstallError, UpdaterError

log = logging.getLogger(__name__)

Op = Literal["describe", "open_slot", "write_chunk", "check_slot", "read_slot", "mark_trial", "commit", "revert",
             "reboot"]
SlotName = Annotated[str, msgspec.Meta(max_length=16)]
MAX_FRAME = MAX_CHUNK_SIZE + 64 * 1024  # one chunk and its envelope
MAX_MANIFEST = HEADER_SIZE + MAX_MANIFEST_SIZE + SIGNATURE_BLOCK_SIZE  # the largest signed manifest
_LENGTH = struct.Struct(">I")
REBOOT_REPLY_TIMEOUT_S = 900.0  # a reboot that returns takes the reboot command's settle time
MAX_CONNECTIONS = 4  # the agent needs one; a client holding more gets refused
IDLE_TIMEOUT_S = 600.0  # a connection that sends nothing for this long is closed


class HelperRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    op: Op
    slot: SlotName = ""
    index: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 0
    offset: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)] = 0
    length: Annotated[int, msgspec.Meta(ge=0, le=MAX_CHUNK_SIZE)] = 0
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_CHUNK_SIZE)] = b""
    signed_manifest: Annotated[bytes, msgspec.Meta(max_length=MAX_MANIFEST)] = b""
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


class InstallHelper:
    """Serves one installer and one rebooter on a listening Unix socket; requests of all
    connections run one at a time."""

    def __init__(self, installer: Installer, rebooter: Rebooter, *, allowed_gids: frozenset[int] = frozenset()) -> None:
        self._installer = installer
        self._rebooter = rebooter
        self._allowed_gids = allowed_gids  # empty: whoever the socket's mode lets in
        self._lock = asyncio.Lock()
        self._connections = 0
        self.refused = 0

    async def serve(self, sock: socket.socket) -> None:
        server = await asyncio.start_unix_server(self._connection, sock=sock)
        async with server:
            await server.serve_forever()

    def _peer_allowed(self, writer: asyncio.StreamWriter) -> bool:
        if not self._allowed_gids:
            return True
        sock = writer.get_extra_info("socket")
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, gid = struct.unpack("3i", creds)
        return uid == 0 or gid in self._allowed_gids

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        try:
            if not self._peer_allowed(writer):
                log.warning("refused a connection from a process outside the allowed groups")
                return
            if self._connections > MAX_CONNECTIONS:
                log.warning("refused a connection: %d are open already", MAX_CONNECTIONS)
                return
            while True:
                try:
                    head = await asyncio.wait_for(reader.readexactly(_LENGTH.size), IDLE_TIMEOUT_S)
                except (asyncio.IncompleteReadError, TimeoutError):
                    return
                (length,) = _LENGTH.unpack(head)
                if length > MAX_FRAME:
                    writer.write(frame(_encode(HelperReply(ok=False, error=f"request of {length} bytes is over "
                                                                          f"the {MAX_FRAME} limit"))))
                    await writer.drain()
                    return
                reply = await self.handle(await asyncio.wait_for(reader.readexactly(length), IDLE_TIMEOUT_S))
                writer.write(frame(_encode(reply)))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            return
        finally:
            self._connections -= 1
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def handle(self, payload: bytes) -> HelperReply:
        try:
            request = _decode_request(payload)
        except msgspec.DecodeError as exc:  # ValidationError is one
            self.refused += 1
            return HelperReply(ok=False, error=f"refused: not a request ({exc})")
        async with self._lock:
            try:
                data = await self._do(request)
            except (EdgeAgentError, OSError) as exc:
                self.refused += 1
                log.warning("refused %s of slot %s: %s", request.op, request.slot or "-", exc)
                return HelperReply(ok=False, error=str(exc), mismatch=isinstance(exc, ChunkMismatch),
                                   state=state_of(self._installer))
            return HelperReply(ok=True, state=state_of(self._installer), data=data)

    async def _do(self, r: HelperRequest) -> bytes:
        installer = self._installer
        if r.op == "describe":
            return b""
        if r.op == "reboot":
            log.info("reboot%s asked for: %s", " into the trial" if r.trial else "", r.reason)
            await self._rebooter.reboot(r.reason or "asked by the agent", trial=r.trial)
            return b""
        if r.slot not in installer.slots:
            raise InstallError(f"no slot {r.slot!r} here (this helper manages {', '.join(installer.slots)})")
        if r.op == "open_slot":
            await installer.open_slot(r.slot, r.signed_manifest)
        elif r.op == "write_chunk":
            await installer.write_chunk(r.slot, r.index, r.data)
        elif r.op == "check_slot":
            await installer.check_slot(r.slot)
        elif r.op == "read_slot":
            return await installer.read_slot(r.slot, r.offset, r.length)
        elif r.op == "mark_trial":
            await installer.mark_trial(r.slot)
        elif r.op == "commit":
            await installer.commit(r.slot)
        else:
            await installer.revert(r.slot)
        return b""


class HelperError(InstallError):
    """The helper refused a request, or cannot be reached."""


class HelperInstaller:
    """The `Installer` (and `Rebooter`) of an unprivileged agent: every step is a request to the
    root helper on `socket_path`; the helper's state after each step answers the queries."""

    def __init__(self, socket_path: str | Path, *, clock: Clock | None = None, timeout_s: float = 600.0) -> None:
        self._path = str(socket_path)
        self._clock = clock or SystemClock()
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._state: HelperState
        self._call(HelperRequest(op="describe"))  # sets self._state

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            try:
                sock.connect(self._path)
            except OSError as exc:
                sock.close()
                raise HelperError(f"the install helper at {self._path} does not answer: {exc.strerror or exc}"
                                  ) from None
            self._sock = sock
        return self._sock

    def _call(self, request: HelperRequest, *, timeout_s: float | None = None) -> HelperReply:
        sock = self._connect()
        try:
            sock.settimeout(timeout_s or self._timeout_s)
            sock.sendall(frame(_encode(request)))
            head = _recv_exact(sock, _LENGTH.size)
            (length,) = _LENGTH.unpack(head)
            if length > MAX_FRAME:
                raise HelperError(f"the install helper answered {length} bytes")
            reply = _decode_reply(_recv_exact(sock, length))
        except (OSError, msgspec.DecodeError, HelperError) as exc:
            self.close()
            raise HelperError(f"install helper at {self._path}: {exc}") from None
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
        await self._ask(HelperRequest(op="open_slot", slot=slot, signed_manifest=signed_manifest))

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
        try:
            await self._ask(HelperRequest(op="reboot", trial=trial, reason=reason[:200]),
                            timeout_s=REBOOT_REPLY_TIMEOUT_S)
        except HelperError as exc:
            raise UpdaterError(str(exc)) from None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise HelperError("the install helper closed the connection")
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
