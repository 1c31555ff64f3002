"""The device's side of remote sessions (docs/remote.md): a shell, or a TCP connection forwarded to
an address its config allows, opened by its leader over the broker; no inbound port.

    session/down ──► RemoteSessions._on_frame ──► Open: checked against `[remote]` (off unless
                     it says so; a shell as the user it names, never root unless `allow_root`;
                     forwards only to its `forward` addresses; `max_sessions` at once), then a
                     ShellSession or ForwardSession, answered Accepted or Refused with the reason
                     ──► Data/Ack/Eof/Resize/Ping/Close: to the session they name
    session/up/{leader} ◄── the session's output, acknowledgements, exit code and end

Each session ends when either side closes it, its process exits (a shell) or both directions
ended (a forward), nothing came from the leader for `GONE_AFTER_S`, no data moved for `idle_s`,
after `max_s`, or the connection to the broker drops (its frames are QoS 0: a lost frame is a
gap in `seq`, and a session with a gap ends). Every session is recorded in the device's own
audit file (JSON lines: who, what, when, how long, bytes), beside its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.core.config import RemoteSection, resolve
from agent.core.errors import TransportError
from agent.remote.flow import FlowError, Receiver, Sender
from agent.remote.frames import (
    FRAME_DATA_MAX,
    GONE_AFTER_S,
    KEEPALIVE_S,
    Accepted,
    Ack,
    Close,
    Data,
    Eof,
    Exit,
    Frame,
    FrameError,
    Open,
    Ping,
    Refused,
    Resize,
    decode,
    encode,
)
from agent.service.parts import PartBase
from agent.transport import topics
from agent.transport.base import InboundMessage, Transport

log = logging.getLogger(__name__)

AUDIT_MAX_BYTES = 1024 * 1024  # the audit file is rotated (one old copy kept) beyond this
CONNECT_TIMEOUT_S = 10.0
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NO_LOGIN = ("nologin", "false")


class Refusal(Exception):
    """An open this device does not take: answered Refused with the reason."""


class RemoteSessions(PartBase):
    """The worker's remote sessions: the `session/down` subscription and the open sessions."""

    name = "remote sessions"

    def __init__(self, settings: RemoteSection, *, transport: Transport, fleet: str, device_id: str,
                 data_dir: Path, secrets: Callable[[], list[str]] = list) -> None:
        self.settings = settings
        self.data_dir = data_dir
        self.secrets = secrets  # the device's own secrets, taken out of a log bundle
        self.transport = transport
        self.fleet = fleet
        self.device_id = device_id
        self.audit_path = resolve(data_dir, settings.audit_file)
        self.sessions: dict[str, _Session] = {}
        self.refused = 0
        self.malformed = 0
        self._topic = topics.session_down(fleet, device_id)

    async def start(self) -> None:
        await self.transport.subscribe(self._topic, self._on_message, qos=0)

    async def stop(self) -> None:
        with contextlib.suppress(TransportError):
            await self.transport.unsubscribe(self._topic)
        for session in list(self.sessions.values()):
            await session.end("the agent is stopping")

    # -- frames from the leader ----------------------------------------------------------------
    def _on_message(self, message: InboundMessage) -> None:
        try:
            frame = decode(bytes(message.payload))
        except FrameError as exc:
            self.malformed += 1
            if self.malformed <= 10 or self.malformed % 1000 == 0:
                log.warning("remote session: a malformed frame refused (%s; %d so far)", exc, self.malformed)
            return
        if isinstance(frame, Open):
            self._open(frame)
            return
        session = self.sessions.get(frame.sid)
        if session is not None:
            session.take(frame)

    def _open(self, frame: Open) -> None:
        leader = frame.leader
        try:
            if not frame.sid or len(frame.sid) < 16:
                raise Refusal("a session needs the leader's id for it")
            if frame.device != self.device_id:
                raise Refusal(f"this is {self.device_id}, not {frame.device}")
            if frame.sid in self.sessions:
                raise Refusal("a session of that id is open already")
            if len(self.sessions) >= self.settings.max_sessions:
                raise Refusal(f"{len(self.sessions)} sessions are open on this device (remote.max_sessions)")
            session: _Session = (ShellSession(self, frame) if frame.op == "shell" else
                                 ForwardSession(self, frame) if frame.op == "forward" else LogsSession(self, frame))
            session.check()
        except Refusal as exc:
            self.refused += 1
            log.warning("remote %s by %s refused: %s", frame.op, frame.operator or "?", exc)
            self.audit("refused", sid=frame.sid, op=frame.op, operator=frame.operator, target=frame.target,
                       reason=str(exc))
            if leader:
                with contextlib.suppress(TransportError, topics.TopicError):
                    self.publish(leader, Refused(sid=frame.sid, reason=str(exc)[:512]))
            return
        self.sessions[frame.sid] = session
        session.task = asyncio.get_running_loop().create_task(session.run(), name=f"remote:{frame.sid}")

    # -- to the leader -------------------------------------------------------------------------
    def publish(self, leader: str, frame: Frame) -> None:
        self.transport.publish_nowait(topics.session_up(self.fleet, self.device_id, leader), encode(frame))

    def audit(self, event: str, **fields: Any) -> None:
        """One line of the device's audit file (rotated beyond `AUDIT_MAX_BYTES`, one old copy kept)."""
        line = json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event,
                           "device": self.device_id, **fields}, ensure_ascii=False, sort_keys=True) + "\n"
        try:
            self.audit_path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                if self.audit_path.stat().st_size > AUDIT_MAX_BYTES:
                    os.replace(self.audit_path, self.audit_path.with_name(self.audit_path.name + ".1"))
            fd = os.open(self.audit_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("%s: the session is not in the audit file: %s", self.audit_path, exc)


class _Session:
    """One open session: the frames it takes, its sender and receiver, its end."""

    def __init__(self, owner: RemoteSessions, frame: Open) -> None:
        self.owner = owner
        self.open = frame
        self.sid = frame.sid
        self.leader = frame.leader
        self.inbox: asyncio.Queue[Frame] = asyncio.Queue()
        self.sender = Sender(self.sid, self._send_data)
        self.receiver = Receiver(self.sid)
        self.task: asyncio.Task[None] | None = None
        self.started = time.monotonic()
        self.heard = time.monotonic()
        self.moved = time.monotonic()
        self.said = time.monotonic()
        self.reason = ""
        self.exit_code: int | None = None
        self._ended = False

    def check(self) -> None:
        """Refusal when the device's config does not take this session."""

    def accepted(self) -> Accepted:
        return Accepted(sid=self.sid)

    async def serve(self) -> None:
        """The session's own work until it is over."""

    # -- frames ---------------------------------------------------------------------------------
    def take(self, frame: Frame) -> None:
        self.heard = time.monotonic()
        if isinstance(frame, Ack):
            try:
                self.sender.ack(frame)
            except FlowError as exc:
                self._fail(str(exc))
        elif isinstance(frame, Close):
            self._fail(frame.reason or "closed by the operator")
        elif isinstance(frame, Data):
            try:
                self.receiver.take(frame)
            except FlowError as exc:
                self._fail(str(exc))
                return
            self.moved = time.monotonic()
            self.inbox.put_nowait(frame)
        elif isinstance(frame, Eof | Resize):
            self.inbox.put_nowait(frame)

    def _fail(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason
        if self.task is not None:
            self.task.cancel()

    def _say(self, frame: Frame) -> None:
        self.said = time.monotonic()
        self.owner.publish(self.leader, frame)

    async def _send_data(self, frame: Data) -> None:
        self.moved = time.monotonic()
        self._say(frame)

    async def delivered(self, n: int) -> None:
        ack = self.receiver.delivered(n)
        if ack is not None:
            self._say(ack)

    # -- the whole session ------------------------------------------------------------------------
    async def run(self) -> None:
        o = self.open
        self.owner.audit("opened", sid=self.sid, op=o.op, operator=o.operator, target=o.target,
                         user=getattr(self, "user", ""))
        log.info("remote %s %s by %s opened: %s", o.op, self.sid, o.operator or "?", o.target)
        watchdog = asyncio.get_running_loop().create_task(self._watch())
        try:
            self._say(self.accepted())
            await self.serve()
            if not self.reason:
                self.reason = "ended"
        except asyncio.CancelledError:
            if not self.reason:
                self.reason = "canceled"
        except (TransportError, topics.TopicError) as exc:
            self.reason = self.reason or f"the connection to the broker: {exc}"
        except (OSError, FlowError) as exc:
            self.reason = self.reason or str(exc)
        finally:
            watchdog.cancel()
            await self._finish()

    async def _watch(self) -> None:
        s = self.owner.settings
        while True:
            await asyncio.sleep(min(KEEPALIVE_S, 5.0))
            now = time.monotonic()
            why = (f"nothing from the leader for {GONE_AFTER_S:.0f} s" if now - self.heard > GONE_AFTER_S
                   else f"idle for {s.idle_s:.0f} s (remote.idle_s)" if now - self.moved > s.idle_s
                   else f"open for {s.max_s:.0f} s (remote.max_s)" if now - self.started > s.max_s else "")
            if why:
                self._fail(why)
                return
            if now - self.said >= KEEPALIVE_S:
                with contextlib.suppress(TransportError):
                    self._say(Ping(sid=self.sid))

    async def end(self, reason: str) -> None:
        self._fail(reason)
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _finish(self) -> None:
        if self._ended:
            return
        self._ended = True
        self.sender.close()
        await self.release()
        self.owner.sessions.pop(self.sid, None)
        with contextlib.suppress(TransportError, topics.TopicError):
            if self.exit_code is not None:
                self._say(Exit(sid=self.sid, code=max(-255, min(255, self.exit_code))))
            self._say(Close(sid=self.sid, reason=self.reason[:512]))
        o = self.open
        self.owner.audit("closed", sid=self.sid, op=o.op, operator=o.operator, target=o.target,
                         seconds=round(time.monotonic() - self.started, 1), bytes_in=self.receiver.received,
                         bytes_out=self.sender.sent, exit=self.exit_code, reason=self.reason)
        log.info("remote %s %s closed after %.0f s (%d bytes in, %d out): %s", o.op, self.sid,
                 time.monotonic() - self.started, self.receiver.received, self.sender.sent, self.reason)

    async def release(self) -> None:
        """Let go of what the session holds (its process, its socket)."""


class ShellSession(_Session):
    """A command, or a login shell (on a terminal when the operator's is one), as the user
    `remote.shell_user` names."""

    def check(self) -> None:
        s = self.owner.settings
        if not s.shell:
            raise Refusal("remote shells are off on this device (remote.shell)")
        me = pwd.getpwuid(os.geteuid())
        name = s.shell_user or me.pw_name
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise Refusal(f"no user {name!r} on this device (remote.shell_user)") from None
        if pw.pw_uid == 0 and not s.allow_root:
            raise Refusal("a shell as root needs remote.allow_root = true on the device")
        self.spawn: dict[str, Any] = {}
        if pw.pw_uid != os.geteuid():
            if os.geteuid() != 0:
                raise Refusal(f"the agent runs as {me.pw_name} and cannot start a shell as {name}")
            self.spawn = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": os.getgrouplist(name, pw.pw_gid)}
        self.user = name
        shell = pw.pw_shell if pw.pw_shell and not pw.pw_shell.endswith(NO_LOGIN) else "/bin/sh"
        self.argv = [shell, "-c", " ".join(self.open.argv)] if self.open.argv else [shell, "-l"]
        home = pw.pw_dir if os.path.isdir(pw.pw_dir) else "/"
        self.cwd = home
        self.env = {"HOME": home, "USER": name, "LOGNAME": name, "SHELL": shell, "PATH": SAFE_PATH,
                    "LANG": "C.UTF-8", "TERM": "xterm-256color" if self.open.pty else "dumb",
                    "EDGE_AGENT_SESSION": self.sid}
        self.proc: asyncio.subprocess.Process | None = None
        self._master = -1

    async def serve(self) -> None:
        if self.open.pty:
            await self._on_terminal()
        else:
            await self._on_pipes()

    async def _on_pipes(self) -> None:
        proc = self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=self.cwd, env=self.env, start_new_session=True, **self.spawn)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        stdin = proc.stdin

        async def out(stream: asyncio.StreamReader, number: Any) -> None:
            while chunk := await stream.read(FRAME_DATA_MAX):
                await self.sender.send(chunk, number)

        async def into() -> None:
            while True:
                frame = await self.inbox.get()
                if isinstance(frame, Eof):
                    stdin.close()
                    return
                if isinstance(frame, Data):
                    try:
                        stdin.write(frame.data)
                        await stdin.drain()
                    except (BrokenPipeError, ConnectionResetError):
                        return  # the process stopped reading: its output still comes
                    await self.delivered(len(frame.data))

        feeding = asyncio.get_running_loop().create_task(into())
        try:
            await asyncio.gather(out(proc.stdout, 1), out(proc.stderr, 2))
            self.exit_code = await proc.wait()
        finally:
            feeding.cancel()

    async def _on_terminal(self) -> None:
        import fcntl
        import pty
        import termios

        master, slave = pty.openpty()
        self._master = master
        self._resize(self.open.rows, self.open.cols)

        def controlling_terminal() -> None:  # (in the child, after setsid: the terminal becomes its own)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        try:
            proc = self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=slave, stdout=slave, stderr=slave, cwd=self.cwd, env=self.env,
                start_new_session=True, preexec_fn=controlling_terminal, **self.spawn)
        finally:
            os.close(slave)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=FRAME_DATA_MAX * 4)
        read_end, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                   os.fdopen(os.dup(master), "rb", buffering=0))
        write_end, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                            os.fdopen(os.dup(master), "wb", buffering=0))
        writer = asyncio.StreamWriter(write_end, protocol, None, loop)
        self._pipes = (read_end, write_end)

        async def out() -> None:
            while True:
                try:
                    chunk = await reader.read(FRAME_DATA_MAX)
                except OSError:  # EIO: the terminal's last holder closed it
                    return
                if not chunk:
                    return
                await self.sender.send(chunk, 1)

        async def into() -> None:
            while True:
                frame = await self.inbox.get()
                if isinstance(frame, Resize):
                    self._resize(frame.rows, frame.cols)
                elif isinstance(frame, Eof):
                    writer.write(b"\x04")
                elif isinstance(frame, Data):
                    writer.write(frame.data)
                    await writer.drain()
                    await self.delivered(len(frame.data))

        feeding = asyncio.get_running_loop().create_task(into())
        try:
            await out()
            self.exit_code = await proc.wait()
        finally:
            feeding.cancel()

    def _resize(self, rows: int, cols: int) -> None:
        if self._master < 0 or not rows or not cols:
            return
        import fcntl
        import struct
        import termios

        with contextlib.suppress(OSError):
            fcntl.ioctl(self._master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    async def release(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            for sig in (signal.SIGHUP, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
                try:
                    await asyncio.wait_for(proc.wait(), 3.0)
                    break
                except TimeoutError:
                    continue
        for end in getattr(self, "_pipes", ()):
            end.close()
        if self._master >= 0:
            with contextlib.suppress(OSError):
                os.close(self._master)
            self._master = -1


def allowed(patterns: tuple[str, ...], host: str, port: int) -> bool:
    """Whether `host:port` is among `remote.forward` ("HOST:PORT" or "HOST:*"; names as given)."""
    for pattern in patterns:
        allowed_host, _, allowed_port = pattern.rpartition(":")
        if allowed_host.strip("[]") == host.strip("[]") and allowed_port in ("*", str(port)):
            return True
    return False


class ForwardSession(_Session):
    """A TCP connection the device makes to an address its `remote.forward` allows."""

    def check(self) -> None:
        o, s = self.open, self.owner.settings
        if not s.forward:
            raise Refusal("port forwarding is off on this device (remote.forward)")
        if not allowed(s.forward, o.host, o.port):
            raise Refusal(f"{o.host}:{o.port} is not among the addresses this device forwards to"
                          f" (remote.forward: {', '.join(s.forward)})")
        self.writer: asyncio.StreamWriter | None = None

    async def run(self) -> None:
        o = self.open
        try:
            reader, self.writer = await asyncio.wait_for(asyncio.open_connection(o.host, o.port), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            why = f"{o.host}:{o.port}: {getattr(exc, 'strerror', None) or exc or 'no answer'}"
            self.owner.sessions.pop(self.sid, None)
            self.owner.audit("refused", sid=self.sid, op=o.op, operator=o.operator, target=o.target, reason=why)
            with contextlib.suppress(TransportError, topics.TopicError):
                self._say(Refused(sid=self.sid, reason=why[:512]))
            return
        self._reader = reader
        await super().run()

    async def serve(self) -> None:
        reader, writer = self._reader, self.writer
        assert writer is not None

        async def out() -> None:
            while chunk := await reader.read(FRAME_DATA_MAX):
                await self.sender.send(chunk, 1)
            with contextlib.suppress(TransportError):
                self._say(Eof(sid=self.sid))

        async def into() -> None:
            while True:
                frame = await self.inbox.get()
                if isinstance(frame, Eof):
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                if isinstance(frame, Data):
                    writer.write(frame.data)
                    await writer.drain()
                    await self.delivered(len(frame.data))

        await asyncio.gather(out(), into())

    async def release(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await self.writer.wait_closed()


BUNDLES = "bundles"  # under the data dir: the log bundles being fetched (resumable)
BUNDLES_KEPT = 4
BUNDLE_KEPT_S = 3600.0
JOURNAL_RAW_MAX = 256 * 1024 * 1024  # journal text read for one bundle at most, before compression


class LogsSession(_Session):
    """A diagnostics bundle: the journal since `since_s` (of `units`, or every unit) and the agent's
    own recent log, each line redacted, gzip-compressed into a file under the data dir (so a cut
    download resumes where it stopped: `bundle` and `offset`), sent at `remote.logs_rate_kib_s`."""

    def check(self) -> None:
        if not self.owner.settings.logs:
            raise Refusal("log bundles are off on this device (remote.logs)")
        self.path: Path | None = None
        self.size = 0

    def accepted(self) -> Accepted:
        return Accepted(sid=self.sid, bundle=self.path.stem.split(".")[0] if self.path else "", size=self.size)

    async def run(self) -> None:
        try:
            self.path = await self._bundle()
            self.size = self.path.stat().st_size
            if self.open.offset > self.size:
                raise OSError(f"offset {self.open.offset} is beyond the bundle's {self.size} bytes")
        except OSError as exc:
            self.owner.sessions.pop(self.sid, None)
            why = f"no bundle: {exc}"
            self.owner.audit("refused", sid=self.sid, op="logs", operator=self.open.operator,
                             target=self.open.target, reason=why)
            with contextlib.suppress(TransportError, topics.TopicError):
                self._say(Refused(sid=self.sid, reason=why[:512]))
            return
        await super().run()

    async def serve(self) -> None:
        assert self.path is not None
        pace = self.owner.settings.logs_rate_kib_s * 1024
        with self.path.open("rb") as f:
            f.seek(self.open.offset)
            while chunk := f.read(FRAME_DATA_MAX):
                started = time.monotonic()
                await self.sender.send(chunk, 1)
                await asyncio.sleep(max(0.0, len(chunk) / pace - (time.monotonic() - started)))
        self.exit_code = 0

    async def _bundle(self) -> Path:
        folder = self.owner.data_dir / BUNDLES
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        kept = sorted(folder.glob("*.log.gz"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[BUNDLES_KEPT:] + [p for p in kept if time.time() - p.stat().st_mtime > BUNDLE_KEPT_S]:
            with contextlib.suppress(OSError):
                old.unlink()
        if self.open.bundle:
            again = folder / f"{self.open.bundle}.log.gz"
            if again.is_file():
                return again
            raise OSError(f"bundle {self.open.bundle} is gone (kept {BUNDLE_KEPT_S / 3600:.0f} h): fetch a new one")
        path = folder / f"{secrets.token_hex(8)}.log.gz"
        await asyncio.get_running_loop().run_in_executor(None, self._write, path)
        return path

    def _write(self, path: Path) -> None:
        """The bundle's file (in a thread: journalctl's output, redacted, compressed)."""
        import gzip
        import subprocess

        from agent.core.redact import redact_lines
        from agent.service.journal import journal_command
        from agent.service.logs import recent_log

        o, owner = self.open, self.owner
        literals = owner.secrets()
        limit = owner.settings.logs_max_mib * 1024 * 1024
        since_ms = int((time.time() - o.since_s) * 1000)
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=6) as out:
            out.write(f"# edge-agent log bundle of {owner.device_id}: since {o.since_s} s, "
                      f"{', '.join(o.units) if o.units else 'every unit'}; secrets redacted on the device\n")
            ring = recent_log()
            out.write("-- edge-agent (this start's recent lines) --\n")
            out.writelines(line + "\n" for line in redact_lines(ring.since(since_ms) if ring else [], literals))
            argv = journal_command(o.units, since_ms=since_ms)
            out.write(f"-- journal: {', '.join(o.units) if o.units else 'every unit'} --\n")
            if argv is None:
                out.write("(journalctl is not installed)\n")
                return
            with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                  text=True, errors="replace") as proc:
                assert proc.stdout is not None
                raw = 0
                batch: list[str] = []
                for line in proc.stdout:
                    raw += len(line)
                    batch.append(line.rstrip("\n"))
                    if len(batch) >= 512:
                        out.writelines(x + "\n" for x in redact_lines(batch, literals))
                        batch = []
                        if raw > JOURNAL_RAW_MAX or path.stat().st_size > limit:
                            out.write(f"(cut: the bundle reached its bound, remote.logs_max_mib = "
                                      f"{owner.settings.logs_max_mib})\n")
                            proc.kill()
                            break
                out.writelines(x + "\n" for x in redact_lines(batch, literals))


__all__ = ["ForwardSession", "LogsSession", "RemoteSessions", "ShellSession", "allowed"]
