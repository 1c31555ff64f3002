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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from agent.core.clock import SystemClock
from agent.core.config import AgentConfig, AgentSection
from agent.core.errors import ConfigError, EdgeAgentError

if TYPE_CHECKING:
    from agent.leader.agent import LeaderAgent
    from agent.worker.agent import WorkerAgent

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
                    use_uvloop=wants_uvloop(config.agent))


def wants_uvloop(section: AgentSection) -> bool:
    """`[agent] use_uvloop`, or by role when unset: uvloop pays for itself in the leader's intake;
    a worker idles, and asyncio's own loop keeps it about 2 MB smaller."""
    return section.use_uvloop if section.use_uvloop is not None else section.role == "leader"


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
        return await _serve_locked(config, base, clock, broker=broker, recover=recover)
    finally:
        lock.release()


async def _serve_locked(config: AgentConfig, base: Path, clock: SystemClock, *, broker: str | None,
                        recover: bool) -> int:
    from agent.app import build_agent, make_transport
    from agent.service import (
        ServiceRuntime,
        disk_space_check,
        gate_check,
        mailbox_collector,
        outbox_collector,
        per_class_collector,
        predicate_check,
        relay_collector,
        restrict_database_files,
        snapshot_collector,
        sqlite_writable_check,
    )

    transport = make_transport(config, clock=clock, broker_url=broker)
    runtime = ServiceRuntime(clock=clock, metrics_listen=config.metrics.listen)
    async with runtime:
        agent = await build_agent(config, transport=transport, clock=clock, data_dir=base, recover=recover)
        # Firmware rollouts: the leader's orchestrator and ConfigServers, a worker's updater (only
        # when [firmware] pins a key: an idle worker without one never loads firmware_rollout).
        leader = config.agent.role == "leader"
        if leader:
            from agent.leader.rollout import artifact_server_collector, attach_rollout, rollout_collector

            rollout = await attach_rollout(cast("LeaderAgent", agent), db_path=base / "leader.db",
                                           serve_http=bool(config.artifacts.listen))
            runtime.shutdown.add("stop rollouts", rollout.stop)
            runtime.add_collector("rollouts", rollout_collector(rollout.store))
            if rollout.http is not None:
                runtime.add_collector("artifact server", artifact_server_collector(rollout.http))
        elif config.firmware.public_key:
            from agent.worker.updater_actor import attach_from_config

            await attach_from_config(cast("WorkerAgent", agent), config, base)
        local_api = None
        northbound = None
        if leader:
            from agent.leader.northbound import attach_northbound

            northbound = await attach_northbound(cast("LeaderAgent", agent), config, base)
            if northbound is not None:
                runtime.add_collector("northbound", snapshot_collector(
                    "ea_northbound", northbound.stats, counters=("delivered", "published"),
                    help_={"connected": "1 while connected to the northbound broker.",
                           "pending": "Application messages queued for the northbound broker.",
                           "delivered": "Application messages the northbound broker acknowledged (persisted).",
                           "published": "Publishes the northbound broker acknowledged since start."}))
        else:
            from agent.worker.serving import attach_local_api, attach_sources

            local_api = attach_local_api(cast("WorkerAgent", agent), config, base)
            if local_api is not None:
                runtime.shutdown.add("stop local API", local_api.stop)  # no new messages while stopping
            sources = attach_sources(cast("WorkerAgent", agent), config, base)
            runtime.shutdown.add("stop sources", sources.stop)
        outbox_path = agent.outbox.path
        for db in (outbox_path, *(Path(p) for p in _databases(agent))):
            restrict_database_files(db)
        # Shutdown steps run in order: stop taking work, relay, transport, flush + close stores.
        runtime.shutdown.add(f"stop {config.agent.role}", agent.stop)
        if leader and northbound is not None:  # after the leader: what it took is queued first
            runtime.shutdown.add("stop northbound", northbound.stop)
        system = agent.system
        runtime.add_liveness("actors", system.problem, up="all actors running")
        runtime.add_check("transport", gate_check(transport.connected))
        runtime.add_check("database", sqlite_writable_check(outbox_path, clock=clock))
        runtime.add_check("disk", disk_space_check(base))
        relay = agent.relay
        if relay is not None:
            runtime.add_check("relay", predicate_check(lambda: relay.running, up="running", down="stopped"))
            runtime.add_collector("relay", relay_collector(relay.metrics))
        runtime.add_collector("mailbox", mailbox_collector(agent.system.statistics))
        runtime.add_collector("outbox", outbox_collector(agent.outbox.stats))
        housekeeper = agent.housekeeping
        if housekeeper is not None:
            runtime.add_collector("housekeeping", snapshot_collector(
                "ea_housekeeping", housekeeper.metrics, counters=("pruned", "rounds", "errors"), label="table"))
        if leader:
            gateway = cast("LeaderAgent", agent)  # a worker never imports agent.leader
            runtime.add_collector("jobs", snapshot_collector("ea_jobs", gateway.jobs_queue.stats))
            runtime.add_collector(
                "leader", snapshot_collector("ea_leader", lambda: {
                    "busy_answers": gateway.busy_answers, "refused_forged": gateway.refused_forged,
                    "rejects": gateway.rejects.count}, label="counter"))
            sinks = gateway.sinks
            if sinks is not None:
                runtime.add_collector("messages", per_class_collector(
                    "ea_leader_messages", sinks.stats.snapshot,
                    counters=("applied", "duplicates", "rejected", "forwarded"),
                    help_={"applied": "Application messages stored (each once).",
                           "duplicates": "Redeliveries of application messages already stored (suppressed).",
                           "rejected": "Application messages the leader refused (see edge-agent rejects).",
                           "forwarded": "Application messages queued for the northbound broker."}))
        else:
            device = cast("WorkerAgent", agent)
            # 1 after a damaged worker.db was moved aside at this start (its job ledger was lost)
            runtime.add_collector("worker", snapshot_collector(
                "ea_worker", lambda: {"state_recovered": 1 if device.recovered_from else 0}, label="state"))
            runtime.add_collector("messages", per_class_collector(
                "ea_messages", _message_audit(device), counters=_AUDIT_COUNTERS, help_=_AUDIT_HELP))
        await agent.start()
        if local_api is not None:
            await local_api.start()
        if not leader:
            await sources.start()
        runtime.ready(f"{config.agent.role} {config.agent.device_id} running")
        log.info("agent started", extra={"kv": {"role": config.agent.role, "device": config.agent.device_id,
                                                 "data_dir": str(base)}})
        await runtime.wait_stop()
        log.info("stopping")
    return 0


