"""The operator's side of remote sessions: `edge-agent devices shell`, `forward` and `close`
through the leader's operator socket (docs/remote.md).

A shell copies stdin to the device and the device's stdout and stderr back, each under the
session's window, and returns the remote exit code. On a terminal it puts the local terminal in
raw mode and tells the device the window's size as it changes. A forward listens on a local
port and opens a session for each connection made to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, BinaryIO

from agent.remote.flow import FlowError, Receiver, Sender
from agent.remote.frames import (
    FRAME_DATA_MAX,
    Accepted,
    Ack,
    Close,
    CloseSession,
    Data,
    Eof,
    Exit,
    Frame,
    FrameError,
    Open,
    Refused,
    Resize,
    framed,
    read_framed,
)

FAILED = 255  # the exit status of a session that could not run (ssh's)


class SessionRefused(Exception):
    """The leader or the device refused the session; the reason is the message."""


class _Link:
    """One session over the operator socket: its frames in and out, its window each way."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sid: str) -> None:
        self.reader = reader
        self.writer = writer
        self.sid = sid
        self.sender = Sender(sid, self._send_data)
        self.receiver = Receiver(sid)
        self.exit_code: int | None = None
        self.reason = ""

    async def _send_data(self, frame: Data) -> None:
        await self.send(frame)

    async def send(self, frame: Frame) -> None:
        self.writer.write(framed(frame))
        await self.writer.drain()

    async def delivered(self, n: int) -> None:
        ack = self.receiver.delivered(n)
        if ack is not None:
            await self.send(ack)


async def _open(socket_path: Path, frame: Open | CloseSession) -> tuple[asyncio.StreamReader, asyncio.StreamWriter,
                                                                       Frame]:
    try:
        reader, writer = await asyncio.open_unix_connection(str(socket_path), limit=FRAME_DATA_MAX * 4)
    except OSError as exc:
        raise SessionRefused(f"{socket_path}: {exc.strerror or exc} (is the leader running, with [remote] operators,"
                             " and may this user use its socket?)") from None
    writer.write(framed(frame))
    await writer.drain()
    answer = await read_framed(reader)
    if answer is None:
        writer.close()
        raise SessionRefused("the leader closed the connection without an answer")
    if isinstance(answer, Refused):
        writer.close()
        raise SessionRefused(answer.reason)
    return reader, writer, answer


async def close_session(socket_path: Path, sid: str) -> str:
    """Ask the leader to end session `sid`; what it said."""
    _, writer, answer = await _open(socket_path, CloseSession(sid=sid))
    writer.close()
    return answer.reason if isinstance(answer, Close) else f"the leader answered {type(answer).__name__}"


async def _pump_in(link: _Link, sink: Callable[[int, bytes], Awaitable[None]], done: asyncio.Future[None]) -> None:
    """Frames from the leader until the session closes."""
    try:
        while True:
            frame = await read_framed(link.reader)
            if frame is None:
                link.reason = link.reason or "the leader closed the connection"
                return
            if isinstance(frame, Data):
                link.receiver.take(frame)
                await sink(frame.stream, frame.data)
                await link.delivered(len(frame.data))
            elif isinstance(frame, Ack):
                link.sender.ack(frame)
            elif isinstance(frame, Exit):
                link.exit_code = frame.code
            elif isinstance(frame, Eof):
                await sink(-1, b"")
            elif isinstance(frame, Close):
                link.reason = frame.reason
                return
    except (FlowError, FrameError, OSError) as exc:
        link.reason = str(exc)
    finally:
        link.sender.close()
        if not done.done():
            done.set_result(None)


