"""The leader's device registry in SQLite: heartbeats, presence, telemetry, deduplication.

Guarantees:

* Latest heartbeat wins: a heartbeat is applied only if its `seq` is higher than the stored one
  (`ON CONFLICT ... DO UPDATE ... WHERE excluded.hb_seq > devices.hb_seq`), so one that arrives
  late or twice changes nothing. That guard *is* the deduplication of heartbeats: at 5,000+
  heartbeats/s a processed-id row per heartbeat would be pure write amplification on an SD card.
* Every other state change (a telemetry record, a presence change that carries an id) commits
  its message id into `processed_messages` in the same transaction as the change, so a message
  redelivered after a crash changes nothing twice. `apply_*` returns, per message, whether it
  was new. Old ids are pruned by age (`prune_processed`).
* Online/offline comes from presence (birth message / last will) and from a heartbeat deadline:
  a device not heard from for `heartbeat_deadline_s` of the `Clock` is marked offline by
  `expire_overdue()` (or the `watch_deadlines()` loop).
* The running leader marks itself alive (`registry_meta` `leader_alive_ms`) from that loop every
  `LEADER_ALIVE_EVERY_S`, so a reader of the file (`status`, `rollout status`) tells a leader
  that stopped from a fleet that is merely quiet (idle devices beat every 5 minutes).

Threading choice: the registry is synchronous and meant to be called on the event loop. Every
call is one short transaction over a batch (the leader drains its coalescing mailbox and calls
`apply_heartbeats(batch)` once), the database runs in WAL. A telemetry record is acknowledged
once its commit is synced (unless `telemetry_durable` is off: durability "crash"); heartbeats,
deadline marks and pruning commit unsynced (a power cut takes seconds a device resends), so the
intake pays no fsync; `checkpoint()` lets the caller run a checkpoint off the loop.
sqlite3 errors never leave this module: they become `StoreError`.
"""

from __future__ import annotations

import logging
import sqlite3
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from agent.core.backends import server_migrations
from agent.core.clock import Clock
from agent.core.codec import decode, encode
from agent.core.errors import CodecError, DeviceLimitReached, StoreError, store_log_level
from agent.core.ratelog import RateLimitedLog
from agent.core.sql import (
    NO_LIMIT,
    Connection,
    ServerUrl,
    dialect_of,
    greatest,
    has_table,
    in_json_array,
    json_array_holds,
)
from agent.core.sqlite import Synchronous, store_errors
from agent.core.store import Store
from agent.protocol import AppState, ConfigState, Heartbeat, SlotState, SystemSample, Telemetry
from config_rollout.attempt_acks import Acks, open_attempt

COMPONENT = "registry"
TELEMETRY_NAMES_MAX = 256  # per device: beyond, a record of a new name is refused

log = logging.getLogger(__name__)
_BOOTS_REMEMBERED = 1_000_000
_NAMES_CACHED_DEVICES = 100_000  # devices whose telemetry names are kept in memory (beyond: read again)

_json_encode = msgspec.json.Encoder().encode
_tags_decoder = msgspec.json.Decoder(list[str])


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE devices (
            device_id TEXT PRIMARY KEY,
            hb_seq INTEGER NOT NULL DEFAULT -1,
            hb_at_ms INTEGER,
            last_seen_ms INTEGER,
            uptime_s REAL,
            firmware_version TEXT NOT NULL DEFAULT '',
            tags TEXT NOT NULL DEFAULT '[]',
            sample BLOB,
            online INTEGER NOT NULL DEFAULT 0,
            offline_reason TEXT,
            first_seen_ms INTEGER NOT NULL,
            changed_ms INTEGER NOT NULL,
            telemetry_count INTEGER NOT NULL DEFAULT 0
        ) WITHOUT ROWID"""
    )
    conn.execute("CREATE INDEX devices_online_seen ON devices(last_seen_ms) WHERE online = 1")
    conn.execute(
        """CREATE TABLE telemetry_last (
            device_id TEXT NOT NULL,
            name TEXT NOT NULL,
            seq INTEGER NOT NULL,
            ts_ms INTEGER NOT NULL,
            record BLOB NOT NULL,
            PRIMARY KEY (device_id, name)
        ) WITHOUT ROWID"""
    )
    conn.execute(
        "CREATE TABLE processed_messages (msg_id TEXT PRIMARY KEY, at_ms INTEGER NOT NULL)"
        " WITHOUT ROWID"
    )
    conn.execute("CREATE INDEX processed_messages_at ON processed_messages(at_ms)")
    conn.execute(
        "CREATE TABLE registry_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID"
    )


def _v2(conn: sqlite3.Connection) -> None:
    """The boot id of the heartbeat stored (`Heartbeat.boot`)."""
    conn.execute("ALTER TABLE devices ADD COLUMN boot TEXT NOT NULL DEFAULT ''")


def _v3(conn: sqlite3.Connection) -> None:
    """The presence session of the newest birth (`agent.transport.presence`)."""
    conn.execute("ALTER TABLE devices ADD COLUMN presence_session TEXT NOT NULL DEFAULT ''")


def _v4(conn: sqlite3.Connection) -> None:
    """The outbox depth the newest heartbeat reported (`Heartbeat.outbox_pending`)."""
    conn.execute("ALTER TABLE devices ADD COLUMN outbox_pending INTEGER")


def _v5(conn: sqlite3.Connection) -> None:
    """Each device's own deadline: the heartbeat interval it announced (`Heartbeat.interval_s`)
    and when it is overdue. `open` fills `expires_ms` of the rows from before."""
    conn.execute("ALTER TABLE devices ADD COLUMN interval_ms INTEGER NOT NULL DEFAULT 0")
    conn.execute("ALTER TABLE devices ADD COLUMN expires_ms INTEGER")
    conn.execute("DROP INDEX devices_online_seen")
    conn.execute("CREATE INDEX devices_online_expires ON devices(expires_ms) WHERE online = 1")


def _v6(conn: sqlite3.Connection) -> None:
    """How many devices were online, sampled when the leader marks itself alive (the console's
    fleet chart); `FLEET_HISTORY_S` of them are kept."""
    conn.execute("CREATE TABLE fleet_online (at_ms INTEGER PRIMARY KEY, devices INTEGER NOT NULL,"
                 " online INTEGER NOT NULL)")


def _v7(conn: sqlite3.Connection) -> None:
    """The device's slots as its newest full heartbeat stated them (`Heartbeat.slots`)."""
    conn.execute("ALTER TABLE devices ADD COLUMN slots BLOB")


def _v8(conn: sqlite3.Connection) -> None:
    """What each configuration target of the device holds, as its newest full heartbeat stated
    it (`Heartbeat.configs`)."""
    conn.execute("ALTER TABLE devices ADD COLUMN configs BLOB")


def _v9(conn: sqlite3.Connection) -> None:
    """The fleet whose devices the registry holds (`claim_fleet`): a leader of another fleet
    started on it refuses to run."""
    conn.execute("CREATE TABLE registry_fleet (fleet TEXT PRIMARY KEY)")


def _v10(conn: sqlite3.Connection) -> None:
    """The leader that applied the device's newest heartbeat or birth (several leaders share a
    PostgreSQL registry; `status` shows which served each device)."""
    conn.execute("ALTER TABLE devices ADD COLUMN served_by TEXT NOT NULL DEFAULT ''")


def _v11(conn: sqlite3.Connection) -> None:
    """The leaders that use this registry, each with its newest alive mark (several share one
    on PostgreSQL; their own rows among the devices, from each other's presence, are theirs)."""
    conn.execute("CREATE TABLE registry_leaders (name TEXT PRIMARY KEY, alive_ms INTEGER NOT NULL)")