_AUDIT_COUNTERS = ("accepted", "direct", "stored", "duplicates", "refused", "delivered", "delivered_from_outbox",
                   "dead_lettered", "expired", "dropped", "overwritten", "enqueued", "replayed")
_AUDIT_HELP = {
    "accepted": "Application messages taken (local API and sources) since the agent started.",
    "direct": "Application messages the leader accepted directly (stored there before the answer).",
    "stored": "Application messages put in the outbox.",
    "duplicates": "Application messages already pending under their key (not stored twice).",
    "refused": "Application messages refused, by reason (invalid, unknown_class, too_large, full, unavailable).",
    "delivered": "Application messages the leader acknowledged: direct plus from the outbox.",
    "delivered_from_outbox": "Application messages of the class the leader acknowledged from the outbox.",
    "pending_at_start": "Application messages of the class that were waiting in the outbox at this start.",
    "dead_lettered": "Application messages of the class moved to the dead letters.",
    "expired": "Application messages of the class past their TTL, deleted undelivered.",
    "dropped": "Application messages of the class dropped to make room (drop_oldest).",
    "overwritten": "Application messages of the class replaced by a newer one of their key.",
    "enqueued": "Application messages of the class stored in the outbox (overwrites included).",
    "replayed": "Dead letters of the class moved back to pending.",
    "pending": "Application messages of the class waiting in the outbox.",
    "pending_bytes": "Payload bytes of the class waiting in the outbox.",
    "dead": "Application messages of the class in the dead letters.",
}


def _message_audit(device: WorkerAgent) -> Callable[[], Awaitable[dict[str, dict[str, object]]]]:
    async def snapshot() -> dict[str, dict[str, object]]:
        status = await device.message_status()
        classes = status["classes"]
        assert isinstance(classes, dict)
        return classes

    return snapshot


def _databases(agent: object) -> list[str]:
    paths = []
    for attr in ("registry", "ledger"):
        store = getattr(agent, attr, None)
        path = getattr(store, "path", None)
        if path:
            paths.append(str(path))
    return paths
