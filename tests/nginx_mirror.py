"""A real nginx serving a directory as a static firmware mirror, on a free loopback port.

`NginxMirror(workdir).start()` writes a config (one server on 127.0.0.1, root `workdir/www`,
range requests as nginx always does them, access log with the Range header) and returns once it
accepts connections. Besides `/` (the mirror), two locations make the answers a test needs:
`/busy/...` answers 429 with `Retry-After: 3`, `/unavailable/...` 503 with `Retry-After: 1`.
It runs as one process (`master_process off`), so `stop(signal.SIGKILL)` cuts every download
at once. `stop()` ends it by its pid; `start()` again brings it back on the same port (a mirror that
disappears and returns).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from mosquitto import find_executable, free_port

CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx")


class NginxMissing(RuntimeError):
    pass


def find_nginx() -> str:
    found = find_executable("nginx", CANDIDATES)
    if found:
        return found
    raise NginxMissing("nginx is not installed: install Debian's `nginx` package (apt-get install -y nginx); the "
                       "HTTP mirror tests need a real static server")


class NginxMirror:
    def __init__(self, workdir: str | Path, *, port: int | None = None) -> None:
        self.binary = find_nginx()
        self.workdir = Path(workdir)
        self.www = self.workdir / "www"
        self.www.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.config_path = self.workdir / "nginx.conf"
        self.access_log = self.workdir / "access.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        w = self.workdir
        user = "user root;\n" if os.geteuid() == 0 else ""  # else workers run as nobody: no tmp dir access
        return f"""{user}daemon off;
master_process off;
pid {w}/nginx.pid;
error_log {w}/error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format mirror '$status $request_uri $http_range';
    access_log {w}/access.log mirror;
    client_body_temp_path {w}/tmp-body;
    proxy_temp_path {w}/tmp-proxy;
    fastcgi_temp_path {w}/tmp-fastcgi;
    uwsgi_temp_path {w}/tmp-uwsgi;
    scgi_temp_path {w}/tmp-scgi;
    default_type application/octet-stream;
    sendfile on;
    server {{
        listen 127.0.0.1:{self.port};
        root {self.www};
        location /busy/ {{ add_header Retry-After 3 always; return 429; }}
        location /unavailable/ {{ add_header Retry-After 1 always; return 503; }}
    }}
}}
"""

    def start(self, timeout_s: float = 10.0) -> NginxMirror:
        if self._proc is not None and self._proc.poll() is None:
            return self
        self.config_path.write_text(self.config_text())
        log = open(self.workdir / "nginx.out", "ab")
        try:
            self._proc = subprocess.Popen([self.binary, "-c", str(self.config_path), "-p", str(self.workdir)],
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.workdir / 'nginx.out').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("nginx did not start listening") from None
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """End it (one process: `master_process off`); SIGKILL cuts every connection at once."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def requests(self) -> list[tuple[int, str, str]]:
        """(status, uri, Range header) of every request served so far."""
        if not self.access_log.exists():
            return []
        out = []
        for line in self.access_log.read_text().splitlines():
            status, uri, *rng = line.split(" ", 2)
            out.append((int(status), uri, rng[0] if rng else ""))
        return out