def _v12(conn: sqlite3.Connection) -> None:
    """How often each leader marks itself alive, so that a reader tells a dead one by its own pace
    (`LEADER_BEAT_S` on PostgreSQL, `LEADER_ALIVE_EVERY_S` on leader.db)."""
    conn.execute(f"ALTER TABLE registry_leaders ADD COLUMN every_ms INTEGER NOT NULL DEFAULT {_ALIVE_EVERY_MS}")


def _v13(conn: sqlite3.Connection) -> None:
    """What each application of the device runs, and what the device is (arch, board, os), as its
    newest full heartbeat stated them (`Heartbeat.apps`, `Heartbeat.facts`)."""
    conn.execute("ALTER TABLE devices ADD COLUMN apps BLOB")
    conn.execute("ALTER TABLE devices ADD COLUMN facts BLOB")


def _v14(conn: sqlite3.Connection) -> None:
    """How the device's agent has run on its firmware (`Heartbeat.health`): the firmware counted,
    the seconds run and the unexpected restarts there (the fleet's healthy hours per release)."""
    conn.execute("ALTER TABLE devices ADD COLUMN health_firmware TEXT")
    conn.execute("ALTER TABLE devices ADD COLUMN health_s REAL")
    conn.execute("ALTER TABLE devices ADD COLUMN health_restarts INTEGER")


T = TypeVar("T")

#: How far a device's stated seconds may run ahead of the time the registry has known it.
HEALTH_SLACK_S = 3600.0

#: Per firmware its devices' counts add up: (firmware, devices, seconds, unexpected restarts, the
#: device-hours the restarts spoiled). A device is believed for no more seconds than the registry
#: has known it (`HEALTH_SLACK_S` beside: a count in flight), and its restarts spoil no more hours
#: than it ran: one device, however hostile, weighs no more than an honest one whose every hour
#: crashed. (Parameters: now in ms, twice.)
_RELEASE_HEALTH = (
    "SELECT health_firmware, COUNT(*), COALESCE(SUM(s), 0), COALESCE(SUM(health_restarts), 0),"
    " COALESCE(SUM(CASE WHEN health_restarts * 3600.0 > s THEN s / 3600.0 ELSE health_restarts END), 0)"
    f" FROM (SELECT health_firmware, COALESCE(health_restarts, 0) AS health_restarts,"
    f" CASE WHEN health_s > (? - first_seen_ms) / 1000.0 + {HEALTH_SLACK_S}"
    f" THEN (? - first_seen_ms) / 1000.0 + {HEALTH_SLACK_S} ELSE health_s END AS s"
    " FROM devices WHERE health_firmware IS NOT NULL AND health_firmware <> '' AND health_s IS NOT NULL) AS counted"
    " GROUP BY health_firmware ORDER BY health_firmware")


def _release_health(rows: Iterable[Sequence[Any]]) -> list[ReleaseHealth]:
    """`_RELEASE_HEALTH`'s rows as the views read them: hours, and the share of them healthy."""
    found = []
    for firmware, devices, seconds, restarts, spoiled in rows:
        hours = max(0.0, float(seconds)) / 3600.0
        ratio = max(0.0, hours - float(spoiled)) / hours if hours > 0 else 1.0
        found.append(ReleaseHealth(firmware=str(firmware), devices=int(devices), hours=round(hours, 6),
                                   unexpected_restarts=int(restarts), healthy_ratio=round(ratio, 6)))
    return found


class ReleaseHealth(msgspec.Struct, kw_only=True, frozen=True):
    """How one firmware release runs across the fleet (`DeviceRegistry.release_health`): Memfault's
    crash-free hours, from the devices' own counts (`Heartbeat.health`)."""

    firmware: str
    devices: int  # devices that run it and counted
    hours: float  # the hours their agents ran on it
    unexpected_restarts: int  # their starts that found the run before not stopped
    # the share of those hours with no unexpected restart (each spoils the hour it ended, a device's
    # spoil at most the hours it ran; 1.0 when nothing ran yet)
    healthy_ratio: float = 1.0


def _stated(blob: object, read: Callable[[bytes], T]) -> T | None:
    """A value a heartbeat stated, as stored (None: none stored, or one this version cannot read)."""
    if not isinstance(blob, bytes):
        return None
    try:
        return read(blob)
    except (CodecError, msgspec.DecodeError):
        return None


#: How a device's configuration target reads fleet-wide (`config_compliance`): each device in one.
COMPLIANCE = ("in_sync", "pending", "drifted", "damaged", "not_applied")
#: Beside them in the same counts: devices whose last attempt did not commit, whatever they hold.
LAST_ATTEMPT_FAILED = "last_attempt_failed"
#: The devices' configuration targets, as stored: (device id, tags JSON, configs blob) rows.
_CONFIG_ROWS = "SELECT device_id, tags, configs FROM devices WHERE configs IS NOT NULL"


def _app_states(rows: Sequence[tuple[Any, ...]]) -> dict[str, dict[str, AppState]]:
    """device -> its applications, from (device id, apps blob) rows (`_APP_ROWS`)."""
    return {str(device): states for device, blob in rows if (states := _stated(blob, _APPS_DECODER.decode))}


def _config_states(rows: Sequence[tuple[Any, ...]]) -> dict[str, tuple[tuple[str, ...], dict[str, ConfigState]]]:
    found = {}
    for device_id, tags, blob in rows:
        states = _stated(blob, _CONFIGS_DECODER.decode)
        if states:
            found[str(device_id)] = (tuple(_stated(tags.encode() if isinstance(tags, str) else tags,
                                                   _tags_decoder.decode) or ()), states)
    return found


def compliance_counts(states: Mapping[str, tuple[Sequence[str], Mapping[str, ConfigState]]],
                      pending: Collection[tuple[str, str]] = (), acks: Acks | None = None) -> dict[str, dict[str, int]]:
    """target -> compliance -> devices, from `config_states`; `pending`: the (device, target)s
    the leader has more for; `acks`: the operators' acknowledgements (an attempt acknowledged is
    not counted as `last_attempt_failed`)."""
    found: dict[str, dict[str, int]] = {}
    for device_id, (_, held) in states.items():
        for target, c in held.items():
            counts = found.setdefault(target, dict.fromkeys((*COMPLIANCE, LAST_ATTEMPT_FAILED), 0))
            counts[c.compliance_with((device_id, target) in pending)] += 1
            counts[LAST_ATTEMPT_FAILED] += bool(open_attempt(c, (acks or {}).get((device_id, target))))
    return dict(sorted(found.items()))


_CONFIGS = msgspec.msgpack.Encoder()
_CONFIGS_DECODER = msgspec.msgpack.Decoder(dict[str, ConfigState])
_APPS_DECODER = msgspec.msgpack.Decoder(dict[str, AppState])
_FACTS_DECODER = msgspec.msgpack.Decoder(dict[str, str])
class AppCounts(msgspec.Struct, kw_only=True, frozen=True):
    """One application across the fleet (`status`, the console's fleet page)."""

    versions: dict[str, int]  # the committed version -> devices, the most common first
    on_trial: int = 0  # devices checking a new version now
    took_back: int = 0  # devices whose last new version failed its health check and was taken back


def app_counts(fleet: Iterable[dict[str, AppState]]) -> dict[str, AppCounts]:
    """Each application's `AppCounts` over the devices' stated applications."""
    versions: dict[str, Counter[str]] = {}
    trial: Counter[str] = Counter()
    back: Counter[str] = Counter()
    for states in fleet:
        for name, state in states.items():
            versions.setdefault(name, Counter())[state.version or "none"] += 1
            trial[name] += bool(state.trial)
            back[name] += state.health == "failed"
    return {name: AppCounts(versions=dict(sorted(counted.items(), key=lambda vn: (-vn[1], vn[0]))),
                            on_trial=trial[name], took_back=back[name]) for name, counted in sorted(versions.items())}


