"""The updater's durable state: one SQLite file in the state directory.

    update    one row: the current (or last) update, its state, slots, progress, boot count and
              the mirrors its offer named
    slots     the version each slot holds, and the signed manifest of the image in it (what a
              delta copies chunks by; NULL for an image the updater did not install)
    reports   every report made, in order (`seq`), with a flag once handed to the agent's outbox

Each state change and the report it makes are one transaction (`synchronous=FULL`: a transition
is on disk when the call returns). Calls run in a thread, never blocking the event loop on fsync.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from agent.core.clock import Clock
from agent.core.errors import StoreError
from agent.core.redact import redact
from agent.core.sqlite import store_errors
from agent.core.store import Store
from agent.core.tasks import in_thread
from firmware_rollout.messages import REPORT_STATE, UpdaterState
from rollout_engine.messages import DETAIL_MAX, RolloutReport

T = TypeVar("T")
SCHEMA_VERSION = 1
KEEP_SENT_REPORTS = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS update_state (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    state TEXT NOT NULL,
    rollout_id TEXT NOT NULL DEFAULT '',
    signed_manifest BLOB,
    version TEXT NOT NULL DEFAULT '',
    from_slot TEXT NOT NULL DEFAULT '',
    to_slot TEXT NOT NULL DEFAULT '',
    from_version TEXT NOT NULL DEFAULT '',
    chunks_done INTEGER NOT NULL DEFAULT 0,
    boot_count INTEGER NOT NULL DEFAULT 0,
    health_deadline_ms INTEGER NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '',
    updated_ms INTEGER NOT NULL DEFAULT 0
);
INSERT OR IGNORE INTO update_state (id, state) VALUES (1, 'idle');
CREATE TABLE IF NOT EXISTS slots (slot TEXT PRIMARY KEY, version TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reports (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    body BLOB NOT NULL,
    sent INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS reports_unsent ON reports (seq) WHERE sent = 0;
"""


def _v1(conn: sqlite3.Connection) -> None:
    """The first schema. Idempotent: a database written before the updater's tables were
    versioned like every other store's (`PRAGMA user_version = 1`) already holds them."""
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)


@dataclass(frozen=True)
class UpdateRecord:
    """The row of `update_state`."""

    state: UpdaterState = "idle"
    rollout_id: str = ""
    signed_manifest: bytes | None = None
    version: str = ""
    from_slot: str = ""
    to_slot: str = ""
    from_version: str = ""
    chunks_done: int = 0
    boot_count: int = 0
    health_deadline_ms: int = 0
    detail: str = ""
    updated_ms: int = 0
    stage_only: bool = False  # a download-only offer: stop at `staged`
    mirrors: str = ""  # the offer's HTTP(S) mirrors, one per line (a resumed download uses them too)

    def but(self, **changes: Any) -> UpdateRecord:
        return replace(self, **changes)


_FIELDS = tuple(asdict(UpdateRecord()).keys())
_report_decoder = msgspec.msgpack.Decoder(RolloutReport)
_encoder = msgspec.msgpack.Encoder()


def _v2(conn: sqlite3.Connection) -> None:
    """Download-only offers (`UpdateOffer.download_only`): the record says to stop at `staged`."""
    conn.execute("ALTER TABLE update_state ADD COLUMN stage_only INTEGER NOT NULL DEFAULT 0")


def _v3(conn: sqlite3.Connection) -> None:
    """Mirrors (`UpdateOffer.mirrors`) and each slot's signed manifest (delta updates)."""
    conn.execute("ALTER TABLE update_state ADD COLUMN mirrors TEXT NOT NULL DEFAULT ''")
    conn.execute("ALTER TABLE slots ADD COLUMN signed_manifest BLOB")


