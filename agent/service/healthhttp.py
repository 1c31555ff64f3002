"""A tiny HTTP/1.1 server for `GET /healthz` and `GET /metrics` (asyncio streams, no framework).

* `/healthz` runs every injected check concurrently, each bounded by `check_timeout_s`, and
  answers JSON: `{"status": "ok"|"fail", "checks": {name: {"ok": bool, "detail": str}}}` with
  200 when all pass, 503 otherwise.
* `/metrics` renders the injected collectors in Prometheus text format. A collector that raises
  is skipped and counted in `ea_metrics_collector_errors_total{collector=...}`.
* Anything else: 404 for an unknown path, 405 for a method other than GET/HEAD; the HTTP layer
  (`agent.service.http`) answers 400 for a malformed request, 431 for a request head over
  `max_request_bytes`, 408 when the head does not arrive within `request_timeout_s`. One request
  per connection (`Connection: close`), at most `max_connections` at a time.

It listens on a loopback address (`metrics.listen`, e.g. "127.0.0.1:9100"); empty means off.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.clock import Clock, SystemClock
from agent.core.errors import ConfigError, StoreUnavailable
from agent.service.checks import Check, CheckResult
from agent.service.http import HttpServer, Limits, Request, Response, text
from agent.service.prom import CONTENT_TYPE, Collector, MetricFamily, collect, family, render

log = logging.getLogger(__name__)

def parse_listen(value: str, *, allow_remote: bool = False, min_port: int = 0,
                 key: str = "metrics.listen") -> tuple[str, int] | None:
    """"127.0.0.1:9100" / "[::1]:9100" / "localhost:9100" -> (host, port); "" -> None (off).

    Only a loopback host unless `allow_remote`; port 0 (any free port) unless `min_port` says
    otherwise. A bad address is a `ConfigError` on `key` saying what is wrong."""
    text = value.strip()
    if not text:
        return None
    hint = " (expected HOST:PORT, e.g. 127.0.0.1:9100)"
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError("config", key, f"{value!r} has no host and port{hint}")
    if not port_text.isdigit() or not min_port <= int(port_text) <= 65535:
        raise ConfigError("config", key, f"port {port_text} is not {min_port}-65535{hint}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not allow_remote and host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(
                "config", key,
                f"{host!r} is not a loopback address (use 127.0.0.1, ::1 or localhost)",
            )
    return host, int(port_text)


class HealthServer:
    """`HealthServer(listen, checks, collectors, clock=...)`; `async with` or start()/stop()."""

    def __init__(
        self,
        listen: str,
        checks: Mapping[str, Check],
        collectors: Sequence[Collector] | Mapping[str, Collector] = (),
        *,
        clock: Clock | None = None,
        allow_remote: bool = False,
        max_request_bytes: int = 8192,
        request_timeout_s: float = 5.0,
        check_timeout_s: float = 2.0,
        max_connections: int = 16,
    ) -> None:
        self._address = parse_listen(listen, allow_remote=allow_remote)
        self._checks = dict(checks)
        if isinstance(collectors, Mapping):
            self._collectors = dict(collectors)
        else:
            self._collectors = {f"collector{i}": c for i, c in enumerate(collectors)}
        self._clock = clock or SystemClock()
        self._check_timeout_s = check_timeout_s
        self._http = HttpServer(self._handle, name="health endpoint", limits=Limits(
            max_head_bytes=max_request_bytes, head_timeout_s=request_timeout_s, body_timeout_s=request_timeout_s,
            send_timeout_s=4 * request_timeout_s, max_connections=max_connections, keep_alive=False))
        self._server: asyncio.Server | None = None
        self.collector_errors: dict[str, int] = {}

    @property
    def requests(self) -> int:
        return self._http.stats.requests

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def add_check(self, name: str, check: Check) -> None:
        """Add or replace a check; served from the next request on."""
        self._checks[name] = check

    def add_collector(self, name: str, collector: Collector) -> None:
        self._collectors[name] = collector

    def remove(self, name: str) -> None:
        """Drop a check and a collector of this name (the parts of an agent started again)."""
        self._checks.pop(name, None)
        self._collectors.pop(name, None)

    @property
    def address(self) -> tuple[str, int] | None:
        """The bound (host, port) once started (the real port when 0 was asked for)."""
        if self._server is None or not self._server.sockets:
            return None
        name = self._server.sockets[0].getsockname()
        return str(name[0]), int(name[1])

    async def start(self) -> None:
        if self._address is None or self._server is not None:
            return
        host, port = self._address
        try:
            self._server = await asyncio.start_server(self._http.connection, host, port, reuse_address=True,
                                                      backlog=self._http.backlog)
        except OSError as exc:
            raise ConfigError(
                "config", "metrics.listen", f"cannot listen on {host}:{port}: {exc.strerror}"
            ) from exc
        bound = self.address
        log.info("health and metrics endpoint listening",
                 extra={"kv": {"address": f"{bound[0]}:{bound[1]}" if bound else "?"}})

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await self._http.close()
        await server.wait_closed()

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the endpoints -------------------------------------------------------------------------
    async def _run_check(self, check: Check) -> CheckResult:
        try:
            ok, detail = await self._clock.wait_for(check(), self._check_timeout_s)
        except TimeoutError:
            return False, f"timed out after {self._check_timeout_s}s"
        except Exception as exc:
            return False, f"error: {type(exc).__name__}: {exc}"
        return bool(ok), str(detail)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Run the checks: (healthy, JSON-able body)."""
        names = list(self._checks)
        results = await asyncio.gather(*(self._run_check(self._checks[n]) for n in names))
        healthy = all(ok for ok, _ in results)
        body = {
            "status": "ok" if healthy else "fail",
            "checks": {n: {"ok": ok, "detail": d} for n, (ok, d) in zip(names, results, strict=True)},
        }
        return healthy, body

    async def metrics_text(self) -> str:
        families: list[MetricFamily] = []
        for name, collector in self._collectors.items():
            try:
                families.extend(await collect(collector))
            except StoreUnavailable as exc:  # (its database lost: said once where that is watched)
                self.collector_errors[name] = self.collector_errors.get(name, 0) + 1
                log.debug("metrics collector failed: %s", exc, extra={"kv": {"collector": name}})
            except Exception:
                self.collector_errors[name] = self.collector_errors.get(name, 0) + 1
                log.exception("metrics collector failed", extra={"kv": {"collector": name}})
        families.append(
            family(
                "ea_metrics_collector_errors_total", "counter",
                "Scrapes on which a metrics collector raised.",
                (({"collector": n}, v) for n, v in sorted(self.collector_errors.items())),
            )
        )
        return render(families)

    # -- HTTP ------------------------------------------------------------------------------------
    async def _handle(self, request: Request) -> Response:
        path = request.path
        if path not in ("/healthz", "/metrics"):
            return text(404, "not found")
        if request.method not in ("GET", "HEAD"):
            return text(405, "method not allowed", headers=(("Allow", "GET, HEAD"),))
        no_store = (("Cache-Control", "no-store"),)
        if path == "/healthz":
            healthy, body = await self.health()
            payload = (json.dumps(body, sort_keys=True) + "\n").encode()
            return Response(200 if healthy else 503, payload, "application/json", headers=no_store)
        return Response(200, (await self.metrics_text()).encode(), CONTENT_TYPE, headers=no_store)


__all__ = ["HealthServer", "parse_listen"]
