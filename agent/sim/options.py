"""What a simulation run is asked to do, parsed and checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.core.config import HeartbeatSection
from agent.core.durations import parse_seconds
from agent.core.errors import ConfigError
from agent.core.sql import is_server_url


def parse_duration(text: str, *, name: str = "duration") -> float:
    """`90`, `90s`, `10m`, `1.5h`, `250ms` -> seconds."""
    try:
        return parse_seconds(text)
    except ValueError as exc:
        raise ConfigError("simulate", name, str(exc)) from None


def parse_shard(text: str) -> tuple[int, int]:
    """`K/M`, e.g. `2/3` -> (2, 3): the K-th of M parts of the fleet."""
    k, sep, m = str(text).partition("/")
    try:
        if not sep:
            raise ValueError
        return int(k), int(m)
    except ValueError:
        raise ConfigError("simulate", "shard", f"expected K/M (e.g. 2/3), got {text!r}") from None


def parse_outage(text: str) -> tuple[float, float]:
    """`AT:FOR`, e.g. `3m:1m` -> (180.0, 60.0)."""
    at, sep, length = str(text).partition(":")
    if not sep:
        raise ConfigError("simulate", "broker-outage", f"expected AT:FOR (e.g. 3m:1m), got {text!r}")
    start, span = parse_duration(at, name="broker-outage"), parse_duration(length, name="broker-outage")
    if span <= 0:
        raise ConfigError("simulate", "broker-outage", "the outage must last more than 0 s")
    return start, span


MAX_PROCESSES = 64
MAX_LEADERS = 8
BOOT_WINDOW_MAX_S = 60.0
HEARTBEAT_S = HeartbeatSection().interval_s
APP_CLASS = "events"  # the class a simulated device's application sends (`app_every_s`)


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    devices: int = 50
    duration_s: float = 600.0
    seed: int = 1
    heartbeat_s: float = HEARTBEAT_S  # the shipped idle interval (fast while an update runs)
    leader_interval_s: float = 30.0
    telemetry_s: float = 30.0  # per device; 0 = none
    app_every_s: float = 0.0  # per device: its application hands the local API a message this often; 0 = none
    offline_rate: float = 0.0  # fraction of devices that lose their uplink once during the run
    offline_duration_s: float = 120.0
    broker_outage: tuple[float, float] | None = None  # (at, for)
    jobs: int = 0
    job_window: int = 2
    job_work_s: float = 1.0
    leader_mailbox: int | None = None  # None: room for every device's heartbeat, at least 1024
    files: int = 4  # shared outbox files
    ephemeral: bool = False
    broker_url: str | None = None
    realtime: bool = False
    drain_s: float = 900.0  # fleet time allowed after `duration` for everything to arrive
    progress: bool = True
    tick_s: float = 0.1  # virtual clock: timers due within one tick fire together
    crash_rate: float = 0.0  # fraction of devices that crash once and restart on their SQLite state
    crash_downtime_s: float = 15.0
    scenario: str | None = None  # the named scenario these options came from
    samples: int = 60  # points of the report's time series
    max_wall_s: float | None = None  # benchmarks: stop generating after this much wall time
    base_version: str = "1.0.0"  # the firmware every simulated device runs at the start
    processes: int = 1  # the fleet spread over this many processes (`agent.sim.processes`)
    shard: tuple[int, int] | None = None  # (K, M): with a real broker, run only the K-th of M parts
    round_s: float = 0.25  # with several processes: the broker's least delivery latency (`agent.transport.rounds`)
    leaders: int = 1  # leaders on one shared subscription (more than one: with `database`)
    database: str | None = None  # the leaders' PostgreSQL (a schema of its own for the run); None: leader.db
    leader_crash_s: float | None = None  # the first leader crashes at this fleet time (not started again)
    # every device enrols at its first boot (its key, a request over the broker's enrolment topics,
    # approved by the leaders' batch token, a certificate of the fleet's CA) before it is assembled
    enrol: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("devices", self.devices >= 1, "must be >= 1"),
            ("duration", self.duration_s > 0, "must be > 0"),
            ("heartbeat", self.heartbeat_s > 0, "must be > 0"),
            ("leader-interval", self.leader_interval_s >= 0, "must be >= 0"),
            ("telemetry", self.telemetry_s >= 0, "must be >= 0"),
            ("app-every", self.app_every_s >= 0, "must be >= 0"),
            ("offline-rate", 0.0 <= self.offline_rate <= 1.0, "must be between 0 and 1"),
            ("offline-duration", self.offline_duration_s > 0, "must be > 0"),
            ("jobs", self.jobs >= 0, "must be >= 0"),
            ("job-window", self.job_window >= 1, "must be >= 1"),
            ("leader-mailbox", self.leader_mailbox is None or self.leader_mailbox >= 1, "must be >= 1"),
            ("files", self.files >= 1, "must be >= 1"),
            ("tick", 0.0 <= self.tick_s <= 5.0, "must be between 0 and 5 s"),
            ("crash-rate", 0.0 <= self.crash_rate <= 1.0, "must be between 0 and 1"),
            ("crash-downtime", self.crash_downtime_s > 0, "must be > 0"),
            ("samples", 1 <= self.samples <= 10_000, "must be between 1 and 10000"),
            ("processes", 1 <= self.processes <= MAX_PROCESSES, f"must be between 1 and {MAX_PROCESSES}"),
            ("processes", self.processes <= self.devices, "must be at most --devices"),
            ("round", 0.001 <= self.round_s <= 5.0, "must be between 1 ms and 5 s"),
            ("leaders", 1 <= self.leaders <= MAX_LEADERS, f"must be between 1 and {MAX_LEADERS}"),
            ("leaders", self.leaders == 1 or self.database is not None,
             "several leaders share one registry: give --database postgresql://..."),
            ("leaders", self.leaders == 1 or (self.processes == 1 and self.shard is None),
             "several leaders run in one process: leave out --processes and --shard"),
            ("database", self.database is None or is_server_url(self.database),
             "must be a postgresql:// URL"),
            ("leader-crash", self.leader_crash_s is None or self.leaders >= 2,
             "a leader's crash needs another to take over: give --leaders 2 or more"),
            ("leader-crash", self.leader_crash_s is None or 0 < self.leader_crash_s < self.duration_s,
             "must fall within --duration"),
            ("enrol", not self.enrol or (self.broker_url is None and self.processes == 1),
             "the devices enrol with the leaders in this process, on the in-memory broker: leave out --broker"
             " and --processes"),
        ]
        for key, ok, reason in checks:
            if not ok:
                raise ConfigError("simulate", key, reason)
        if self.broker_url is not None and not self.broker_url.startswith(("mqtt://", "mqtts://")):
            raise ConfigError("simulate", "broker", "must be mqtt://host:port")
        if self.shard is not None:
            k, m = self.shard
            if self.broker_url is None:
                raise ConfigError("simulate", "shard", "needs --broker mqtt://... (the shards' one broker)")
            if not 1 <= k <= m <= self.devices:
                raise ConfigError("simulate", "shard", f"expected K/M with 1 <= K <= M <= --devices, got {k}/{m}")
        if self.processes > 1 and (self.broker_url is not None or self.realtime):
            raise ConfigError("simulate", "processes", "more than one process needs the in-memory broker and"
                                                       " virtual time (with --broker, spread the fleet with --shard)")

    @property
    def boot_window_s(self) -> float:
        """The devices boot within this much fleet time: the heartbeat interval, or a whole
        fraction of it no longer than a minute (a fleet at the shipped 300 s interval is up
        within the first minute, its heartbeats then come on the tenths of that minute)."""
        return self.heartbeat_s / math.ceil(self.heartbeat_s / BOOT_WINDOW_MAX_S)

    @property
    def leader_mailbox_capacity(self) -> int:
        """The leader's mailbox bound: as given, or one heartbeat per device (at least 1024)."""
        return self.leader_mailbox if self.leader_mailbox is not None else max(1024, self.devices + 64)


__all__ = ["APP_CLASS", "HEARTBEAT_S", "MAX_PROCESSES", "SimOptions", "parse_duration", "parse_outage", "parse_shard"]