#: The devices' applications, as stored: (device id, apps blob) rows.
_APP_ROWS = "SELECT device_id, apps FROM devices WHERE apps IS NOT NULL"
_MIGRATIONS = (_v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9, _v10, _v11, _v12, _v13, _v14)

#: The same tables on PostgreSQL (their own versions, from the SQLite schema's newest shape).
FLEET_HISTORY_S = 7 * 86_400  # how long the online samples are kept

DEADLINE_SCAN_MS = 1_000  # PostgreSQL: the deadline scans at most this often
LEADER_ALIVE_EVERY_S = 30.0  # how often the running leader marks itself alive in the registry
_ALIVE_EVERY_MS = int(LEADER_ALIVE_EVERY_S * 1000)
LEADER_QUIET_S = 3 * LEADER_ALIVE_EVERY_S  # no mark for this long: the leader is not running
# Several leaders on PostgreSQL: each beats its own row this often, so that the others and the
# views tell a dead one within a lease time (`[leader] rollout_lease_s`, 10 s) by its own pace
LEADER_BEAT_S = 3.0
QUIET_BEATS = 3  # a leader silent for this many of its beats is not running

# A device is overdue this many of its announced intervals after it was last heard from: one
# late heartbeat is not an outage (and the last will tells an outage sooner anyway).
INTERVALS_TO_DEADLINE = 2.5

_HEARTBEAT_COLUMNS = (
    "device_id, hb_seq, hb_at_ms, last_seen_ms, uptime_s, firmware_version, tags, sample, online, offline_reason,"
    " first_seen_ms, changed_ms, boot, outbox_pending, interval_ms, expires_ms, slots, configs, served_by, apps,"
    " facts, health_firmware, health_s, health_restarts")
_HEARTBEAT_ROW = "(?, ?, ?, ?, ?, ?, ?, ?, 1, NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
_HEARTBEAT_CONFLICT = """ON CONFLICT (device_id) DO UPDATE SET
    hb_seq = excluded.hb_seq, hb_at_ms = excluded.hb_at_ms, last_seen_ms = excluded.last_seen_ms,
    uptime_s = excluded.uptime_s, firmware_version = excluded.firmware_version,
    tags = excluded.tags, sample = excluded.sample, online = 1, offline_reason = NULL,
    changed_ms = CASE WHEN devices.online = 1 THEN devices.changed_ms ELSE excluded.changed_ms END,
    boot = excluded.boot, outbox_pending = excluded.outbox_pending,
    interval_ms = excluded.interval_ms, expires_ms = excluded.expires_ms, slots = excluded.slots,
    configs = excluded.configs, served_by = excluded.served_by,
    apps = COALESCE(excluded.apps, devices.apps), facts = excluded.facts,
    health_firmware = COALESCE(excluded.health_firmware, devices.health_firmware),
    health_s = COALESCE(excluded.health_s, devices.health_s),
    health_restarts = COALESCE(excluded.health_restarts, devices.health_restarts)
WHERE excluded.hb_seq > devices.hb_seq OR (excluded.boot <> '' AND excluded.boot <> devices.boot)"""
_UPSERT_HEARTBEAT = f"INSERT INTO devices ({_HEARTBEAT_COLUMNS}) VALUES {_HEARTBEAT_ROW} {_HEARTBEAT_CONFLICT}"

# A short heartbeat (`Heartbeat.full` false): what it leaves out is unchanged.
_APPLY_SHORT_HEARTBEAT = """
UPDATE devices SET
    hb_seq = ?, hb_at_ms = ?, last_seen_ms = ?, uptime_s = ?, sample = COALESCE(?, sample),
    outbox_pending = COALESCE(?, outbox_pending), online = 1, offline_reason = NULL,
    changed_ms = CASE WHEN online = 1 THEN changed_ms ELSE ? END, interval_ms = ?, expires_ms = ?, served_by = ?,
    health_firmware = COALESCE(?, health_firmware), health_s = COALESCE(?, health_s),
    health_restarts = COALESCE(?, health_restarts)
WHERE device_id = ? AND hb_seq < ?
"""
# The same for a batch at once (PostgreSQL): the parameters of the statements above, one array
# each, in their order.
_PG_FULL_HEARTBEATS = f"""
INSERT INTO devices ({_HEARTBEAT_COLUMNS})
SELECT c1, c2, c3, c4, c5, c6, c7, c8, 1, NULL, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22
FROM unnest(CAST(? AS TEXT[]), CAST(? AS BIGINT[]), CAST(? AS BIGINT[]), CAST(? AS BIGINT[]),
            CAST(? AS DOUBLE PRECISION[]), CAST(? AS TEXT[]), CAST(? AS TEXT[]), CAST(? AS BYTEA[]),
            CAST(? AS BIGINT[]), CAST(? AS BIGINT[]), CAST(? AS TEXT[]), CAST(? AS BIGINT[]), CAST(? AS BIGINT[]),
            CAST(? AS BIGINT[]), CAST(? AS BYTEA[]), CAST(? AS BYTEA[]), CAST(? AS TEXT[]), CAST(? AS BYTEA[]),
            CAST(? AS BYTEA[]), CAST(? AS TEXT[]), CAST(? AS DOUBLE PRECISION[]), CAST(? AS BIGINT[]))
     AS v(c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22)
WHERE true
{_HEARTBEAT_CONFLICT}
RETURNING device_id"""
_PG_SHORT_HEARTBEATS = """
UPDATE devices SET
    hb_seq = v.seq, hb_at_ms = v.at_ms, last_seen_ms = v.seen_ms, uptime_s = v.uptime_s,
    sample = COALESCE(v.sample, devices.sample), outbox_pending = COALESCE(v.outbox_pending, devices.outbox_pending),
    online = 1, offline_reason = NULL,
    changed_ms = CASE WHEN devices.online = 1 THEN devices.changed_ms ELSE v.changed_ms END,
    interval_ms = v.interval_ms, expires_ms = v.expires_ms, served_by = v.served_by,
    health_firmware = COALESCE(v.health_firmware, devices.health_firmware),
    health_s = COALESCE(v.health_s, devices.health_s),
    health_restarts = COALESCE(v.health_restarts, devices.health_restarts)
FROM unnest(CAST(? AS BIGINT[]), CAST(? AS BIGINT[]), CAST(? AS BIGINT[]), CAST(? AS DOUBLE PRECISION[]),
            CAST(? AS BYTEA[]), CAST(? AS BIGINT[]), CAST(? AS BIGINT[]), CAST(? AS BIGINT[]), CAST(? AS BIGINT[]),
            CAST(? AS TEXT[]), CAST(? AS TEXT[]), CAST(? AS DOUBLE PRECISION[]), CAST(? AS BIGINT[]),
            CAST(? AS TEXT[]), CAST(? AS BIGINT[]))
     AS v(seq, at_ms, seen_ms, uptime_s, sample, outbox_pending, changed_ms, interval_ms, expires_ms, served_by,
          health_firmware, health_s, health_restarts, device_id, below_seq)
WHERE devices.device_id = v.device_id AND devices.hb_seq < v.below_seq
RETURNING devices.device_id"""

_ENSURE_DEVICE = (
    "INSERT INTO devices (device_id, first_seen_ms, changed_ms) VALUES (?, ?, ?)"
    " ON CONFLICT (device_id) DO NOTHING"
)

