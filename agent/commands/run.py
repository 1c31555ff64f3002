"""`edge-agent run --config FILE [--broker mqtt://host:port] [--data-dir DIR]`: run one agent.

Loads the config (a `ConfigError` is one line on stderr and exit status 2), runs the event loop
on uvloop when the config allows, opens the agent's databases, starts its actors, then tells
systemd READY=1; pings the watchdog from the loop; serves /healthz and /metrics when
`metrics.listen` is set; on SIGTERM/SIGINT stops taking work, flushes the outbox, closes the
databases and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from agent.core.clock import SystemClock
from agent.core.config import AgentConfig
from agent.core.errors import ConfigError, EdgeAgentError

log = logging.getLogger("agent.run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="agent config (TOML)")
    parser.add_argument("--broker", metavar="URL", help="override mqtt.url, e.g. mqtt://127.0.0.1:1883")
    parser.add_argument("--data-dir", metavar="DIR", help="override agent.data_dir")
    parser.add_argument("--log-format", choices=("kv", "json"), default="kv", help="log line format")
    parser.add_argument("--recover", action="store_true",
                        help="a leader: move a damaged leader.db aside and start afresh (default: refuse to start)")


def main(args: argparse.Namespace) -> int:
    try:
        if args.broker and not args.broker.startswith(("mqtt://", "mqtts://")):
            raise ConfigError("--broker", None, f"must be mqtt://host:port or mqtts://host:port, got {args.broker!r}")
        from agent.commands.preflight import preflight

        config = preflight(args.config, broker=args.broker)  # files, keys, addresses: before anything starts
    except EdgeAgentError as exc:
        print(f"edge-agent run: {exc}", file=sys.stderr)
        return 2
    from agent.actors import run as run_loop
    from agent.service import setup_logging

    setup_logging(config.agent.log_level, fmt=args.log_format)
    return run_loop(serve(config, broker=args.broker, data_dir=args.data_dir, recover=args.recover,
                          source=args.config),
                    use_uvloop=config.agent.wants_uvloop())


async def serve(config: AgentConfig, *, broker: str | None = None, data_dir: str | None = None,
                recover: bool = False, source: str = "config") -> int:
    """Run the agent until SIGTERM/SIGINT; returns the exit status. `source`: the config file,
    named in a data directory error."""
    from agent.service import set_service_umask

    set_service_umask()
    clock = SystemClock()
    base = Path(data_dir or config.agent.data_dir)
    try:
        base.mkdir(parents=True, exist_ok=True, mode=0o750)
    except OSError as exc:
        raise ConfigError("--data-dir" if data_dir else source, None if data_dir else "agent.data_dir",
                          f"cannot create the data directory {base}: {exc.strerror or exc}") from None
    from agent.service.instance import InstanceLock

    lock = InstanceLock(base, source="--data-dir" if data_dir else source).acquire()  # the kernel drops it at a crash
    try:
        return await _serve_locked(config, base, clock, broker=broker, recover=recover, source=source)
    finally:
        lock.release()


async def _serve_locked(config: AgentConfig, base: Path, clock: SystemClock, *, broker: str | None,
                        recover: bool, source: str) -> int:
    """Run the agent's parts until a stop. A reload (SIGHUP, `systemctl reload`, or a release of
    the agent's own settings: the built-in config target `agent`) stops the parts as a shutdown
    would (the outbox keeps every message) and starts them again on the config file read anew and
    the settings in force, in the same process: RELOADING=1, then READY=1 once they run."""
    import asyncio

    from agent.app import AppEnv, Starting, assemble, make_transport, prepare
    from agent.leader.env import GatewayEnv
    from agent.service import ServiceRuntime, restrict_database_files
    from agent.worker.env import DeviceEnv

    again = asyncio.Event()  # a reload asked the parts to start again
    started_again = asyncio.Event()

    async def reload() -> None:
        started_again.clear()
        again.set()
        await started_again.wait()

    runtime = ServiceRuntime(clock=clock, metrics_listen=config.metrics.listen, on_reload=reload)
    async with runtime:
        ready_sent = started = False

        def enrolling(running: AgentConfig) -> None:
            nonlocal ready_sent
            if not ready_sent:  # a device waiting for an operator's approval is up, not failing to start
                runtime.ready(f"worker {running.agent.device_id} starting with its identity")
                ready_sent = True

        env = AppEnv(gateway=GatewayEnv(recover=recover), device=DeviceEnv(restart=runtime.signals.request_reload))
        while True:
            prepared = await prepare(config, clock=clock, base=base, env=env,
                                     starting=Starting(stopping=runtime.signals.stop, enrolling=enrolling))
            if prepared is None:
                break
            running = prepared
            logging.getLogger().setLevel(running.agent.log_level)  # (a release may change it)
            app = await assemble(running, transport=make_transport(running, clock=clock, broker_url=broker),
                                 clock=clock, base=base, env=env)
            for db in app.databases():
                restrict_database_files(db)
            # Shutdown steps run in order, last part first: stop taking work, then the agent (relay,
            # transport, flush + close its stores), then what drains it.
            for name, stop in app.stop_steps():
                runtime.shutdown.add(name, stop)
            for name, problem, up in app.liveness():
                runtime.add_liveness(name, problem, up=up)
            for name, check in app.checks():
                runtime.add_check(name, check)
            await app.start()
            for name, collector in app.collectors():  # after start: a part's figures may need what it started
                runtime.add_collector(name, collector)
            kv = {"role": running.agent.role, "device": running.agent.device_id, "data_dir": str(base)}
            if not started:
                if ready_sent:
                    runtime.status(f"{running.agent.role} {running.agent.device_id} running")
                else:
                    runtime.ready(f"{running.agent.role} {running.agent.device_id} running")
                    ready_sent = True
                log.info("agent started", extra={"kv": kv})
                started = True
            else:
                log.info("agent started again", extra={"kv": kv})
                started_again.set()
            stopping = asyncio.ensure_future(runtime.wait_stop())
            restarting = asyncio.ensure_future(again.wait())
            await asyncio.wait((stopping, restarting), return_when=asyncio.FIRST_COMPLETED)
            for task in (stopping, restarting):
                task.cancel()
            if runtime.signals.stop.is_set():
                break
            again.clear()
            log.info("starting again on the config and the settings in force")
            await runtime.restart_parts()
            try:
                from agent.commands.preflight import preflight

                config = preflight(source, broker=broker)
            except EdgeAgentError as exc:
                log.error("%s: the config file's settings of the last start go on", exc)
        log.info("stopping")
    return 0
