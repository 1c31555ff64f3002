"""A real mosquitto broker for tests and benchmarks, on a free loopback port.

`Mosquitto(workdir).start()` writes a config (listener on 127.0.0.1, anonymous, TCP_NODELAY,
large queues, persistence off unless asked), starts the broker, and returns once it accepts
connections. `stop()` ends it by its process id (SIGTERM, then SIGKILL); `restart()` brings the
same broker back on the same port, so tests can take the broker away mid-stream.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/usr/bin/mosquitto")


class MosquittoMissing(RuntimeError):
    pass


def find_executable(name: str, candidates: tuple[str, ...]) -> str | None:
    """`name` on PATH, else the first of `candidates` that is executable (Debian puts daemons in
    /usr/sbin, which is not on every user's PATH)."""
    found = shutil.which(name)
    if found:
        return found
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def find_mosquitto() -> str:
    found = find_executable("mosquitto", CANDIDATES)
    if found:
        return found
    raise MosquittoMissing(
        "mosquitto is not installed (looked on PATH and in /usr/sbin): install Debian's "
        "`mosquitto` package (apt-get install -y mosquitto); the MQTT tests need a real broker"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class TlsFiles:
    """Server side of a TLS listener: the CA that signs client certs, the server cert and key."""

    ca_file: str
    cert_file: str
    key_file: str
    require_client_cert: bool = True


class Mosquitto:
    """One mosquitto process we own; stopped only by its own pid."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        port: int | None = None,
        persistence: bool = False,
        max_queued_messages: int = 1_000_000,
        message_size_limit: int = 0,  # bytes per MQTT packet; 0 = mosquitto's default
        password_file: str | Path | None = None,  # made with mosquitto_passwd; turns anonymous off
        tls: TlsFiles | None = None,
        extra_config: str = "",
    ) -> None:
        self.binary = find_mosquitto()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.persistence = persistence
        self.max_queued_messages = max_queued_messages
        self.message_size_limit = message_size_limit
        self.password_file = password_file
        self.tls = tls
        self.extra_config = extra_config
        self.config_path = self.workdir / "mosquitto.conf"
        self.log_path = self.workdir / "mosquitto.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "mqtts" if self.tls is not None else "mqtt"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def config_text(self) -> str:
        lines = [
            f"listener {self.port} 127.0.0.1",
            f"allow_anonymous {'false' if self.password_file else 'true'}",
            "set_tcp_nodelay true",
            f"max_queued_messages {self.max_queued_messages}",
            "max_queued_bytes 0",
            "max_inflight_messages 100",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
        ]
        if self.password_file:
            lines.append(f"password_file {self.password_file}")
        if self.tls is not None:
            lines += [
                f"cafile {self.tls.ca_file}",
                f"certfile {self.tls.cert_file}",
                f"keyfile {self.tls.key_file}",
                f"require_certificate {'true' if self.tls.require_client_cert else 'false'}",
            ]
        if self.message_size_limit:
            lines.append(f"max_packet_size {self.message_size_limit}")
        if os.geteuid() == 0:
            lines.append("user root")  # else mosquitto drops to `mosquitto`, who owns no tmp dir
        if self.persistence:
            data = self.workdir / "data"
            data.mkdir(exist_ok=True)
            lines += ["persistence true", f"persistence_location {data}/", "autosave_interval 1"]
        else:
            lines.append("persistence false")
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 10.0) -> Mosquitto:
        if self.running:
            return self
        self.config_path.write_text(self.config_text())
        log = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                [self.binary, "-c", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self._proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError):
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"mosquitto did not accept connections in {timeout_s}s: {self.log_tail()}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM by pid, SIGKILL if it lingers. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL by pid: the broker dies without saving anything."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5.0)

    def restart(self, timeout_s: float = 10.0) -> Mosquitto:
        self.stop()
        return self.start(timeout_s)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