_COLUMNS = (
    "device_id, hb_seq, hb_at_ms, last_seen_ms, uptime_s, firmware_version, tags, sample, online,"
    " offline_reason, first_seen_ms, changed_ms, telemetry_count, facts"
)


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """One device as the leader knows it. Times are the leader clock's `now_ms()`."""

    device_id: str
    hb_seq: int | None  # None: no heartbeat yet
    hb_at_ms: int | None  # when the newest heartbeat was applied
    last_seen_ms: int | None  # newest heartbeat or presence `online`
    uptime_s: float | None
    firmware_version: str
    tags: tuple[str, ...]
    sample: SystemSample | None
    online: bool
    offline_reason: str | None  # "presence" | "deadline" | None
    first_seen_ms: int
    changed_ms: int  # last online/offline transition
    telemetry_count: int  # telemetry records applied (each exactly once)
    facts: tuple[tuple[str, str], ...] = ()  # what it is (arch, board, os), as its newest full heartbeat said


def _facts(blob: object) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((_stated(blob, _FACTS_DECODER.decode) or {}).items()))


def _record(row: tuple) -> DeviceRecord:
    sample = None
    if row[7] is not None:
        try:
            sample = decode(row[7], SystemSample)
        except CodecError:
            sample = None
    try:
        tags = tuple(_tags_decoder.decode(row[6]))
    except msgspec.DecodeError:
        tags = ()
    return DeviceRecord(
        device_id=row[0],
        hb_seq=None if row[1] < 0 else row[1],
        hb_at_ms=row[2],
        last_seen_ms=row[3],
        uptime_s=row[4],
        firmware_version=row[5],
        tags=tags,
        sample=sample,
        online=bool(row[8]),
        offline_reason=row[9],
        first_seen_ms=row[10],
        changed_ms=row[11],
        telemetry_count=row[12],
        facts=_facts(row[13]),
    )


OfflineCallback = Callable[[list[str]], Awaitable[None] | None]


