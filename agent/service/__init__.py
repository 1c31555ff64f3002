"""Layer 3: what makes the agent a well-made Linux service.

sd_notify readiness and watchdog (`sdnotify`), signals and ordered shutdown (`signals`),
`/healthz` and `/metrics` (`healthhttp`, `prom`, `checks`, `collectors`), structured,
journald-friendly logs (`logs`), private files and credentials (`files`), and `ServiceRuntime`
(`runtime`) bundling them for `edge-agent run`.

Names are loaded on first use (`from agent.service import HealthServer` works as before), so a
command pays only for the modules it touches: a worker without `/metrics` need not load the
HTTP server or the Prometheus renderer through this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.core.lazy import lazy_attributes

if TYPE_CHECKING:
    from agent.service.checks import (
        Check,
        CheckResult,
        disk_space_check,
        gate_check,
        predicate_check,
        problem_check,
        sqlite_writable_check,
        task_check,
    )
    from agent.service.collectors import (
        mailbox_collector,
        outbox_collector,
        per_class_collector,
        process_collector,
        relay_collector,
        snapshot_collector,
    )
    from agent.service.files import (
        FileWriteError,
        InsecureFile,
        check_mqtt_credentials,
        check_private_file,
        ensure_private_dir,
        read_secret,
        restrict_database_files,
        restrict_mode,
        set_service_umask,
        write_private_file,
    )
    from agent.service.healthhttp import (
        HealthServer,
        parse_listen,
    )
    from agent.service.logs import (
        RateLimitedLog,
        fields,
        setup_logging,
    )
    from agent.service.prom import (
        Counter,
        Gauge,
        MetricFamily,
        render,
    )
    from agent.service.runtime import (
        ServiceRuntime,
    )
    from agent.service.sdnotify import (
        Notifier,
        Watchdog,
        notify_ready,
        notify_status,
        notify_stopping,
        watchdog_timeout_s,
    )
    from agent.service.signals import (
        ServiceSignals,
        ShutdownSequence,
        StepFailure,
        install_signal_handlers,
    )

_LAZY = {
    "Check": "checks",
    "CheckResult": "checks",
    "Counter": "prom",
    "FileWriteError": "files",
    "Gauge": "prom",
    "HealthServer": "healthhttp",
    "InsecureFile": "files",
    "MetricFamily": "prom",
    "Notifier": "sdnotify",
    "RateLimitedLog": "logs",
    "ServiceRuntime": "runtime",
    "ServiceSignals": "signals",
    "ShutdownSequence": "signals",
    "StepFailure": "signals",
    "Watchdog": "sdnotify",
    "check_mqtt_credentials": "files",
    "check_private_file": "files",
    "disk_space_check": "checks",
    "ensure_private_dir": "files",
    "fields": "logs",
    "gate_check": "checks",
    "install_signal_handlers": "signals",
    "mailbox_collector": "collectors",
    "notify_ready": "sdnotify",
    "notify_status": "sdnotify",
    "notify_stopping": "sdnotify",
    "outbox_collector": "collectors",
    "parse_listen": "healthhttp",
    "predicate_check": "checks",
    "problem_check": "checks",
    "per_class_collector": "collectors",
    "process_collector": "collectors",
    "read_secret": "files",
    "relay_collector": "collectors",
    "render": "prom",
    "restrict_database_files": "files",
    "restrict_mode": "files",
    "set_service_umask": "files",
    "setup_logging": "logs",
    "snapshot_collector": "collectors",
    "sqlite_writable_check": "checks",
    "task_check": "checks",
    "watchdog_timeout_s": "sdnotify",
    "write_private_file": "files",
}


__getattr__ = lazy_attributes(__name__, {name: f"agent.service.{module}" for name, module in _LAZY.items()})


__all__ = [
    "Check",
    "CheckResult",
    "Counter",
    "FileWriteError",
    "Gauge",
    "HealthServer",
    "InsecureFile",
    "MetricFamily",
    "Notifier",
    "RateLimitedLog",
    "ServiceRuntime",
    "ServiceSignals",
    "ShutdownSequence",
    "StepFailure",
    "Watchdog",
    "check_mqtt_credentials",
    "check_private_file",
    "disk_space_check",
    "ensure_private_dir",
    "fields",
    "gate_check",
    "install_signal_handlers",
    "mailbox_collector",
    "notify_ready",
    "notify_status",
    "notify_stopping",
    "outbox_collector",
    "parse_listen",
    "predicate_check",
    "problem_check",
    "process_collector",
    "read_secret",
    "relay_collector",
    "render",
    "restrict_database_files",
    "restrict_mode",
    "set_service_umask",
    "setup_logging",
    "snapshot_collector",
    "per_class_collector",
    "sqlite_writable_check",
    "task_check",
    "watchdog_timeout_s",
    "write_private_file",
]