async def _carry(link: _Link, sink: Callable[[int, bytes], Awaitable[None]],
                 feed: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
    """The session's frames into `sink` and `feed`'s data out, until the session closes."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    pump = loop.create_task(_pump_in(link, sink, done))
    feeding = loop.create_task(feed()) if feed is not None else None
    try:
        await done
    finally:
        if feeding is not None:
            feeding.cancel()
        pump.cancel()


async def shell(socket_path: Path, device: str, argv: tuple[str, ...], *, stdin: BinaryIO | None = None,
                stdout: BinaryIO | None = None, stderr: BinaryIO | None = None, terminal: bool | None = None) -> int:
    """Run `argv` (none: a login shell) on `device`; its exit code (`FAILED` when it could not run)."""
    stdin = stdin if stdin is not None else sys.stdin.buffer
    stdout = stdout if stdout is not None else sys.stdout.buffer
    stderr = stderr if stderr is not None else sys.stderr.buffer
    tty = terminal if terminal is not None else (os.isatty(stdin.fileno()) and os.isatty(stdout.fileno()))
    rows, cols = _size(stdout) if tty else (0, 0)
    reader, writer, answer = await _open(socket_path, Open(device=device, op="shell", argv=argv, pty=tty,
                                                           rows=rows, cols=cols))
    assert isinstance(answer, Accepted)
    link = _Link(reader, writer, answer.sid)

    async def sink(stream: int, data: bytes) -> None:
        out = stderr if stream == 2 else stdout
        if data:
            out.write(data)
            out.flush()

    loop = asyncio.get_running_loop()
    typed: asyncio.Queue[bytes] = asyncio.Queue(maxsize=4)
    threading.Thread(target=_read_into, args=(stdin.fileno(), typed, loop), daemon=True,
                     name="stdin").start()

    async def feed() -> None:
        while chunk := await typed.get():
            await link.sender.send(chunk)
        await link.send(Eof(sid=link.sid))

    restore = _raw(stdin) if tty else None
    if tty:
        loop.add_signal_handler(signal.SIGWINCH, lambda: loop.create_task(
            link.send(Resize(sid=link.sid, rows=_size(stdout)[0], cols=_size(stdout)[1]))))
    try:
        await _carry(link, sink, feed)
    finally:
        if tty:
            loop.remove_signal_handler(signal.SIGWINCH)
        if restore is not None:
            restore()
        writer.close()
    if link.exit_code is None:
        stderr.write(f"edge-agent devices shell: the session ended: {link.reason or 'no exit code'}\n".encode())
        stderr.flush()
        return FAILED
    return link.exit_code if link.exit_code >= 0 else 128 - link.exit_code


def _read_into(fd: int, queue: asyncio.Queue[bytes], loop: asyncio.AbstractEventLoop) -> None:
    """stdin into `queue` (b"" at its end), in a thread of its own: a file, a pipe or a terminal
    alike, and a daemon, so a session that ended while the terminal waits for a key ends the
    command at once (an executor's thread would hold its exit until the key)."""
    while True:
        try:
            chunk = os.read(fd, FRAME_DATA_MAX)
        except OSError:
            chunk = b""
        try:
            asyncio.run_coroutine_threadsafe(queue.put(chunk), loop).result()
        except (RuntimeError, concurrent.futures.CancelledError):  # the loop is gone: the session ended
            return
        if not chunk:
            return


def _size(out: BinaryIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(out.fileno())
    except OSError:
        return 0, 0
    return min(size.lines, 1000), min(size.columns, 1000)


def _raw(stdin: BinaryIO) -> Callable[[], None] | None:
    import termios
    import tty

    fd = stdin.fileno()
    try:
        saved = termios.tcgetattr(fd)
        tty.setraw(fd, termios.TCSADRAIN)  # (not TCSAFLUSH: what was typed ahead goes too)
    except termios.error:
        return None
    return lambda: termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def logs(socket_path: Path, device: str, out: Path, *, since_s: int, units: tuple[str, ...] = (),
               say: Callable[[str], None] | None = None, on_behalf_of: str = "") -> int:
    """Fetch a log bundle of `device` into `out` (gzip), going on with a cut one (`out` and its
    `.part` record of the bundle); the bundle's size."""
    import json

    part = out.with_name(out.name + ".part")
    bundle, offset = "", 0
    if part.is_file() and out.is_file():
        try:
            kept = json.loads(part.read_text())
            if kept.get("device") == device:
                bundle, offset = str(kept["bundle"]), out.stat().st_size
        except (OSError, ValueError, KeyError):
            bundle, offset = "", 0
    reader, writer, answer = await _open(socket_path, Open(device=device, op="logs", since_s=since_s, units=units,
                                                           bundle=bundle, offset=offset,
                                                           operator=on_behalf_of[:128]))
    assert isinstance(answer, Accepted)
    part.write_text(json.dumps({"device": device, "bundle": answer.bundle}))
    if say is not None:
        say(f"{device}: bundle {answer.bundle}, {answer.size:,} bytes compressed"
            + (f", going on from byte {offset:,}" if offset else ""))
    link = _Link(reader, writer, answer.sid)
    with out.open("ab" if offset else "wb") as sink_file:

        async def sink(stream: int, data: bytes) -> None:
            if data:
                sink_file.write(data)

        try:
            await _carry(link, sink)
        finally:
            writer.close()
    if link.exit_code != 0 or out.stat().st_size != answer.size:
        raise SessionRefused(f"the bundle stopped at byte {out.stat().st_size:,} of {answer.size:,}"
                             f" ({link.reason or 'no reason given'}): run the same command again to go on")
    part.unlink(missing_ok=True)
    return answer.size


async def forward(socket_path: Path, device: str, listen: tuple[str, int], host: str, port: int, *,
                  ready: Callable[[int], None] | None = None, say: Callable[[str], None] | None = None) -> None:
    """Listen on `listen`; carry each connection to `host:port` as the device sees it (until canceled)."""

    async def connection(local_reader: asyncio.StreamReader, local_writer: asyncio.StreamWriter) -> None:
        try:
            reader, writer, answer = await _open(socket_path, Open(device=device, op="forward", host=host,
                                                                   port=port))
        except SessionRefused as exc:
            if say is not None:
                say(f"refused: {exc}")
            local_writer.close()
            return
        assert isinstance(answer, Accepted)
        link = _Link(reader, writer, answer.sid)

        async def sink(stream: int, data: bytes) -> None:
            if stream == -1:
                if local_writer.can_write_eof():
                    local_writer.write_eof()
                return
            local_writer.write(data)
            await local_writer.drain()

        async def feed() -> None:
            while chunk := await local_reader.read(FRAME_DATA_MAX):
                await link.sender.send(chunk)
            await link.send(Eof(sid=link.sid))

        try:
            await _carry(link, sink, feed)
        finally:
            with contextlib.suppress(OSError, ConnectionError):
                await link.send(Close(sid=link.sid))
            writer.close()
            local_writer.close()
            if say is not None and link.reason:
                say(f"session {link.sid}: {link.reason}")

    server = await asyncio.start_server(connection, listen[0], listen[1])
    bound = server.sockets[0].getsockname()[1]
    if ready is not None:
        ready(bound)
    async with server:
        await server.serve_forever()


__all__ = ["FAILED", "SessionRefused", "close_session", "forward", "logs", "shell"]