class DeviceRegistry(Store):
    """The device registry. Open with `DeviceRegistry.open(path, clock=...)`."""

    COMPONENT = COMPONENT
    MIGRATIONS = _MIGRATIONS
    SERVER_MIGRATIONS = server_migrations("agent.leader", COMPONENT)
    WHAT = "device registry"

    def __init__(self, conn: Connection | sqlite3.Connection, *, clock: Clock, heartbeat_deadline_s: float,
                 path: str | Path | ServerUrl, telemetry_names_max: int = TELEMETRY_NAMES_MAX,
                 telemetry_durable: bool = True) -> None:
        super().__init__(conn, path=path)
        self.telemetry_durable = telemetry_durable  # a telemetry record's commit is synced
        self._clock = clock
        self._names_max = telemetry_names_max
        # per device, the telemetry names telemetry_last holds (read once, then kept: the rows are
        # never deleted); after a rolled-back batch it may hold a name the table lacks, which only
        # counts against the device's cap sooner
        self._names: dict[str, set[str]] = {}
        self._deadline_ms = int(round(heartbeat_deadline_s * 1000))
        self._boots: dict[str, str] = {}  # device -> boot id last seen by this process
        self._late_wills = RateLimitedLog(log, clock, 60.0)  # a device may publish its presence at will
        self._alive_marked_ms: int | None = None
        self._beat_ms: int | None = None  # when this leader last beat its own row
        self.leader = ""  # this leader's device id, written as `served_by` (`LeaderAgent.open` sets it)

    @classmethod
    def open(
        cls,
        path: str | Path | ServerUrl,
        *,
        clock: Clock,
        heartbeat_deadline_s: float = 30.0,
        synchronous: Synchronous = "FULL",
        telemetry_names_max: int = TELEMETRY_NAMES_MAX,
        telemetry_durable: bool = True,
    ) -> DeviceRegistry:
        if heartbeat_deadline_s <= 0:
            raise ValueError("heartbeat_deadline_s must be > 0")
        conn = cls.connect_target(path, synchronous=synchronous)
        store = cls(conn, clock=clock, heartbeat_deadline_s=heartbeat_deadline_s, path=path,
                    telemetry_names_max=telemetry_names_max, telemetry_durable=telemetry_durable)
        try:
            deadline_ms = int(round(heartbeat_deadline_s * 1000))
            with store.atomic():
                conn.execute(
                    "INSERT INTO registry_meta(key, value) VALUES ('heartbeat_deadline_ms', ?)"
                    " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (deadline_ms,),
                )
                # rows from before per-device deadlines: the leader's deadline
                conn.execute("UPDATE devices SET expires_ms = last_seen_ms + ?"
                             " WHERE expires_ms IS NULL AND last_seen_ms IS NOT NULL", (deadline_ms,))
        except BaseException:
            store.close()
            raise
        return store

    def claim_fleet(self, fleet: str) -> None:
        """Record `fleet` as the one whose devices this registry holds (the first leader to
        start on it does); `StoreError` in one line when it holds another fleet's."""
        with self.atomic():
            self._conn.execute("INSERT INTO registry_fleet (fleet) SELECT ? WHERE NOT EXISTS"
                               " (SELECT 1 FROM registry_fleet) ON CONFLICT DO NOTHING", (fleet,))
            held = [str(r[0]) for r in self._conn.execute("SELECT fleet FROM registry_fleet")]
        if held != [fleet]:
            raise StoreError(f"{self.path} holds the devices of fleet {', '.join(held)!s}, not of fleet {fleet}:"
                             " a leader serves only its own fleet's database")

    def _note_boot(self, hb: Heartbeat) -> None:
        """Log once when a device starts again under a new boot id (a restart, or a device whose
        local state was wiped and whose seqs start low again)."""
        known = self._boots.get(hb.device_id)
        if known != hb.boot:
            if known is not None:
                log.info("device %s started again (boot %s, heartbeat seq %d)", hb.device_id, hb.boot, hb.seq)
            if len(self._boots) >= _BOOTS_REMEMBERED:
                self._boots.clear()
            self._boots[hb.device_id] = hb.boot

    @property
    def heartbeat_deadline_s(self) -> float:
        return self._deadline_ms / 1000.0

    def deadline_ms(self, interval_ms: int) -> int:
        """How long after it was heard from a device whose heartbeat interval is `interval_ms`
        (0: not announced) is overdue: `INTERVALS_TO_DEADLINE` intervals, at least the leader's
        `heartbeat_deadline_s`."""
        return max(self._deadline_ms, int(interval_ms * INTERVALS_TO_DEADLINE))


    # -- writes --------------------------------------------------------------------------------
    def apply_heartbeat(self, heartbeat: Heartbeat) -> bool:
        """Apply one heartbeat; True if it was newer than the stored one."""
        return self.apply_heartbeats([heartbeat])[0]

    def apply_heartbeats(self, heartbeats: Sequence[Heartbeat]) -> list[bool]:
        """Apply a batch in one transaction, in order; per heartbeat, whether it was applied."""
        self.check_open()
        now = self._clock.now_ms()
        applied = [False] * len(heartbeats)
        # By device id (a device's own in batch order): two leaders applying batches that share
        # devices take the rows' locks in one order, so they wait for each other, never deadlock.
        order = sorted(range(len(heartbeats)), key=lambda i: heartbeats[i].device_id)
        rows = [self._heartbeat_row(heartbeats[i], now) for i in order]
        one_each = len({hb.device_id for hb in heartbeats}) == len(heartbeats)
        # Unsynced: a power cut may take the last seconds of heartbeats, which every device
        # sends again within its interval; an fsync per batch would cost the intake its rate.
        with self.atomic(synced=False):
            if self.on_server and one_each:  # a statement a batch: a statement costs more than a row
                newer = self._apply_rows_at_once([r for r in rows if r[0]], [r for r in rows if not r[0]])
                for i in order:
                    applied[i] = heartbeats[i].device_id in newer
            else:
                execute = self._conn.execute
                for i, (full, params) in zip(order, rows, strict=True):
                    applied[i] = execute(_UPSERT_HEARTBEAT if full else _APPLY_SHORT_HEARTBEAT, params).rowcount > 0
        for hb, was in zip(heartbeats, applied, strict=True):
            if was and hb.full and hb.boot:
                self._note_boot(hb)
        return applied

    def _heartbeat_row(self, hb: Heartbeat, now: int) -> tuple[bool, tuple[Any, ...]]:
        """(full, the parameters of `_UPSERT_HEARTBEAT` or of `_APPLY_SHORT_HEARTBEAT`)."""
        sample = encode(hb.sample) if hb.sample is not None else None
        interval_ms = int(hb.interval_s * 1000) if hb.interval_s is not None else 0
        expires = now + self.deadline_ms(interval_ms)
        h = hb.health
        if h is not None and hb.full and h.firmware != hb.firmware_version:
            h = None  # a count of another release than the one it says it runs: not believed
        health = (h.firmware, h.operating_s, h.unexpected_restarts) if h is not None else (None, None, None)
        if not hb.full:
            return False, (hb.seq, now, now, hb.uptime_s, sample, hb.outbox_pending, now, interval_ms, expires,
                           self.leader, *health, hb.device_id, hb.seq)
        return True, (hb.device_id, hb.seq, now, now, hb.uptime_s, hb.firmware_version,
                      _json_encode(list(hb.tags)).decode(), sample, now, now, hb.boot, hb.outbox_pending,
                      interval_ms, expires, encode(hb.slots) if hb.slots is not None else None,
                      _CONFIGS.encode(hb.configs) if hb.configs is not None else None, self.leader,
                      _CONFIGS.encode(hb.apps) if hb.apps is not None else None,
                      _CONFIGS.encode(hb.facts) if hb.facts is not None else None, *health)

    def _apply_rows_at_once(self, full: Sequence[tuple[bool, tuple[Any, ...]]],
                            short: Sequence[tuple[bool, tuple[Any, ...]]]) -> set[str]:
        """PostgreSQL: the batch's full heartbeats in one upsert and its short ones in one update
        (one device each), each over `unnest` of one array a column; the device ids whose row
        they changed."""
        newer: set[str] = set()
        if full:
            newer.update(self._conn.column_of_arrays("ea_heartbeats_full", _PG_FULL_HEARTBEATS,
                                                     list(zip(*(params for _, params in full), strict=True))))
        if short:
            newer.update(self._conn.column_of_arrays("ea_heartbeats_short", _PG_SHORT_HEARTBEATS,
                                                     list(zip(*(params for _, params in short), strict=True))))
        return newer

    def apply_telemetry(self, msg_id: str, record: Telemetry) -> bool:
        """Apply one telemetry record; False if `msg_id` was already processed."""
        outcome = self.apply_telemetry_batch([(msg_id, record)])[0]
        if isinstance(outcome, DeviceLimitReached):
            raise outcome
        return outcome

    def apply_telemetry_batch(self, batch: Sequence[tuple[str, Telemetry]]) -> list[bool | DeviceLimitReached]:
        """Apply (message id, record) pairs in one transaction; per pair, whether it was new, or
        the refusal of a record whose name would go beyond the device's `telemetry_names_max`.

        A new record bumps the device's `telemetry_count` and replaces the last value of its
        `name` if its `seq` is higher than the stored one's.
        """
        self.check_open()
        now = self._clock.now_ms()
        new: list[bool | DeviceLimitReached] = [False] * len(batch)
        order = sorted(range(len(batch)), key=lambda i: batch[i][1].device_id)  # see apply_heartbeats
        with self.atomic(synced=self.telemetry_durable):
            for i in order:
                new[i] = self._apply_one_telemetry(*batch[i], now)
        return new

    def _apply_one_telemetry(self, msg_id: str, record: Telemetry, now: int) -> bool | DeviceLimitReached:
        execute = self._conn.execute
        names = self._names.get(record.device_id)
        if names is None:
            if len(self._names) >= _NAMES_CACHED_DEVICES:
                self._names.clear()
            names = self._names[record.device_id] = {
                str(n) for (n,) in execute("SELECT name FROM telemetry_last WHERE device_id = ?", (record.device_id,))}
        if record.name not in names and len(names) >= self._names_max:
            return DeviceLimitReached(f"{record.device_id} already has {len(names)} telemetry names"
                                      f" (the leader's telemetry_names_max)")
        if not self._claim(msg_id, now):
            return False
        bumped = execute("UPDATE devices SET telemetry_count = telemetry_count + 1 WHERE device_id = ?",
                         (record.device_id,))
        if bumped.rowcount == 0:  # a device first heard of by its telemetry
            execute(_ENSURE_DEVICE, (record.device_id, now, now))
            execute("UPDATE devices SET telemetry_count = telemetry_count + 1 WHERE device_id = ?",
                    (record.device_id,))
        names.add(record.name)
        execute(
            "INSERT INTO telemetry_last (device_id, name, seq, ts_ms, record) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (device_id, name) DO UPDATE SET seq = excluded.seq,"
            " ts_ms = excluded.ts_ms, record = excluded.record WHERE excluded.seq > telemetry_last.seq",
            (record.device_id, record.name, record.seq, record.ts_ms, encode(record)),
        )
        return True

    def apply_presence(self, device_id: str, online: bool, *, session: str = "", msg_id: str | None = None) -> bool:
        """Record a presence change; False if it changed nothing. With `msg_id`, a redelivered
        message is ignored.

        `online` counts as being heard from (the heartbeat deadline restarts) and makes
        `session` the device's current one; `offline` (the last will) marks the device offline
        at once, unless it names another session than the current one: a late will of an
        earlier session. A session of "" (an agent before sessions) always applies.
        """
        self.check_open()
        now = self._clock.now_ms()
        with self.atomic():
            if msg_id is not None and not self._claim(msg_id, now):
                return False
            if self._conn.execute("SELECT 1 FROM registry_leaders WHERE name = ?", (device_id,)).fetchone():
                return False  # a fellow leader's presence (several leaders): a leader is no device of the fleet
            self._conn.execute(_ENSURE_DEVICE, (device_id, now, now))
            if online:
                self._conn.execute(
                    "UPDATE devices SET last_seen_ms = ?, offline_reason = NULL,"
                    " changed_ms = CASE WHEN online = 1 THEN changed_ms ELSE ? END, online = 1,"
                    " presence_session = ?, served_by = ?, expires_ms = ? + "
                    + greatest(self.dialect, "?", "CAST(interval_ms * ? AS BIGINT)") +
                    " WHERE device_id = ?",
                    (now, now, session, self.leader, now, self._deadline_ms, INTERVALS_TO_DEADLINE, device_id),
                )
                return True
            cur = self._conn.execute(
                "UPDATE devices SET offline_reason = 'presence',"
                " changed_ms = CASE WHEN online = 1 THEN ? ELSE changed_ms END, online = 0"
                " WHERE device_id = ? AND (? = '' OR presence_session IN ('', ?))",
                (now, device_id, session, session),
            )
        if cur.rowcount == 0:
            self._late_wills.log(logging.INFO, device_id, f"a last will of an earlier session of {device_id} ignored",
                                 session=session)
            return False
        return True

    def _claim(self, msg_id: str, now: int) -> bool:
        cur = self._conn.execute(
            "INSERT INTO processed_messages (msg_id, at_ms) VALUES (?, ?) ON CONFLICT DO NOTHING",
            (msg_id, now),
        )
        return cur.rowcount > 0

    def expire_overdue(self) -> list[str]:
        """Mark offline every online device not heard from within the deadline; their ids."""
        self.check_open()
        now = self._clock.now_ms()
        with self.atomic(synced=False):  # found again after a power cut
            rows = self._conn.execute(
                "UPDATE devices SET online = 0, offline_reason = 'deadline', changed_ms = ?"
                " WHERE online = 1 AND expires_ms <= ? RETURNING device_id",
                (now, now),
            ).fetchall()
        return sorted(r[0] for r in rows)

    def offline_since(self, since_ms: int) -> list[str]:
        """Devices offline now that went offline at `since_ms` or later (by whichever leader's
        clock marked them): how the leader running the job queue hears of the workers the
        other leaders lost."""
        self.check_open()
        with store_errors("devices offline"):
            rows = self._conn.execute(
                "SELECT device_id FROM devices WHERE online = 0 AND changed_ms >= ?", (since_ms,)).fetchall()
        return [str(r[0]) for r in rows]

    def next_deadline_ms(self) -> int | None:
        """When the next online device runs out of its heartbeat deadline, or None."""
        self.check_open()
        with store_errors("next deadline"):
            row = self._conn.execute(
                "SELECT MIN(expires_ms) FROM devices WHERE online = 1"
            ).fetchone()
        return None if row[0] is None else int(row[0])

    async def watch_deadlines(self, on_offline: OfflineCallback | None = None) -> None:
        """Run until cancelled: mark devices offline when their deadline passes, on the Clock.

        `on_offline(ids)` is called (and awaited if it returns an awaitable) for each batch of
        devices that just went offline, e.g. to release the jobs a lost worker held. A
        `StoreError` is logged and retried; the loop returns once the registry is closed.
        """
        retry_ms = min(self._deadline_ms, 1_000)
        alive_ms = self.beat_ms
        # PostgreSQL scans `devices` for deadlines (no index on `expires_ms`: see its schema):
        # at most once a second, so a device goes offline up to a second after its deadline
        least_ms = DEADLINE_SCAN_MS if self.on_server else 0
        failed = False
        while True:
            try:
                self.mark_alive()
                nxt = self.next_deadline_ms()
                wait_ms = self._deadline_ms if nxt is None else nxt - self._clock.now_ms()
            except StoreError as exc:
                if self.closed:
                    return
                log.log(store_log_level(exc, logging.WARNING), "heartbeat deadlines: %s (retrying)", exc)
                failed = True
            if failed:  # back off after a failure instead of spinning on it
                wait_ms = retry_ms
                failed = False
            await self._clock.sleep(max(least_ms, min(wait_ms, self._deadline_ms, alive_ms)) / 1000.0)
            try:
                expired = self.expire_overdue()
            except StoreError as exc:
                if self.closed:
                    return
                log.log(store_log_level(exc, logging.WARNING), "heartbeat deadlines: %s (retrying)", exc)
                failed = True
                continue
            if expired and on_offline is not None:
                outcome = on_offline(expired)
                if outcome is not None:
                    await outcome

    @property
    def beat_ms(self) -> int:
        """How often this leader marks its own row alive: `LEADER_BEAT_S` on PostgreSQL (several
        leaders tell a dead one within a lease time), `LEADER_ALIVE_EVERY_S` on leader.db."""
        return int(LEADER_BEAT_S * 1000) if self.on_server else _ALIVE_EVERY_MS

    def mark_alive(self) -> None:
        """Beat this leader's row of `registry_leaders` every `beat_ms`, with that pace; every
        `LEADER_ALIVE_EVERY_S` also write `leader_alive_ms` (now) and a sample of the devices
        online (samples older than `FLEET_HISTORY_S` go). The leader's name in `registry_leaders`
        means the presence of a leader is never taken for a device's (`LeaderAgent.start` marks
        it before it connects, and so before its presence is out)."""
        self.check_open()
        now = self._clock.now_ms()
        if self._beat_ms is not None and now - self._beat_ms < self.beat_ms:
            return
        if self._alive_marked_ms is not None and now - self._alive_marked_ms < LEADER_ALIVE_EVERY_S * 1000:
            if self.leader:
                with store_errors("mark the leader alive"), self.atomic(synced=False):
                    self._beat(now)
            self._beat_ms = now
            return
        with store_errors("mark the leader alive"), self.atomic():
            self._conn.execute("INSERT INTO registry_meta(key, value) VALUES ('leader_alive_ms', ?)"
                               " ON CONFLICT(key) DO UPDATE SET value = excluded.value", (now,))
            if self.leader:
                self._beat(now)
                if self._alive_marked_ms is None:  # its row as a device, from a presence before it was a leader here
                    self._conn.execute("DELETE FROM devices WHERE device_id = ?", (self.leader,))
            # "WHERE true": SQLite's parser needs a WHERE between a SELECT and its upsert clause
            self._conn.execute("INSERT INTO fleet_online (at_ms, devices, online)"
                               " SELECT ?, COUNT(*), COALESCE(SUM(online), 0) FROM devices WHERE true"
                               " ON CONFLICT (at_ms) DO UPDATE SET devices = excluded.devices,"
                               " online = excluded.online", (now,))
            self._conn.execute("DELETE FROM fleet_online WHERE at_ms < ?", (now - FLEET_HISTORY_S * 1000,))
        self._alive_marked_ms = self._beat_ms = now

    def _beat(self, now: int) -> None:
        self._conn.execute("INSERT INTO registry_leaders (name, alive_ms, every_ms) VALUES (?, ?, ?)"
                           " ON CONFLICT (name) DO UPDATE SET alive_ms = excluded.alive_ms,"
                           " every_ms = excluded.every_ms", (self.leader, now, self.beat_ms))

    def prune_processed(self, older_than_s: float, *, limit: int | None = None) -> int:
        """Forget processed message ids older than `older_than_s`, oldest first, at most `limit`
        of them in this one transaction; how many were removed.

        Keep them longer than the longest a message can wait in a sender's outbox.
        """
        self.check_open()
        cutoff = self._clock.now_ms() - int(older_than_s * 1000)
        with store_errors("prune processed ids"):
            if self._conn.execute(
                "SELECT 1 FROM processed_messages WHERE at_ms < ? LIMIT 1", (cutoff,)
            ).fetchone() is None:
                return 0  # nothing due: no write transaction (an idle leader writes nothing)
        with self.atomic(synced=False):  # found again after a power cut
            cur = self._conn.execute(
                "DELETE FROM processed_messages WHERE msg_id IN (SELECT msg_id FROM processed_messages"
                " WHERE at_ms < ? ORDER BY at_ms LIMIT ?)",
                (cutoff, NO_LIMIT if limit is None else max(0, limit)),
            )
        return cur.rowcount

    def leaders(self) -> dict[str, int]:
        """Devices by the leader that served them last (`RegistryReads.leaders`)."""
        self.check_open()
        return RegistryReads(self._conn).leaders()

    def leaders_running(self) -> dict[str, bool]:
        """`RegistryReads.leaders_running` now."""
        self.check_open()
        return RegistryReads(self._conn).leaders_running(self._clock.now_ms())

    def leader_names(self) -> set[str]:
        """The leaders that marked themselves in this registry (`RegistryReads.leader_names`)."""
        self.check_open()
        return RegistryReads(self._conn).leader_names()

    def checkpoint(self) -> None:
        """Run a passive WAL checkpoint (fsyncs: call it from a thread under `clock.busy()`); on
        PostgreSQL the server checkpoints by itself."""
        self.check_open()
        if self.on_server:
            return
        with store_errors("checkpoint"):
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")

    # -- reads ---------------------------------------------------------------------------------
    def device(self, device_id: str) -> DeviceRecord | None:
        self.check_open()
        with store_errors("read device"):
            row = self._conn.execute(
                f"SELECT {_COLUMNS} FROM devices WHERE device_id = ?", (device_id,)
            ).fetchone()
        return None if row is None else _record(row)

    def devices(self, *, online: bool | None = None) -> list[DeviceRecord]:
        self.check_open()
        where = "" if online is None else f" WHERE online = {1 if online else 0}"
        with store_errors("read devices"):
            rows = self._conn.execute(
                f"SELECT {_COLUMNS} FROM devices{where} ORDER BY device_id"
            ).fetchall()
        return [_record(r) for r in rows]

    def config_compliance(self, pending: Collection[tuple[str, str]] = ()) -> dict[str, dict[str, int]]:
        """target -> in_sync / pending / drifted / damaged / not_applied -> devices (and beside
        them last_attempt_failed: those whose newest apply did not commit), as their
        newest full heartbeats stated (one decode per device that states any: read at a
        scrape's pace); `pending`: the (device, target)s the leader has more for."""
        return compliance_counts(self.config_states(), pending)

    def config_states(self) -> dict[str, tuple[tuple[str, ...], dict[str, ConfigState]]]:
        """device -> (its tags, what each of its configuration targets holds)."""
        self.check_open()
        with store_errors("read config states"):
            return _config_states(self._conn.execute(_CONFIG_ROWS).fetchall())

    def app_states(self) -> dict[str, dict[str, AppState]]:
        """device -> what each of its applications runs, as its newest full heartbeat stated it."""
        self.check_open()
        with store_errors("read application states"):
            rows = self._conn.execute(_APP_ROWS).fetchall()
        return _app_states(rows)

    def config_versions(self, target: str) -> dict[str, str]:
        """device -> the version of configuration target `target` its newest full heartbeat
        stated (devices that stated none are left out)."""
        return {device: held[target].version for device, (_, held) in self.config_states().items() if target in held}

    def counts(self) -> tuple[int, int]:
        """(online, offline) device counts."""
        self.check_open()
        with store_errors("count devices"):
            row = self._conn.execute(
                "SELECT COALESCE(SUM(online), 0), COUNT(*) - COALESCE(SUM(online), 0) FROM devices"
            ).fetchone()
        return int(row[0]), int(row[1])

    def release_health(self) -> list[ReleaseHealth]:
        """The fleet's healthy hours per firmware release, as its devices count them (each device
        on the release it runs now), newest count of each; by firmware."""
        self.check_open()
        now = self._clock.now_ms()
        with store_errors("read the releases' health"):
            return _release_health(self._conn.execute(_RELEASE_HEALTH, (now, now)).fetchall())

    def last_telemetry(self, device_id: str) -> dict[str, Telemetry]:
        """The newest record (by seq) of each telemetry name of a device."""
        self.check_open()
        with store_errors("read telemetry"):
            rows = self._conn.execute(
                "SELECT name, record FROM telemetry_last WHERE device_id = ? ORDER BY name",
                (device_id,),
            ).fetchall()
        out: dict[str, Telemetry] = {}
        for name, blob in rows:
            try:
                out[name] = decode(blob, Telemetry)
            except CodecError:
                continue
        return out

    def is_processed(self, msg_id: str) -> bool:
        self.check_open()
        with store_errors("read processed ids"):
            row = self._conn.execute(
                "SELECT 1 FROM processed_messages WHERE msg_id = ?", (msg_id,)
            ).fetchone()
        return row is not None

    def processed_count(self) -> int:
        """How many message ids are remembered (for metrics)."""
        self.check_open()
        with store_errors("count processed ids"):
            return int(self._conn.execute("SELECT COUNT(*) FROM processed_messages").fetchone()[0])