class UpdaterStore(Store):
    """Owns the connection; every method is a short transaction run in a thread (one at a time),
    at `synchronous=FULL`: an update's state must survive a power cut."""

    COMPONENT = "updater"
    MIGRATIONS = (_v1, _v2, _v3)
    WHAT = "updater store"

    def __init__(self, conn: sqlite3.Connection, clock: Clock, *, path: str) -> None:
        super().__init__(conn, path=path)
        self._clock = clock
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, path: str | Path, *, clock: Clock) -> UpdaterStore:
        try:
            conn = await in_thread(clock, cls._connect, Path(path))
        except StoreError as exc:
            raise StoreError(f"{path}: cannot open the updater database: {exc}") from exc
        return cls(conn, clock, path=str(path))

    @classmethod
    def _connect(cls, path: Path) -> sqlite3.Connection:
        legacy = cls._legacy_version(path)
        if legacy not in (0, 1):
            raise StoreError(f"unknown updater schema version {legacy}")
        return cls.connect_migrated(path, synchronous="FULL")

    @staticmethod
    def _legacy_version(path: Path) -> int:
        """`PRAGMA user_version` of a database written before the tables were versioned."""
        if not path.exists():
            return 0
        with store_errors("read the schema version"):
            conn = sqlite3.connect(path)
            try:
                return int(conn.execute("PRAGMA user_version").fetchone()[0])
            finally:
                conn.close()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        self.check_open()
        async with self._lock:
            try:
                return await in_thread(self._clock, fn, *args)
            except sqlite3.Error as exc:
                raise StoreError(f"updater database: {exc}") from exc

    async def aclose(self) -> None:
        """`close`, after the transaction in progress (if any), off the loop."""
        if not self.closed:
            async with self._lock:
                await in_thread(self._clock, self.close)

    # -- reads -----------------------------------------------------------------------------
    def _load(self) -> tuple[UpdateRecord, dict[str, str]]:
        row = self._conn.execute(f"SELECT {', '.join(_FIELDS)} FROM update_state WHERE id = 1").fetchone()
        fields = dict(zip(_FIELDS, row, strict=True))
        fields["stage_only"] = bool(fields["stage_only"])
        record = UpdateRecord(**fields)
        slots = dict(self._conn.execute("SELECT slot, version FROM slots WHERE version != ''").fetchall())
        return record, slots

    async def load(self) -> tuple[UpdateRecord, dict[str, str]]:
        """The update record and the version each slot holds."""
        return await self._run(self._load)

    def _slot_manifest(self, slot: str) -> bytes | None:
        row = self._conn.execute("SELECT signed_manifest FROM slots WHERE slot = ?", (slot,)).fetchone()
        return None if row is None or row[0] is None else bytes(row[0])

    async def slot_manifest(self, slot: str) -> bytes | None:
        """The signed manifest of the image the updater installed in `slot` (None: not known)."""
        return await self._run(self._slot_manifest, slot)

    def _reports(self, unsent_only: bool, limit: int) -> list[tuple[int, RolloutReport]]:
        where = "WHERE sent = 0 " if unsent_only else ""
        rows = self._conn.execute(
            f"SELECT seq, body FROM reports {where}ORDER BY seq DESC LIMIT ?", (limit,)
        ).fetchall()
        return [(seq, _report_decoder.decode(body)) for seq, body in reversed(rows)]

    async def reports(self, *, unsent_only: bool = False, limit: int = 100) -> list[RolloutReport]:
        """The latest `limit` reports, oldest first."""
        rows = await self._run(self._reports, unsent_only, limit)
        return [report for _, report in rows]

    async def unsent(self, limit: int = 100) -> list[tuple[int, RolloutReport]]:
        return await self._run(self._unsent, limit)

    def _unsent(self, limit: int) -> list[tuple[int, RolloutReport]]:
        rows = self._conn.execute("SELECT seq, body FROM reports WHERE sent = 0 ORDER BY seq LIMIT ?", (limit,))
        return [(seq, _report_decoder.decode(body)) for seq, body in rows.fetchall()]

    # -- writes ----------------------------------------------------------------------------
    def _save(
        self, record: UpdateRecord, report: Mapping[str, Any] | None, slots: Mapping[str, str],
        manifests: Mapping[str, bytes | None],
    ) -> RolloutReport | None:
        made = None
        with self.atomic():
            assignments = ", ".join(f"{name} = ?" for name in _FIELDS)
            self._conn.execute(
                f"UPDATE update_state SET {assignments} WHERE id = 1", [getattr(record, f) for f in _FIELDS]
            )
            for slot, version in slots.items():
                self._conn.execute(
                    "INSERT INTO slots (slot, version) VALUES (?, ?) ON CONFLICT (slot) DO UPDATE SET version = ?",
                    (slot, version, version),
                )
            for slot, signed in manifests.items():
                self._conn.execute(
                    "INSERT INTO slots (slot, version, signed_manifest) VALUES (?, '', ?) ON CONFLICT (slot)"
                    " DO UPDATE SET signed_manifest = ?", (slot, signed, signed))
            if report is not None:
                seq = self._conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM reports").fetchone()[0]
                made = RolloutReport(seq=seq, **{**report, "detail": clip(str(report.get("detail", "")))})
                self._conn.execute("INSERT INTO reports (seq, body) VALUES (?, ?)", (seq, _encoder.encode(made)))
        return made

    async def save(
        self,
        record: UpdateRecord,
        *,
        report: Mapping[str, Any] | None = None,
        slots: Mapping[str, str] | None = None,
        manifests: Mapping[str, bytes | None] | None = None,
    ) -> RolloutReport | None:
        """Write `record` (and slot versions and manifests, and a report built from `report` plus
        its seq) in one transaction; return the report made."""
        return await self._run(self._save, record, report, dict(slots or {}), dict(manifests or {}))

    async def add_report(self, report: Mapping[str, Any]) -> RolloutReport:
        """Record a report that changes no state (an offer refused while busy)."""
        record, _ = await self.load()
        made = await self.save(record, report=report)
        assert made is not None
        return made

    def _mark_sent(self, seqs: list[int]) -> None:
        with self.atomic():
            self._conn.executemany("UPDATE reports SET sent = 1 WHERE seq = ?", [(s,) for s in seqs])
            self._conn.execute(
                "DELETE FROM reports WHERE sent = 1 AND seq <= (SELECT MAX(seq) FROM reports) - ?",
                (KEEP_SENT_REPORTS,),
            )

    async def mark_sent(self, seqs: list[int]) -> None:
        if seqs:
            await self._run(self._mark_sent, seqs)


def clip(detail: str) -> str:
    """A detail within what a report may carry (`DETAIL_MAX` characters): a long health-command
    output must not make the leader refuse the report that says the device failed), its secrets
    redacted (`agent.core.redact`)."""
    detail = redact(detail)
    return detail if len(detail) <= DETAIL_MAX else detail[: DETAIL_MAX - 1] + "…"


def report_fields(record: UpdateRecord, *, device: str, ts_ms: int, active_version: str) -> dict[str, Any]:
    """The report a record's state makes (without `seq`, which the store assigns)."""
    return {
        "device": device,
        "rollout_id": record.rollout_id,
        "version": record.version,
        "state": REPORT_STATE[record.state],
        "phase": record.state,
        "detail": record.detail,
        "ts_ms": ts_ms,
        "active_version": active_version,
    }


__all__ = ["SCHEMA_VERSION", "UpdateRecord", "UpdaterStore", "report_fields"]
