"""Everything that makes `edge-agent run` a well-behaved systemd service, in one context manager.

    runtime = ServiceRuntime(clock=clock, metrics_listen=config.metrics.listen)
    async with runtime:                       # signals, watchdog, /healthz + /metrics
        store = await OutboxStore.open(...)
        runtime.add_check("database", sqlite_writable_check(path, clock=clock))
        runtime.add_collector("outbox", outbox_collector(store.stats))
        runtime.shutdown.add("stop actors", system.stop)     # stop taking work
        runtime.shutdown.add("stop relay", relay.stop)
        runtime.shutdown.add("close outbox", store.close)    # flush pending writes
        runtime.shutdown.add("stop transport", transport.stop)
        runtime.ready("running")                             # READY=1, once all is up
        await runtime.wait_stop()                            # SIGTERM / SIGINT
    # leaving: STOPPING=1, the shutdown steps in order, then the watchdog and the endpoint stop

Checks and collectors may be added before or after entering; the endpoint reads them per request.
The process series (RSS, CPU seconds, fds, threads) are always exported unless
`process_metrics=False`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

from agent.core.clock import Clock
from agent.service.checks import Check, problem_check
from agent.service.collectors import process_collector
from agent.service.healthhttp import HealthServer
from agent.service.prom import Collector
from agent.service.sdnotify import Notifier, Watchdog
from agent.service.signals import ServiceSignals, ShutdownSequence, StepFailure

log = logging.getLogger(__name__)


class ServiceRuntime:
    def __init__(
        self,
        *,
        clock: Clock,
        metrics_listen: str = "",
        checks: Mapping[str, Check] | None = None,
        collectors: Mapping[str, Collector] | None = None,
        env: Mapping[str, str] | None = None,
        on_reload: Callable[[], Awaitable[object]] | None = None,
        watchdog_alive: Callable[[], bool] | None = None,
        step_timeout_s: float = 10.0,
        install_signals: bool = True,
        process_metrics: bool = True,
    ) -> None:
        self.clock = clock
        self.notifier = Notifier(env=env)
        self.signals = ServiceSignals()
        self.shutdown = ShutdownSequence(clock=clock, notifier=self.notifier,
                                         step_timeout_s=step_timeout_s)
        self._liveness: list[Callable[[], bool]] = [watchdog_alive] if watchdog_alive is not None else []
        self._part_liveness: list[Callable[[], bool]] = []  # the parts': forgotten at `restart_parts`
        self._part_names: set[str] = set()
        self.watchdog = Watchdog(clock, self.notifier, env=env, alive=self._alive)
        self.health = HealthServer(metrics_listen, checks or {}, collectors or {}, clock=clock)
        if process_metrics:
            self.health.add_collector("process", process_collector())
        self._on_reload = on_reload
        self._install_signals = install_signals
        self._tasks: list[asyncio.Task[None]] = []
        self.failures: list[StepFailure] = []

    def add_liveness(self, name: str, problem: Callable[[], str | None], *, up: str = "alive") -> None:
        """A part whose death must restart the service: while `problem()` names one, `/healthz`
        fails with it and the watchdog pings stop, so systemd restarts the agent."""
        self._part_liveness.append(lambda: problem() is None)
        self.add_check(name, problem_check(problem, up=up))

    def _alive(self) -> bool:
        return all(alive() for alive in self._liveness) and all(alive() for alive in self._part_liveness)

    def add_check(self, name: str, check: Check) -> None:
        self._part_names.add(name)
        self.health.add_check(name, check)

    def add_collector(self, name: str, collector: Collector) -> None:
        self._part_names.add(name)
        self.health.add_collector(name, collector)

    async def restart_parts(self) -> list[StepFailure]:
        """Stop the parts as a shutdown would (their steps, in order), without leaving: their
        checks, collectors and liveness are forgotten, the parts started next add their own."""
        failures = await self.shutdown.run_for_restart()
        self._part_liveness.clear()
        for name in self._part_names:
            self.health.remove(name)
        self._part_names.clear()
        return failures

    def ready(self, status: str | None = None) -> bool:
        """READY=1: call once the database is open and the actors have started."""
        log.info("ready", extra={"kv": {"status": status or ""}})
        return self.notifier.ready(status)

    def status(self, text: str) -> bool:
        return self.notifier.status(text)

    async def wait_stop(self) -> int | None:
        return await self.signals.wait_stop()

    async def __aenter__(self) -> ServiceRuntime:
        if self._install_signals:
            self.signals.install()
        try:
            await self.health.start()
        except BaseException:
            self.signals.uninstall()
            self.notifier.close()
            raise
        self._tasks.append(asyncio.create_task(self.watchdog.run(), name="sd-watchdog"))
        self._tasks.append(asyncio.create_task(self._reload_loop(), name="sd-reload"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            self.failures = await self.shutdown.run()
        finally:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks.clear()
            await self.health.stop()
            self.signals.uninstall()
            self.notifier.close()

    async def _reload_loop(self) -> None:
        while True:
            await self.signals.reload.wait()
            self.signals.take_reload()
            self.notifier.reloading("reloading")
            try:
                if self._on_reload is not None:
                    await self._on_reload()
                else:
                    log.info("reload requested; nothing to reload")
            except Exception:
                log.exception("reload failed; keeping the running configuration")
            self.notifier.ready("running")


__all__ = ["ServiceRuntime"]