class DeviceLine(msgspec.Struct, kw_only=True, frozen=True):
    """A device as the fleet's tables list it (`RegistryReads.page`; the views add to it)."""

    device_id: str
    online: bool
    offline_reason: str | None
    last_seen_ms: int | None
    firmware_version: str
    tags: list[str]
    facts: dict[str, str] = {}  # what it is (arch, board, os), as its newest full heartbeat said


class DeviceState(msgspec.Struct, kw_only=True, frozen=True):
    """What the registry keeps about one device beyond its line (`RegistryReads.device`)."""

    heartbeat_seq: int | None
    heartbeat_at_ms: int | None
    uptime_s: float | None
    boot: str
    first_seen_ms: int
    changed_ms: int
    telemetry_count: int
    telemetry_names: int
    outbox_pending: int | None  # as its newest heartbeat reported; None: not reported
    sample: SystemSample | None
    slots: SlotState | None = None  # as its newest full heartbeat stated them; None: not reported
    configs: dict[str, ConfigState] | None = None  # its configuration targets, likewise
    served_by: str = ""  # the leader that applied its newest heartbeat or birth ("": not recorded)
    apps: dict[str, AppState] | None = None  # its applications, as its newest full heartbeat stated them


_LINE = "device_id, online, offline_reason, last_seen_ms, firmware_version, tags, facts"


