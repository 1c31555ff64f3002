"""The orchestrator's durable state, in the leader's database (component "rollout").

`leader.db` (SQLite) by default; a fleet whose leaders share a PostgreSQL database
(`[leader] database`) keeps it there, and one leader at a time runs the orchestrator on it (the
lease of `rollout_engine.lease`, whose fencing check `fence` runs first in every
write transaction of the orchestrator's store).

    rollouts           one row per rollout: state, spec (JSON), artifact, signed manifest
    rollout_waves      one row per wave: state, start, soak deadline
    rollout_devices    one row per targeted device: state, detail, attempts, deadlines
    rollout_offers     every offer made (rollout, device, time, attempt): the audit trail
    rollout_processed  ids of device reports already applied (deduplication)
    rollout_controls   operator controls written by the CLI, applied by the running leader

Deadlines (device timeouts, retry backoff, soak end) are stored as `now_ms()` values of the
leader's Clock, so a restarted leader continues every timer where it stood. The store is
synchronous and short (WAL, `synchronous=NORMAL` unless told otherwise): it is called on the
event loop, one transaction per transition, as the registry is. Database errors become
`StoreError`.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from agent.core.backends import server_migrations
from agent.core.clock import Clock
from agent.core.errors import StoreError
from agent.core.lease import LeaseRow, lease_row
from agent.core.sql import NO_LIMIT, StoreTarget, dialect_of, greatest, has_table, in_json_array
from agent.core.sqlite import Synchronous, store_errors
from agent.core.store import Store
from rollout_engine.schema import MIGRATIONS as _MIGRATIONS
from rollout_engine.spec import RolloutSpec, spec_from_json

COMPONENT = "rollout"

DEVICE_STATES: Final[tuple[str, ...]] = (
    "queued",
    "notified",
    "waiting_window",
    "waiting_lock",
    "downloaded",
    "downloading",
    "installing",
    "rebooting",
    "verifying",
    "succeeded",
    "failed",
    "rejected",
    "timed_out",
    "canceled",
    "rolled_back",
)
IN_PROGRESS: Final[frozenset[str]] = frozenset(
    {"notified", "waiting_window", "waiting_lock", "downloading", "downloaded", "installing", "rebooting",
     "verifying"})
TERMINAL: Final[frozenset[str]] = frozenset({"succeeded", "failed", "rejected", "timed_out", "canceled", "rolled_back"})
FAILURES: Final[frozenset[str]] = frozenset({"failed", "rejected", "timed_out", "rolled_back"})
#: Marks a rollout whose per-device rows were pruned, in its `detail`.
PRUNED_NOTE: Final = "device rows pruned"
# What `prune_finished` deletes: (table, the key selecting one rollout's rows, the column naming a row)
_PRUNED_TABLES: Final[tuple[tuple[str, str, str], ...]] = (
    ("rollout_offers", "rollout_id = ?", "rowid"),
    ("rollout_device_events", "rollout_id = ?", "rowid"),
    ("rollout_device_logs", "rollout_id = ?", "device_id"),
    ("rollout_devices", "rollout_id = ?", "device_id"),
)
ROLLOUT_ACTIVE: Final[frozenset[str]] = frozenset({"scheduled", "running", "paused"})
_ACTIVE_SQL: Final = ", ".join(f"'{s}'" for s in sorted(ROLLOUT_ACTIVE))  # (for the queries)
ROLLOUT_STATES: Final[tuple[str, ...]] = (
    "scheduled", "running", "paused", "succeeded", "failed", "aborted", "canceled", "stopped")
#: The rollout states after which nothing is offered again.
FINISHED: Final[tuple[str, ...]] = tuple(s for s in ROLLOUT_STATES if s not in ROLLOUT_ACTIVE)
WAVE_STATES: Final[tuple[str, ...]] = (
    "pending",
    "running",
    "soaking",
    "awaiting_approval",
    "passed",
    "failed",
    "canceled",
)
CONTROLS: Final[tuple[str, ...]] = ("start", "pause", "resume", "cancel", "next", "approve", "rollback")




@dataclass(frozen=True, slots=True)
class RolloutRow:
    id: str
    seq: int
    name: str
    state: str
    spec: RolloutSpec
    artifact: str
    version: str
    signed_manifest: bytes
    current_wave: int
    wave_count: int
    detail: str
    rollback_of: str
    fail_base_finished: int
    fail_base_failed: int
    created_ms: int
    updated_ms: int
    finished_ms: int | None

    @property
    def active(self) -> bool:
        return self.state in ROLLOUT_ACTIVE


@dataclass(frozen=True, slots=True)
class WaveRow:
    rollout_id: str
    idx: int
    size: int
    state: str
    started_ms: int | None
    finished_ms: int | None
    soak_started_ms: int | None
    soak_until_ms: int | None
    detail: str
    install_approved: int = 0  # a download-only rollout: the operator said to install this wave


@dataclass(frozen=True, slots=True)
class DeviceRow:
    rollout_id: str
    device_id: str
    wave: int
    state: str
    detail: str
    attempts: int
    deadline_ms: int | None
    next_try_ms: int | None
    offers: int
    last_offer_ms: int | None
    report_seq: int
    from_version: str
    updated_ms: int
    bytes_done: int = 0  # from the device's newest progress report
    bytes_total: int = 0
    rate_bytes_per_s: float = 0.0
    progress_reports: int = 0
    bytes_to_fetch: int = 0  # of bytes_total, what the device downloads (the rest it copies: a delta)
    bytes_fetched: int = 0


@dataclass(frozen=True, slots=True)
class ControlRow:
    id: int
    rollout_id: str
    action: str
    arg: str
    created_ms: int
    applied_ms: int | None
    result: str  # what the leader did, or why it refused
    outcome: ControlOutcome | None  # None: not applied yet
    actor: str = ""  # who asked: "NAME via the console from ADDRESS", "USER (uid N) on the CLI"; "": not recorded

    @property
    def refused(self) -> bool:
        return self.outcome == "refused"


#: What the leader made of a control: done as asked, or refused with the reason.
ControlOutcome = Literal["applied", "refused"]

_R_COLS = (
    "id, seq, name, state, spec, artifact, version, signed_manifest, current_wave, wave_count, detail,"
    " rollback_of, fail_base_finished, fail_base_failed, created_ms, updated_ms, finished_ms"
)
_W_COLS = ("rollout_id, idx, size, state, started_ms, finished_ms, soak_started_ms, soak_until_ms, detail,"
           " install_approved")
_D_COLS = (
    "rollout_id, device_id, wave, state, detail, attempts, deadline_ms, next_try_ms, offers, last_offer_ms,"
    " report_seq, from_version, updated_ms, bytes_done, bytes_total, rate_bytes_per_s, progress_reports,"
    " bytes_to_fetch, bytes_fetched"
)
_C_COLS = "id, rollout_id, action, arg, created_ms, applied_ms, result, outcome, actor"
_SETTABLE = {
    "rollouts": frozenset(c.strip() for c in _R_COLS.split(",")) - {"id", "seq", "spec"},
    "rollout_waves": frozenset(c.strip() for c in _W_COLS.split(",")) - {"rollout_id", "idx"},
    "rollout_devices": frozenset(c.strip() for c in _D_COLS.split(",")) - {"rollout_id", "device_id"},
}


def _rollout(row: tuple[Any, ...]) -> RolloutRow:
    values = list(row)
    values[4] = spec_from_json(bytes(values[4]))
    values[7] = bytes(values[7])
    return RolloutRow(*values)


class RolloutStore(Store):
    """All reads and writes of the rollout tables. Open one per process and database. Every
    transition is one `atomic()` transaction (a savepoint when nested)."""

    COMPONENT = COMPONENT
    MIGRATIONS = _MIGRATIONS
    SERVER_MIGRATIONS = server_migrations("rollout_engine", COMPONENT)
    WHAT = "the rollout store"

    def __init__(self, conn: Any, *, clock: Clock, path: str | StoreTarget) -> None:
        super().__init__(conn, path=path)
        self._clock = clock
        # Run first in every outermost write transaction (the orchestrator lease's fencing
        # check: it raises `LeaseLost` once another leader holds the lease); None: no check.
        self.fence: Callable[[], None] | None = None

    @classmethod
    def open(cls, path: str | Path | StoreTarget, *, clock: Clock, synchronous: Synchronous = "FULL") -> RolloutStore:
        """On `leader.db` (a path) or the fleet's PostgreSQL database (a `ServerUrl` or URL)."""
        return cls(cls.connect_target(path, synchronous=synchronous), clock=clock, path=path)

    @classmethod
    def open_readonly(cls, path: str | Path | StoreTarget, *, clock: Clock) -> RolloutStore:
        """For the commands that only look (`rollout status`, `list`, the console's pages): the
        database is never written, and one that holds no rollout tables is refused."""
        return cls(cls.connect_reader(path), clock=clock, path=path)

    @classmethod
    def open_existing(cls, path: str | Path | StoreTarget, *, clock: Clock) -> RolloutStore:
        """For a control (the CLI, the console): writes, but only into a database that already
        holds the rollout tables at this program's version; refused as `open_readonly` refuses
        otherwise, so nothing is created."""
        cls.connect_reader(path).close()
        return cls.open(path, clock=clock)

    @contextlib.contextmanager
    def atomic(self, *, synced: bool = True, fenced: bool = True) -> Iterator[Any]:
        """One transaction, fenced (`fence` runs first) unless nested or `fenced=False` (the
        figures every leader adds, never the orchestration's own state)."""
        outermost = not self._conn.in_transaction
        with super().atomic(synced=synced) as conn:
            if outermost and fenced and self.fence is not None:
                self.fence()
            yield conn

    def _q(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.check_open()
        with store_errors("rollout store"):
            cur = self._conn.execute(sql, args)
            return cur.fetchall() if cur.description is not None else []  # (psycopg: no rows to fetch)

    # -- rollouts --------------------------------------------------------------------------
    def create_rollout(
        self,
        rollout_id: str,
        *,
        spec: RolloutSpec,
        artifact: str,
        version: str,
        signed_manifest: bytes,
        waves: Sequence[Sequence[str]],
        from_versions: dict[str, str],
        rollback_of: str = "",
    ) -> None:
        now = self._clock.now_ms()
        with self.atomic():
            if self._q("SELECT 1 FROM rollouts WHERE id = ?", (rollout_id,)):
                raise StoreError(f"rollout {rollout_id!r} exists already")
            seq = int(self._q("SELECT COALESCE(MAX(seq), 0) + 1 FROM rollouts")[0][0])
            self._q(
                "INSERT INTO rollouts (id, seq, name, state, spec, artifact, version, signed_manifest, wave_count,"
                " rollback_of, created_ms, updated_ms) VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rollout_id,
                    seq,
                    spec.rollout.name,
                    spec.to_json(),
                    artifact,
                    version,
                    signed_manifest,
                    len(waves),
                    rollback_of,
                    now,
                    now,
                ),
            )
            for idx, members in enumerate(waves):
                self._q(
                    "INSERT INTO rollout_waves (rollout_id, idx, size) VALUES (?, ?, ?)",
                    (rollout_id, idx, len(members)),
                )
                with store_errors("rollout store"):
                    self._conn.executemany(
                        "INSERT INTO rollout_devices (rollout_id, device_id, wave, from_version, updated_ms)"
                        " VALUES (?, ?, ?, ?, ?)",
                        [(rollout_id, d, idx, from_versions.get(d, ""), now) for d in members],
                    )

    def add_device(self, rollout_id: str, device_id: str, wave: int, *, from_version: str = "") -> bool:
        """Add a late-registering device to `wave`; False when it is in the rollout already."""
        now = self._clock.now_ms()
        with self.atomic():
            if self._q("SELECT 1 FROM rollout_devices WHERE rollout_id = ? AND device_id = ?", (rollout_id, device_id)):
                return False
            self._q(
                "INSERT INTO rollout_devices (rollout_id, device_id, wave, from_version, updated_ms)"
                " VALUES (?, ?, ?, ?, ?)",
                (rollout_id, device_id, wave, from_version, now),
            )
            self._q("UPDATE rollout_waves SET size = size + 1 WHERE rollout_id = ? AND idx = ?", (rollout_id, wave))
        return True

    def get(self, rollout_id: str) -> RolloutRow | None:
        rows = self._q(f"SELECT {_R_COLS} FROM rollouts WHERE id = ?", (rollout_id,))
        return _rollout(rows[0]) if rows else None

    def find(self, prefix: str) -> RolloutRow | None:
        """The rollout with id `prefix`, or the only one whose id starts with it."""
        exact = self.get(prefix)
        if exact is not None:
            return exact
        rows = self._q(
            f"SELECT {_R_COLS} FROM rollouts WHERE id LIKE ? ESCAPE '\\' LIMIT 2",
            (prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%",),
        )
        return _rollout(rows[0]) if len(rows) == 1 else None

    def rollouts(self, *, active_only: bool = False) -> list[RolloutRow]:
        where = f" WHERE state IN ({_ACTIVE_SQL})" if active_only else ""
        return [_rollout(r) for r in self._q(f"SELECT {_R_COLS} FROM rollouts{where} ORDER BY seq")]

    def latest(self) -> RolloutRow | None:
        rows = self._q(f"SELECT {_R_COLS} FROM rollouts ORDER BY seq DESC LIMIT 1")
        return _rollout(rows[0]) if rows else None

    def _set(self, table: str, where: str, key: Sequence[Any], fields: dict[str, Any]) -> None:
        bad = set(fields) - _SETTABLE[table]
        if bad:
            raise ValueError(f"cannot set {sorted(bad)} on {table}")
        if not fields:
            return
        assignments = ", ".join(f"{name} = ?" for name in fields)
        with self._in_transaction():
            self._q(f"UPDATE {table} SET {assignments} WHERE {where}", [*fields.values(), *key])

    @contextlib.contextmanager
    def _in_transaction(self) -> Iterator[None]:
        """A write outside any transaction gets one of its own (so it is fenced too)."""
        if self._conn.in_transaction:
            yield
            return
        with self.atomic():
            yield

    def set_rollout(self, rollout_id: str, **fields: Any) -> None:
        fields.setdefault("updated_ms", self._clock.now_ms())
        self._set("rollouts", "id = ?", (rollout_id,), fields)

    # -- waves -----------------------------------------------------------------------------
    def waves(self, rollout_id: str) -> list[WaveRow]:
        return [
            WaveRow(*r)
            for r in self._q(f"SELECT {_W_COLS} FROM rollout_waves WHERE rollout_id = ? ORDER BY idx", (rollout_id,))
        ]

    def wave(self, rollout_id: str, idx: int) -> WaveRow | None:
        rows = self._q(f"SELECT {_W_COLS} FROM rollout_waves WHERE rollout_id = ? AND idx = ?", (rollout_id, idx))
        return WaveRow(*rows[0]) if rows else None

    def set_wave(self, rollout_id: str, idx: int, **fields: Any) -> None:
        self._set("rollout_waves", "rollout_id = ? AND idx = ?", (rollout_id, idx), fields)

    # -- devices ---------------------------------------------------------------------------
    def devices(
        self,
        rollout_id: str,
        *,
        wave: int | None = None,
        states: Sequence[str] | None = None,
        max_wave: int | None = None,
    ) -> list[DeviceRow]:
        sql = f"SELECT {_D_COLS} FROM rollout_devices WHERE rollout_id = ?"
        args: list[Any] = [rollout_id]
        if wave is not None:
            sql += " AND wave = ?"
            args.append(wave)
        if max_wave is not None:
            sql += " AND wave <= ?"
            args.append(max_wave)
        if states is not None:
            sql += f" AND state IN ({', '.join('?' * len(states))})"
            args.extend(states)
        return [DeviceRow(*r) for r in self._q(sql + " ORDER BY wave, device_id", args)]

    def device(self, rollout_id: str, device_id: str) -> DeviceRow | None:
        rows = self._q(
            f"SELECT {_D_COLS} FROM rollout_devices WHERE rollout_id = ? AND device_id = ?", (rollout_id, device_id)
        )
        return DeviceRow(*rows[0]) if rows else None

    def set_device(self, rollout_id: str, device_id: str, **fields: Any) -> None:
        """Change a device's row; a change of its state is also appended to its events."""
        fields.setdefault("updated_ms", self._clock.now_ms())
        with self._in_transaction():
            self._set_device(rollout_id, device_id, fields)

    def _set_device(self, rollout_id: str, device_id: str, fields: dict[str, Any]) -> None:
        if "state" in fields:
            self._q("INSERT INTO rollout_device_events (rollout_id, device_id, at_ms, state, detail)"
                    " SELECT rollout_id, device_id, ?, ?, ? FROM rollout_devices"
                    " WHERE rollout_id = ? AND device_id = ? AND state != ?",
                    (fields["updated_ms"], fields["state"], str(fields.get("detail", ""))[:500], rollout_id,
                     device_id, fields["state"]))
        self._set("rollout_devices", "rollout_id = ? AND device_id = ?", (rollout_id, device_id), fields)

    def keep_log(self, rollout_id: str, device_id: str, *, at_ms: int, state: str, lines: Sequence[str]) -> None:
        """Keep the log lines of a device's failure report in a rollout (its newest only)."""
        self._q("INSERT INTO rollout_device_logs (rollout_id, device_id, at_ms, state, lines) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (rollout_id, device_id) DO UPDATE SET at_ms = excluded.at_ms, state = excluded.state,"
                " lines = excluded.lines", (rollout_id, device_id, at_ms, state, "\n".join(lines)))

    def counts(self, rollout_id: str) -> dict[int, dict[str, int]]:
        """wave -> state -> number of devices."""
        out: dict[int, dict[str, int]] = {}
        for wave, state, n in self._q(
            "SELECT wave, state, COUNT(*) FROM rollout_devices WHERE rollout_id = ? GROUP BY wave, state",
            (rollout_id,),
        ):
            out.setdefault(wave, {})[state] = n
        return out

    def from_versions(self, rollout_id: str) -> dict[str, int]:
        """The versions the rollout's devices ran when it took them -> how many, most first
        ("" for a device whose version was not known then)."""
        rows = self._q("SELECT from_version, COUNT(*) AS n FROM rollout_devices WHERE rollout_id = ?"
                       " GROUP BY from_version ORDER BY n DESC, from_version", (rollout_id,))
        return {str(v or ""): int(n) for v, n in rows}

    def progress(self, rollout_id: str) -> dict[int, dict[str, float]]:
        """wave -> the image bytes its devices have of what they were offered, what they fetch
        over the network of it (the rest is copied from their active slots) and fetched so far,
        their summed download rate and the progress reports received."""
        out: dict[int, dict[str, float]] = {}
        for wave, done, total, rate, reports, to_fetch, fetched in self._q(
            "SELECT wave, SUM(bytes_done), SUM(bytes_total), SUM(CASE WHEN state = 'downloading'"
            " THEN rate_bytes_per_s ELSE 0 END), SUM(progress_reports), SUM(bytes_to_fetch), SUM(bytes_fetched)"
            " FROM rollout_devices WHERE rollout_id = ? GROUP BY wave", (rollout_id,)):
            out[int(wave)] = {"bytes_done": int(done or 0), "bytes_total": int(total or 0),
                              "rate_bytes_per_s": float(rate or 0), "progress_reports": int(reports or 0),
                              "bytes_to_fetch": int(to_fetch or 0), "bytes_fetched": int(fetched or 0)}
        return out

    def totals(self, rollout_id: str) -> dict[str, int]:
        rows = self._q("SELECT state, COUNT(*) FROM rollout_devices WHERE rollout_id = ? GROUP BY state", (rollout_id,))
        return {str(state): int(n) for state, n in rows}

    def holders(self, device_ids: Sequence[str], *,
                among: Callable[[RolloutRow], bool] | None = None) -> dict[str, tuple[str, str]]:
        """device -> (rollout id, its state there) for those of `device_ids` an unfinished
        rollout (scheduled, running or paused; one `among` takes, when given: those of a kind and
        lane, `KindTraits.holds_with`) holds in a state that is not final."""
        wanted = set(device_ids)
        if not wanted:
            return {}
        finals = sorted(TERMINAL)
        of_kind = None if among is None else {r.id for r in self.rollouts(active_only=True) if among(r)}
        rows = self._q(
            "SELECT d.device_id, d.rollout_id, d.state FROM rollout_devices AS d JOIN rollouts AS r"
            f" ON r.id = d.rollout_id WHERE r.state IN ({_ACTIVE_SQL})"
            f" AND d.state NOT IN ({', '.join('?' * len(finals))})", finals)
        return {str(device): (str(rid), str(state)) for device, rid, state in rows
                if device in wanted and (of_kind is None or rid in of_kind)}

    def cancels_due(self) -> list[tuple[str, str, str]]:
        """(rollout id, device, why) of the devices still updating in a canceled or aborted
        rollout that were not sent a cancel yet."""
        progress = sorted(IN_PROGRESS)
        return [(str(rid), str(device), str(why)) for rid, device, why in self._q(
            "SELECT d.rollout_id, d.device_id, r.detail FROM rollout_devices AS d JOIN rollouts AS r"
            " ON r.id = d.rollout_id WHERE r.state IN ('canceled', 'aborted') AND d.cancel_sent_ms IS NULL"
            f" AND d.state IN ({', '.join('?' * len(progress))}) ORDER BY d.rollout_id, d.device_id", progress)]

    def cancels_unsent(self) -> int:
        """Mark every cancel sent to a device still updating in a canceled or aborted rollout as
        not sent (a new orchestrator sends them again: they may wait in the previous one's
        outbox); how many."""
        progress = sorted(IN_PROGRESS)
        with self._in_transaction(), store_errors("rollout store"):
            return int(self._conn.execute(
                "UPDATE rollout_devices SET cancel_sent_ms = NULL WHERE cancel_sent_ms IS NOT NULL"
                f" AND state IN ({', '.join('?' * len(progress))}) AND rollout_id IN"
                " (SELECT id FROM rollouts WHERE state IN ('canceled', 'aborted'))", progress).rowcount)

    def cancel_sent(self, pairs: Sequence[tuple[str, str]]) -> None:
        """The cancels of these (rollout id, device) pairs are queued (in the caller's transaction)."""
        now = self._clock.now_ms()
        with store_errors("record cancels"):
            self._conn.executemany(
                "UPDATE rollout_devices SET cancel_sent_ms = ? WHERE rollout_id = ? AND device_id = ?",
                [(now, rid, device) for rid, device in pairs])

    def record_offer(self, rollout_id: str, device_id: str, attempt: int) -> None:
        with self._in_transaction():
            self._q(
                "INSERT INTO rollout_offers (rollout_id, device_id, at_ms, attempt) VALUES (?, ?, ?, ?)",
                (rollout_id, device_id, self._clock.now_ms(), attempt),
            )

    def unrecord_offers(self, rollout_id: str, offers: Sequence[tuple[str, int]]) -> None:
        """Forget the offers (device, attempt) recorded but never sent (the outbox refused them)."""
        with self._in_transaction(), store_errors("rollout store"):
            self._conn.executemany("DELETE FROM rollout_offers WHERE rollout_id = ? AND device_id = ? AND attempt = ?",
                                   [(rollout_id, device, attempt) for device, attempt in offers])

    def offers(self, rollout_id: str) -> list[tuple[str, int, int]]:
        """(device, at_ms, attempt) of every offer made, oldest first."""
        return [
            (d, at, a)
            for d, at, a in self._q(
                "SELECT device_id, at_ms, attempt FROM rollout_offers WHERE rollout_id = ? ORDER BY rowid",
                (rollout_id,),
            )
        ]

    def claim(self, msg_id: str) -> bool:
        """Record a report id; False when it was applied before (inside the caller's transaction)."""
        with store_errors("rollout store"):
            cur = self._conn.execute(
                "INSERT INTO rollout_processed (msg_id, at_ms) VALUES (?, ?) ON CONFLICT (msg_id) DO NOTHING",
                (msg_id, self._clock.now_ms())
            )
        return cur.rowcount == 1

    def prune_processed(self, older_than_s: float, *, limit: int | None = None) -> int:
        """Forget report ids older than `older_than_s`, oldest first, at most `limit` in this one
        transaction; how many were forgotten.

        An active (running or paused) rollout's reports are never forgotten: nothing claimed
        after the oldest active rollout was created is touched, however old. Keep the window
        longer than a device may resend a report (its outbox TTL and retry horizon); a report
        redelivered after that is still refused by the device's `report_seq` guard.
        """
        cutoff = self._clock.now_ms() - int(older_than_s * 1000)
        oldest_active = self._q(f"SELECT MIN(created_ms) FROM rollouts WHERE state IN ({_ACTIVE_SQL})")[0][0]
        if oldest_active is not None:
            cutoff = min(cutoff, int(oldest_active))
        if not self._q("SELECT 1 FROM rollout_processed WHERE at_ms < ? LIMIT 1", (cutoff,)):
            return 0  # nothing due: no write transaction
        with self.atomic(), store_errors("rollout store"):
            cur = self._conn.execute(
                "DELETE FROM rollout_processed WHERE msg_id IN (SELECT msg_id FROM rollout_processed"
                " WHERE at_ms < ? ORDER BY at_ms LIMIT ?)",
                (cutoff, NO_LIMIT if limit is None else max(0, limit)),
            )
        return cur.rowcount

    def prune_finished(self, older_than_s: float, *, limit: int | None = None) -> int:
        """Delete the per-device rows of rollouts that finished longer than `older_than_s` ago,
        at most `limit` (None: all) in this one transaction, oldest rollout first; how many
        were deleted.

        What goes: a finished rollout's `rollout_devices`, `rollout_offers` and
        `rollout_device_events` rows. They grow by a few rows per device per rollout and only
        serve the live orchestration, the devices' timelines and the rollout's chart.

        What stays, and why: the summary row in `rollouts`, its `rollout_waves` rows and its
        `rollout_controls` (the audit record of who asked what, one row per operator action). The
        per-device rows are the only copy of which device ended in which state, so the final
        count of devices per state is appended to the rollout's detail first (`PRUNED_NOTE`);
        `rollout status` then still shows the summary and the waves, while per-wave counts,
        offers and `--devices` are gone, and a rollback of the pruned rollout is refused (it no
        longer knows which devices took the version).

        Never touched: a running or paused rollout, a finished one with a device still
        mid-update (a stopped rollout lets installing devices finish and report), and a control
        not applied yet (the running leader answers it)."""
        budget = NO_LIMIT if limit is None else max(0, limit)
        if budget == 0:
            return 0
        candidates = self.prunable_rollouts(self._clock.now_ms() - int(older_than_s * 1000))
        if not candidates:
            return 0  # nothing due: no write transaction
        removed = 0
        with self.atomic(), store_errors("rollout store"):
            for rollout_id in candidates:
                self._note_totals(rollout_id)
                for table, where, key in _PRUNED_TABLES:
                    left = budget - removed
                    if left == 0:
                        return removed
                    removed += self._conn.execute(
                        f"DELETE FROM {table} WHERE rollout_id = ? AND {key} IN"
                        f" (SELECT {key} FROM {table} WHERE {where} LIMIT ?)",
                        (rollout_id, rollout_id, left),
                    ).rowcount
        return removed

    def prunable_rollouts(self, cutoff_ms: int) -> list[str]:
        """Ids of the rollouts that finished before `cutoff_ms` and still hold prunable rows,
        oldest first."""
        finished = ", ".join("?" * len(FINISHED))
        in_progress = ", ".join("?" * len(IN_PROGRESS))
        has_rows = " OR ".join(
            f"EXISTS (SELECT 1 FROM {t} WHERE {where.replace('?', 'r.id')})" for t, where, _ in _PRUNED_TABLES)
        rows = self._q(
            f"SELECT r.id FROM rollouts r WHERE r.state IN ({finished})"
            " AND COALESCE(r.finished_ms, r.updated_ms) < ?"
            " AND NOT EXISTS (SELECT 1 FROM rollout_devices d WHERE d.rollout_id = r.id"
            f" AND d.state IN ({in_progress}))"
            f" AND ({has_rows}) ORDER BY COALESCE(r.finished_ms, r.updated_ms), r.seq",
            (*FINISHED, cutoff_ms, *sorted(IN_PROGRESS)),
        )
        return [str(r[0]) for r in rows]

    def _note_totals(self, rollout_id: str) -> None:
        """Append the final per-state device counts to the rollout's detail (once: the first
        pruning batch that reaches the rollout), so its status still tells how it ended."""
        detail = self._q("SELECT detail FROM rollouts WHERE id = ?", (rollout_id,))[0][0]
        totals = self.totals(rollout_id)
        if PRUNED_NOTE in detail or not totals:
            return
        counts = ", ".join(f"{state} {n}" for state, n in sorted(totals.items()))
        note = f"{PRUNED_NOTE}: {sum(totals.values())} devices ({counts})"
        self._q("UPDATE rollouts SET detail = ? WHERE id = ?", (f"{detail}; {note}" if detail else note, rollout_id))

    def processed_count(self) -> int:
        """How many report ids are remembered (for metrics and tests)."""
        return int(self._q("SELECT COUNT(*) FROM rollout_processed")[0][0])

    def due_devices(self, now_ms: int) -> list[DeviceRow]:
        """Devices whose timer ran out: in progress in any rollout, or queued in a running one."""
        return [
            DeviceRow(*r)
            for r in self._q(
                f"SELECT {', '.join('d.' + c.strip() for c in _D_COLS.split(','))} FROM rollout_devices d"
                " JOIN rollouts r ON r.id = d.rollout_id WHERE d.deadline_ms IS NOT NULL AND d.deadline_ms <= ?"
                " AND (d.state IN ('notified', 'downloading', 'installing', 'rebooting', 'verifying')"
                "      OR (d.state = 'queued' AND r.state = 'running'))"
                " ORDER BY d.deadline_ms, d.rollout_id, d.device_id",
                (now_ms,),
            )
        ]

    def next_deadline_ms(self) -> int | None:
        """The earliest stored timer: device timeout, retry, soak end."""
        rows = self._q(
            "SELECT MIN(t) FROM ("
            " SELECT MIN(d.deadline_ms) AS t FROM rollout_devices d JOIN rollouts r ON r.id = d.rollout_id"
            "  WHERE d.deadline_ms IS NOT NULL AND (d.state IN ('notified', 'downloading', 'installing',"
            "  'rebooting', 'verifying') OR (d.state = 'queued' AND r.state = 'running'))"
            " UNION ALL SELECT MIN(d.next_try_ms) FROM rollout_devices d JOIN rollouts r ON r.id = d.rollout_id"
            "  WHERE r.state = 'running' AND d.next_try_ms IS NOT NULL AND d.state = 'queued'"
            " UNION ALL SELECT MIN(w.soak_until_ms) FROM rollout_waves w JOIN rollouts r ON r.id = w.rollout_id"
            "  WHERE r.state = 'running' AND w.state = 'soaking') AS timers"
        )
        value = rows[0][0] if rows else None
        return None if value is None else int(value)

    # -- controls --------------------------------------------------------------------------
    def add_serving(self, rollout_id: str, *, chunks: int, bytes_: int, busy: int, rejected: int,
                    max_concurrent: int) -> None:
        """Add what the ConfigServers served since the last call (counts are increments;
        `max_concurrent` is a high-water mark)."""
        most = greatest(self.dialect, "rollout_serving.max_concurrent", "excluded.max_concurrent")
        with self.atomic(fenced=False), store_errors("rollout store"):
            self._conn.execute(
                "INSERT INTO rollout_serving (rollout_id, chunks, bytes, busy, rejected, max_concurrent, updated_ms)"
                " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (rollout_id) DO UPDATE SET"
                " chunks = rollout_serving.chunks + excluded.chunks, bytes = rollout_serving.bytes + excluded.bytes,"
                " busy = rollout_serving.busy + excluded.busy, rejected = rollout_serving.rejected + excluded.rejected,"
                f" max_concurrent = {most},"
                " updated_ms = excluded.updated_ms",
                (rollout_id, chunks, bytes_, busy, rejected, max_concurrent, self._clock.now_ms()),
            )

    def serving(self, rollout_id: str) -> dict[str, int]:
        """What the ConfigServers served for this rollout (zeros before the first chunk)."""
        rows = self._q("SELECT chunks, bytes, busy, rejected, max_concurrent FROM rollout_serving"
                       " WHERE rollout_id = ?", (rollout_id,))
        names = ("chunks", "bytes", "busy", "rejected", "max_concurrent")
        return dict(zip(names, rows[0], strict=True)) if rows else dict.fromkeys(names, 0)

    def leader_last_seen_ms(self) -> int | None:
        """When the leader last moved a rollout, as far as the rollout tables tell: the newest
        control it answered or rollout it moved on (None: no sign). The registry's newest
        heartbeat is the other sign (`RegistryReads.last_heartbeat_ms`)."""
        sources = ["SELECT MAX(applied_ms) FROM rollout_controls", "SELECT MAX(updated_ms) FROM rollouts"]
        seen = [row[0][0] for row in (self._q(sql) for sql in sources) if row and row[0][0] is not None]
        return max(seen) if seen else None

    def add_control(self, rollout_id: str, action: str, arg: str = "", *, actor: str = "") -> int:
        """Queue a control; `actor` says who asked (kept as the audit record, at most 200 characters)."""
        if action not in CONTROLS:
            raise ValueError(f"unknown control {action!r}")
        with self.atomic(fenced=False):  # asked by anyone (the CLI, the console), applied by the orchestrator
            return int(self._q(
                "INSERT INTO rollout_controls (rollout_id, action, arg, created_ms, actor) VALUES (?, ?, ?, ?, ?)"
                " RETURNING id", (rollout_id, action, arg, self._clock.now_ms(), actor[:200]))[0][0])

    def controls(self, rollout_id: str) -> list[ControlRow]:
        """A rollout's controls, oldest first: the audit record of who asked what, and what came of it."""
        return [ControlRow(*r) for r in self._q(
            f"SELECT {_C_COLS} FROM rollout_controls WHERE rollout_id = ? ORDER BY id", (rollout_id,))]

    def state_changes(self, rollout_id: str) -> list[tuple[int, str, str]]:
        """(at_ms, device, its new state) of every device state change in a rollout, oldest
        first; a device's first state ('queued', from the rollout's creation) is not among them."""
        return [(int(at), str(d), str(s)) for at, d, s in self._q(
            "SELECT at_ms, device_id, state FROM rollout_device_events WHERE rollout_id = ? ORDER BY at_ms, rowid",
            (rollout_id,))]

    def pending_controls(self) -> list[ControlRow]:
        return [
            ControlRow(*r)
            for r in self._q(f"SELECT {_C_COLS} FROM rollout_controls WHERE applied_ms IS NULL ORDER BY id")
        ]

    def control(self, control_id: int) -> ControlRow | None:
        rows = self._q(f"SELECT {_C_COLS} FROM rollout_controls WHERE id = ?", (control_id,))
        return ControlRow(*rows[0]) if rows else None

    def finish_control(self, control_id: int, result: str, outcome: ControlOutcome = "applied") -> None:
        """The control applied (`result` says what it did), or refused (`result` says why)."""
        self._q(
            "UPDATE rollout_controls SET applied_ms = ?, result = ?, outcome = ? WHERE id = ?",
            (self._clock.now_ms(), result, outcome, control_id),
        )

    # -- the orchestrator lease (a fleet's database server: `rollout_engine.lease`) ------
    def lease(self, name: str) -> LeaseRow | None:
        """Lease `name` (None: never taken, or a database without leases: `leader.db`)."""
        return lease_row(self._conn, name) if self.on_server else None


@dataclass(frozen=True)
class DeviceLog:
    """The log lines a device's failure report carried (`RolloutReport.excerpt`)."""

    at_ms: int
    state: str
    lines: tuple[str, ...]


class RolloutReads:
    """The rollout tables' reads for the fleet views (`status`, the console), on any connection
    to the leader's database; a database whose leader never opened the rollout tables has no
    rollouts. Device ids go in and come out as values: the views join them with the registry's."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._dialect = dialect_of(conn)
        self.present = all(int(conn.execute(has_table(self._dialect, t)).fetchone()[0])
                           for t in ("rollouts", "rollout_devices"))

    def lease(self, name: str) -> LeaseRow | None:
        """Lease `name` as last written (None: never taken, or a database without leases:
        `leader.db`, whose one leader runs the orchestrator)."""
        return lease_row(self._conn, name)

    def devices_in(self, rollout_id: str) -> list[str]:
        """The devices a rollout includes."""
        if not self.present:
            return []
        return [str(d) for (d,) in self._conn.execute(
            "SELECT device_id FROM rollout_devices WHERE rollout_id = ?", (rollout_id,))]

    def newest_of(self, device_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """Of each device, (rollout id, its state there) in the newest rollout that includes it."""
        if not self.present or not device_ids:
            return {}
        newest: dict[str, tuple[str, str]] = {}
        for device_id, rollout_id, state in self._conn.execute(
            "SELECT d.device_id, d.rollout_id, d.state FROM rollout_devices AS d JOIN rollouts AS r"
            f" ON r.id = d.rollout_id WHERE {in_json_array(self._dialect, 'd.device_id')} ORDER BY r.seq DESC",
            (json.dumps(list(device_ids)),),
        ):
            newest.setdefault(str(device_id), (str(rollout_id), str(state)))
        return newest

    def of_device(self, device_id: str) -> list[tuple[str, str, str, str, int, str, str, int, str]]:
        """Every rollout that includes the device, newest first: (rollout id, name, version,
        rollout state, wave, the device's state, its detail, when it changed, the version it ran
        when the rollout took it)."""
        if not self.present:
            return []
        try:
            rows = self._conn.execute(
                "SELECT r.id, r.name, r.version, r.state, d.wave, d.state, d.detail, d.updated_ms, d.from_version"
                " FROM rollout_devices AS d JOIN rollouts AS r ON r.id = d.rollout_id WHERE d.device_id = ?"
                " ORDER BY r.seq DESC", (device_id,)).fetchall()
        except (sqlite3.OperationalError, StoreError):  # a rollout schema this version does not know
            return []
        return [(str(a), str(b), str(c), str(d), int(e), str(f), str(g), int(h), str(i or ""))
                for a, b, c, d, e, f, g, h, i in rows]

    def of_kind(self, kind: str, *, active: bool = False) -> list[tuple[str, str, str, bytes]]:
        """The rollouts of `kind` (only the unfinished ones when `active`), newest first: (id,
        state, version, the release the kind offers from)."""
        if not self.present:
            return []
        where = f" WHERE state IN ({_ACTIVE_SQL})" if active else ""
        rows = self._conn.execute(f"SELECT id, state, version, spec, signed_manifest FROM rollouts{where}"
                                  " ORDER BY seq DESC").fetchall()
        return [(str(i), str(st), str(v), bytes(m)) for i, st, v, spec, m in rows
                if spec_from_json(bytes(spec)).rollout.kind == kind]

    def succeeded_in(self, rollout_id: str) -> list[str]:
        """The devices a rollout succeeded on."""
        if not self.present:
            return []
        return [str(d) for (d,) in self._conn.execute(
            "SELECT device_id FROM rollout_devices WHERE rollout_id = ? AND state = 'succeeded' ORDER BY device_id",
            (rollout_id,))]

    def unfinished_in(self, rollout_id: str) -> list[str]:
        """The devices of a rollout that have not finished in it (offered, applying, or queued)."""
        if not self.present:
            return []
        return [str(d) for (d,) in self._conn.execute(
            "SELECT device_id FROM rollout_devices WHERE rollout_id = ? AND state NOT IN"
            f" ({', '.join(repr(t) for t in sorted(TERMINAL))})", (rollout_id,))]

    def logs_of(self, device_id: str, rollout_ids: Sequence[str] = ()) -> dict[str, DeviceLog]:
        """The log lines of the device's newest failure report in each rollout (of `rollout_ids`,
        or all), by rollout id."""
        if not self.present:
            return {}
        sql = "SELECT rollout_id, at_ms, state, lines FROM rollout_device_logs WHERE device_id = ?"
        args: list[Any] = [device_id]
        if rollout_ids:
            sql += f" AND {in_json_array(self._dialect, 'rollout_id')}"
            args.append(json.dumps(list(rollout_ids)))
        try:
            rows = self._conn.execute(sql, args).fetchall()
        except (sqlite3.OperationalError, StoreError):  # a rollout schema older than the logs
            return {}
        return {str(r): DeviceLog(int(at), str(st), tuple(str(lines).split("\n"))) for r, at, st, lines in rows}

    def timeline_of(self, device_id: str, *, limit: int = 100) -> list[tuple[int, str, str, str]]:
        """The device's newest state changes across rollouts, newest first: (at_ms, rollout id,
        state, detail)."""
        if not self.present:
            return []
        try:
            rows = self._conn.execute(
                "SELECT at_ms, rollout_id, state, detail FROM rollout_device_events WHERE device_id = ?"
                " ORDER BY at_ms DESC, rowid DESC LIMIT ?", (device_id, limit)).fetchall()
        except (sqlite3.OperationalError, StoreError):  # a rollout schema older than the events
            return []
        return [(int(a), str(b), str(c), str(d)) for a, b, c, d in rows]

    def controls_since(self, since_ms: int, *, limit: int = 1000) -> list[tuple[int, str, str, str, str, str]]:
        """Every rollout control asked for since `since_ms`, oldest first: (asked at ms, who, action,
        rollout id, its argument, its outcome and result)."""
        if not self.present:
            return []
        try:
            rows = self._conn.execute(
                "SELECT created_ms, actor, action, rollout_id, arg, COALESCE(outcome, ''), result FROM rollout_controls"
                " WHERE created_ms >= ? ORDER BY id LIMIT ?", (since_ms, limit)).fetchall()
        except (sqlite3.OperationalError, StoreError):
            return []
        return [(int(a), str(b), str(c), str(d), str(e), f"{f}: {g}" if f and g else str(f or "not applied yet"))
                for a, b, c, d, e, f, g in rows]

    def controls_of(self, rollout_ids: Sequence[str]) -> list[tuple[int, str, str, str, int | None, str, str]]:
        """The controls of these rollouts, newest first: (asked at ms, rollout id, action, who
        asked, applied at ms, outcome, result)."""
        if not self.present or not rollout_ids:
            return []
        try:
            rows = self._conn.execute(
                "SELECT created_ms, rollout_id, action, actor, applied_ms, COALESCE(outcome, ''), result"
                f" FROM rollout_controls WHERE {in_json_array(self._dialect, 'rollout_id')}"
                " ORDER BY id DESC LIMIT 100",
                (json.dumps(list(rollout_ids)),)).fetchall()
        except (sqlite3.OperationalError, StoreError):
            return []
        return [(int(a), str(b), str(c), str(d), None if e is None else int(e), str(f), str(g))
                for a, b, c, d, e, f, g in rows]


__all__ = [
    "CONTROLS",
    "DEVICE_STATES",
    "FAILURES",
    "FINISHED",
    "IN_PROGRESS",
    "PRUNED_NOTE",
    "ROLLOUT_ACTIVE",
    "ROLLOUT_STATES",
    "TERMINAL",
    "WAVE_STATES",
    "ControlOutcome",
    "ControlRow",
    "DeviceLog",
    "DeviceRow",
    "LeaseRow",
    "RolloutReads",
    "RolloutRow",
    "RolloutStore",
    "WaveRow",
]