def _line(values: tuple[Any, ...]) -> DeviceLine:
    device_id, online, reason, last_seen, version, tags, facts = values
    try:
        tag_list = _tags_decoder.decode(tags if isinstance(tags, bytes | str) else "[]")
    except msgspec.DecodeError:
        tag_list = []
    return DeviceLine(device_id=str(device_id), online=bool(online),
                      offline_reason=None if reason is None else str(reason),
                      last_seen_ms=None if last_seen is None else int(last_seen), firmware_version=str(version),
                      tags=tag_list, facts=dict(_facts(facts)))


class RegistryReads:
    """The registry's reads for the views (`status`, the console, `doctor`), on any connection to
    its database: a read-only one while the leader runs. The one place the devices' table is
    queried outside `DeviceRegistry`."""

    def __init__(self, conn: Connection | sqlite3.Connection) -> None:
        self._conn: Any = conn
        self.dialect = dialect_of(conn)

    def present(self) -> bool:
        """Whether the database holds a device registry at all."""
        return all(self._conn.execute(has_table(self.dialect, name)).fetchone()[0]
                   for name in ("devices", "registry_meta"))

    def heartbeat_deadline_s(self) -> float | None:
        """The deadline the running leader was configured with, if it stored one."""
        row = self._conn.execute("SELECT value FROM registry_meta WHERE key = 'heartbeat_deadline_ms'").fetchone()
        return row[0] / 1000.0 if row else None

    def leader_alive_ms(self) -> int | None:
        """When the running leader last marked itself alive (None: no leader ever did)."""
        row = self._conn.execute("SELECT value FROM registry_meta WHERE key = 'leader_alive_ms'").fetchone()
        return int(row[0]) if row else None

    def count(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM devices").fetchone()[0])

    def config_compliance(self, pending: Collection[tuple[str, str]] = ()) -> dict[str, dict[str, int]]:
        """As `DeviceRegistry.config_compliance` (none from a registry older than the column)."""
        return compliance_counts(self.config_states(), pending)

    def config_states(self) -> dict[str, tuple[tuple[str, ...], dict[str, ConfigState]]]:
        """As `DeviceRegistry.config_states`."""
        try:
            return _config_states(self._conn.execute(_CONFIG_ROWS).fetchall())
        except sqlite3.OperationalError:
            return {}

    def app_states(self) -> dict[str, dict[str, AppState]]:
        """As `DeviceRegistry.app_states` (none from a registry older than the column)."""
        try:
            rows = self._conn.execute(_APP_ROWS).fetchall()
        except sqlite3.OperationalError:
            return {}
        return _app_states(rows)

    def release_health(self, now_ms: int) -> list[ReleaseHealth]:
        """As `DeviceRegistry.release_health` (none from a registry older than the columns)."""
        try:
            return _release_health(self._conn.execute(_RELEASE_HEALTH, (now_ms, now_ms)).fetchall())
        except sqlite3.OperationalError:
            return []

    def app_counts(self) -> dict[str, AppCounts]:
        """Application -> the devices running each of its versions, on trial, and that took their
        last new version back, as their newest full heartbeats stated (none from a registry older
        than the column)."""
        return app_counts(self.app_states().values())

    def online_history(self, since_ms: int) -> list[tuple[int, int, int]]:
        """(at_ms, devices, online) sampled since `since_ms`, oldest first (none from a registry
        older than the samples)."""
        try:
            rows = self._conn.execute("SELECT at_ms, devices, online FROM fleet_online WHERE at_ms >= ?"
                                      " ORDER BY at_ms", (since_ms,)).fetchall()
        except sqlite3.OperationalError:
            return []
        return [(int(a), int(b), int(c)) for a, b, c in rows]

    def online_count(self) -> tuple[int, int]:
        """(all, online) devices."""
        total, online = self._conn.execute("SELECT COUNT(*), COALESCE(SUM(online), 0) FROM devices").fetchone()
        return int(total), int(online)

    def versions(self) -> dict[str, int]:
        """Devices by the firmware version they report, the most common first."""
        return {(str(v) or "unknown"): int(n) for v, n in self._conn.execute(
            "SELECT firmware_version, COUNT(*) FROM devices GROUP BY firmware_version"
            " ORDER BY COUNT(*) DESC, firmware_version")}

    def stale(self, seen_before_ms: int | None, *, limit: int, now_ms: int = 0,
              ) -> tuple[int, list[tuple[str, int | None, bool]]]:
        """How many devices were last heard of before `seen_before_ms` (or never), and the
        `limit` longest silent of them: (device id, last seen, online). With `seen_before_ms`
        None: the devices past their own heartbeat deadline at `now_ms` (each announces its
        interval), or never heard of."""
        if seen_before_ms is None:
            where, arg = "last_seen_ms IS NULL OR expires_ms IS NULL OR expires_ms <= ?", now_ms
        else:
            where, arg = "last_seen_ms IS NULL OR last_seen_ms <= ?", seen_before_ms
        (count,) = self._conn.execute(f"SELECT COUNT(*) FROM devices WHERE {where}", (arg,)).fetchone()
        rows = [(str(d), seen, bool(on)) for d, seen, on in self._conn.execute(
            f"SELECT device_id, last_seen_ms, online FROM devices WHERE {where}"
            " ORDER BY last_seen_ms IS NOT NULL, last_seen_ms, device_id LIMIT ?", (arg, limit))]
        return int(count), rows

    def page(self, *, online: bool | None = None, version: str | None = None, tag: str | None = None,
             among: Sequence[str] | None = None, limit: int = 50, offset: int = 0) -> tuple[int, list[DeviceLine]]:
        """(how many devices pass every given condition, one page of them by device id); `among`:
        only these device ids; `limit` 0 for all."""
        clauses: list[str] = []
        params: list[object] = []
        if online is not None:
            clauses.append("online = ?")
            params.append(1 if online else 0)
        if version is not None:
            clauses.append("firmware_version = ?")
            params.append(version)
        if tag is not None:
            clauses.append(json_array_holds(self.dialect, "devices.tags"))
            params.append(tag)
        if among is not None:
            clauses.append(in_json_array(self.dialect, "device_id"))
            params.append(_json_encode(list(among)).decode())
        where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
        (matching,) = self._conn.execute(f"SELECT COUNT(*) FROM devices{where}", params).fetchone()
        page = f" LIMIT {int(limit) or NO_LIMIT} OFFSET {int(offset)}"
        lines = [_line(v) for v in self._conn.execute(
            f"SELECT {_LINE} FROM devices{where} ORDER BY device_id{page}", params)]
        return int(matching), lines

    def device(self, device_id: str) -> tuple[DeviceLine, DeviceState] | None:
        """Everything kept about one device; None if it has never been heard of."""
        found = self._conn.execute(
            f"SELECT {_LINE}, hb_seq, hb_at_ms, uptime_s, boot, first_seen_ms, changed_ms, telemetry_count, sample,"
            " outbox_pending, slots, configs, served_by, apps FROM devices WHERE device_id = ?",
            (device_id,)).fetchone()
        if found is None:
            return None
        (hb_seq, hb_at, uptime, boot, first_seen, changed, telemetry, blob, pending, slots_blob, configs_blob,
         served_by, apps_blob) = found[7:]
        (names,) = self._conn.execute("SELECT COUNT(*) FROM telemetry_last WHERE device_id = ?",
                                      (device_id,)).fetchone()
        sample = _stated(blob, lambda b: decode(b, SystemSample))
        slots = _stated(slots_blob, lambda b: decode(b, SlotState))
        configs = _stated(configs_blob, _CONFIGS_DECODER.decode)
        return _line(found[:7]), DeviceState(
            heartbeat_seq=None if hb_seq < 0 else int(hb_seq), heartbeat_at_ms=hb_at, uptime_s=uptime, boot=str(boot),
            first_seen_ms=int(first_seen), changed_ms=int(changed), telemetry_count=int(telemetry),
            telemetry_names=int(names), outbox_pending=None if pending is None else int(pending), sample=sample,
            slots=slots, configs=configs, served_by=str(served_by), apps=_stated(apps_blob, _APPS_DECODER.decode))

    def leaders(self) -> dict[str, int]:
        """Devices by the leader that served them last (several leaders share the registry; the
        leaders' own rows, from each other's presence, are not counted)."""
        return {str(leader): int(n) for leader, n in self._conn.execute(
            "SELECT served_by, COUNT(*) FROM devices WHERE served_by <> '' AND device_id NOT IN"
            " (SELECT name FROM registry_leaders) GROUP BY served_by ORDER BY served_by")}

    def leader_names(self) -> set[str]:
        """The leaders that marked themselves alive in this registry (their rows are not devices)."""
        return set(self.leaders_alive_ms())

    def leaders_alive_ms(self) -> dict[str, int]:
        """Each leader of this registry, with when it last marked itself alive (none from a
        registry older than the table)."""
        if not int(self._conn.execute(has_table(self.dialect, "registry_leaders")).fetchone()[0]):
            return {}
        return {str(name): int(at) for name, at in self._conn.execute(
            "SELECT name, alive_ms FROM registry_leaders ORDER BY name")}

    def leaders_running(self, now_ms: int) -> dict[str, bool]:
        """Each leader of this registry, and whether it runs at `now_ms`: marked alive within
        `QUIET_BEATS` of its own pace of marks."""
        if not int(self._conn.execute(has_table(self.dialect, "registry_leaders")).fetchone()[0]):
            return {}
        return {str(name): now_ms - int(at) <= QUIET_BEATS * int(every) for name, at, every in self._conn.execute(
            "SELECT name, alive_ms, every_ms FROM registry_leaders ORDER BY name")}

    def telemetry_counts(self) -> dict[str, int]:
        """Per device, the telemetry records the leader applied (each once)."""
        return {str(d): int(n) for d, n in self._conn.execute("SELECT device_id, telemetry_count FROM devices")}

    def last_heartbeat_ms(self) -> int | None:
        """When the leader applied its newest heartbeat (None: never)."""
        (newest,) = self._conn.execute("SELECT MAX(hb_at_ms) FROM devices").fetchone()
        return None if newest is None else int(newest)


__all__ = ["COMPLIANCE", "COMPONENT", "FLEET_HISTORY_S", "LAST_ATTEMPT_FAILED", "LEADER_ALIVE_EVERY_S",
           "LEADER_QUIET_S", "DeviceLine", "DeviceRecord", "DeviceRegistry", "DeviceState", "OfflineCallback",
           "RegistryReads", "ReleaseHealth", "compliance_counts"]
