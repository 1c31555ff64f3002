"""The fleet's device identities, in the leader's database (component "identities").

    device_identities   one row a device id: its state (pending, approved, rejected, revoked),
                        the key its request was made with (fingerprint), its hardware identity,
                        the claim credential it came through, its current certificate
    issued_certs        every certificate issued, with when it was revoked (the CRL's rows)
    identity_controls   approve / reject / revoke, written by `edge-agent devices` and the
                        console, applied by a running leader (it holds the CA's key); with
                        several leaders on PostgreSQL, by the one that claims it first
    enrol_tokens        a batch's enrolment tokens (sha256 only): uses left, expiry; each use is
                        spent by one atomic update (two leaders never spend the last use twice)
    enrol_allow         hardware serial numbers approved on their first request: an entry approves
                        one device, once (the first to use it is bound to it); the serial is what
                        the device says of itself, a hint for the operator, never a credential

One device id, one key: a request with another key than the one on record is refused (and
reported), unless the record was rejected (a new request replaces it). A pending record whose
device has not asked for `pending_expiry_s` is forgotten (`expire_pending`): a device that asks
again makes a new one.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent.core.backends import server_migrations
from agent.core.errors import IdentityError, StoreError
from agent.core.sql import Connection, ServerUrl, dialect_of, has_table
from agent.core.sqlite import Synchronous, store_errors
from agent.core.store import Store

COMPONENT = "identities"
State = Literal["pending", "approved", "rejected", "revoked"]
MAX_SERIAL = 64  # as EnrolRequest.serial
Action = Literal["approve", "reject", "revoke"]
ACTIONS: tuple[str, ...] = ("approve", "reject", "revoke")


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE device_identities (
            device TEXT PRIMARY KEY,
            state TEXT NOT NULL CHECK (state IN ('pending', 'approved', 'rejected', 'revoked')),
            fingerprint TEXT NOT NULL,
            csr TEXT NOT NULL,
            hw_serial TEXT NOT NULL DEFAULT '',
            machine_id TEXT NOT NULL DEFAULT '',
            agent_version TEXT NOT NULL DEFAULT '',
            claim TEXT NOT NULL DEFAULT '',
            requested_ms INTEGER NOT NULL,
            requests INTEGER NOT NULL DEFAULT 1,
            cert TEXT NOT NULL DEFAULT '',
            not_after_ms INTEGER NOT NULL DEFAULT 0,
            decided_ms INTEGER,
            decided_by TEXT NOT NULL DEFAULT '',
            reason TEXT NOT NULL DEFAULT ''
        )"""
    )
    conn.execute("CREATE INDEX device_identities_state ON device_identities(state)")
    conn.execute(
        """CREATE TABLE issued_certs (
            serial TEXT PRIMARY KEY,
            device TEXT NOT NULL,
            issued_ms INTEGER NOT NULL,
            not_after_ms INTEGER NOT NULL,
            revoked_ms INTEGER
        )"""
    )
    conn.execute("CREATE INDEX issued_certs_device ON issued_certs(device)")
    conn.execute(
        """CREATE TABLE identity_controls (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            action TEXT NOT NULL CHECK (action IN ('approve', 'reject', 'revoke')),
            device TEXT NOT NULL,
            reason TEXT NOT NULL DEFAULT '',
            "by" TEXT NOT NULL,
            at_ms INTEGER NOT NULL,
            applied_ms INTEGER,
            ok INTEGER,
            outcome TEXT NOT NULL DEFAULT ''
        )"""
    )
    conn.execute("CREATE INDEX identity_controls_unapplied ON identity_controls(applied_ms, id)")
    conn.execute(
        """CREATE TABLE enrol_tokens (
            digest TEXT PRIMARY KEY,
            uses_left INTEGER NOT NULL,
            expires_ms INTEGER NOT NULL,
            made_by TEXT NOT NULL,
            made_ms INTEGER NOT NULL
        )"""
    )
    conn.execute(
        """CREATE TABLE enrol_allow (
            hw_serial TEXT PRIMARY KEY,
            added_by TEXT NOT NULL,
            added_ms INTEGER NOT NULL
        )"""
    )


def _v2(conn: sqlite3.Connection) -> None:
    """Several leaders (PostgreSQL): the one that applies a control claims it first; the fleet's
    CA, by the fingerprint of its certificate, so that a leader with another CA refuses."""
    conn.execute("ALTER TABLE identity_controls ADD COLUMN claimed_by TEXT")
    conn.execute("CREATE TABLE identity_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


def _v3(conn: sqlite3.Connection) -> None:
    """When a pending device last asked (pending records expire); the device an allow-list entry
    approved, and when (an entry approves once)."""
    conn.execute("ALTER TABLE device_identities ADD COLUMN asked_ms INTEGER NOT NULL DEFAULT 0")
    conn.execute("UPDATE device_identities SET asked_ms = requested_ms")
    conn.execute("ALTER TABLE enrol_allow ADD COLUMN device TEXT")
    conn.execute("ALTER TABLE enrol_allow ADD COLUMN used_ms INTEGER")






@dataclass(frozen=True, slots=True)
class Identity:
    device: str
    state: State
    fingerprint: str
    hw_serial: str
    machine_id: str
    agent_version: str
    claim: str
    requested_ms: int
    requests: int
    cert: str
    not_after_ms: int
    decided_ms: int | None
    decided_by: str
    reason: str


@dataclass(frozen=True, slots=True)
class Control:
    id: int
    action: Action
    device: str
    reason: str
    by: str
    at_ms: int
    applied_ms: int | None = None
    ok: bool | None = None
    outcome: str = ""


_COLUMNS = ("device, state, fingerprint, hw_serial, machine_id, agent_version, claim, requested_ms, requests, cert,"
            " not_after_ms, decided_ms, decided_by, reason")


def reserved_reason(name: str, *, leaders: Iterable[str], operators: Iterable[str], claims: Iterable[str],
                    reserved: Iterable[str]) -> str:
    """Why `name` is one no device may hold ("" when a device may): a certificate for it would be
    the broker's ACL entry of a leader, an operator or a claim credential, or take a client id
    (every agent's begins `ea-`, `topics.CLIENT_ID_PREFIX`)."""
    from agent.transport.topics import CLIENT_ID_PREFIX

    if name.startswith(CLIENT_ID_PREFIX):
        return f"the name {name!r} is reserved: names beginning {CLIENT_ID_PREFIX!r} are the broker's client ids"
    for names, what in ((leaders, "a leader of the fleet"), (operators, "an operator"),
                        (claims, "a claim credential"), (reserved, "reserved (identity.reserved)")):
        if name in names:
            return f"the name {name!r} is reserved: it is {what}, never a device"
    return ""


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class IdentityReads:
    """The identities' reads for the views (`status`), on any connection to the leader's
    database; a leader without `[identity]` has no tables, and no identities."""

    def __init__(self, conn: Connection | sqlite3.Connection) -> None:
        self._conn: Any = conn
        self._present = bool(self._conn.execute(has_table(dialect_of(conn), "device_identities")).fetchone()[0])

    def actions(self, *, since_ms: int = 0, limit: int = 1000) -> list[tuple[int, str, str, str, str]]:
        """Operators' actions on identities since `since_ms`, oldest first: (at ms, who, action,
        what it was on, its outcome): approvals, rejections and revocations, enrolment tokens
        made, serial numbers allowed."""
        if not self._present:
            return []
        rows = self._conn.execute(
            "SELECT at_ms, \"by\", action, device, CASE WHEN applied_ms IS NULL THEN 'not applied yet'"
            " WHEN ok = 1 THEN 'applied' ELSE 'refused: ' || outcome END FROM identity_controls WHERE at_ms >= ?"
            " UNION ALL SELECT made_ms, made_by, 'token', '', 'uses ' || uses_left FROM enrol_tokens WHERE made_ms >= ?"
            " UNION ALL SELECT added_ms, added_by, 'allow', hw_serial, '' FROM enrol_allow WHERE added_ms >= ?"
            " ORDER BY 1 LIMIT ?", (since_ms, since_ms, since_ms, limit)).fetchall()
        return [(int(a), str(b), str(c), str(d), str(e)) for a, b, c, d, e in rows]

    def approved_names(self) -> list[str]:
        if not self._present:
            return []
        return [str(r[0]) for r in self._conn.execute(
            "SELECT device FROM device_identities WHERE state = 'approved' ORDER BY device")]


class IdentityStore(Store):
    COMPONENT = COMPONENT
    MIGRATIONS = (_v1, _v2, _v3)
    SERVER_MIGRATIONS = server_migrations("agent.leader", COMPONENT)
    WHAT = "identity store"

    @classmethod
    def open(cls, path: str | Path | ServerUrl, *, synchronous: Synchronous = "FULL") -> IdentityStore:
        """On the leader's database: leader.db, or the fleet's PostgreSQL (`[leader] database`)."""
        return cls(cls.connect_target(path, synchronous=synchronous), path=path)

    @classmethod
    def open_readonly(cls, path: str | Path | ServerUrl) -> IdentityStore:
        return cls(cls.connect_reader(path), path=path)

    # -- reads ---------------------------------------------------------------------------------
    def get(self, device: str) -> Identity | None:
        with store_errors(self.WHAT):
            row = self._conn.execute(f"SELECT {_COLUMNS} FROM device_identities WHERE device = ?",
                                     (device,)).fetchone()
        return Identity(*row) if row is not None else None

    def listed(self, state: State | None = None) -> list[Identity]:
        where, args = ("WHERE state = ?", (state,)) if state else ("", ())
        with store_errors(self.WHAT):
            rows = self._conn.execute(f"SELECT {_COLUMNS} FROM device_identities {where} ORDER BY requested_ms, device",
                                      args).fetchall()
        return [Identity(*row) for row in rows]

    def request_pem(self, device: str) -> str:
        """The certificate request on record for `device` ("" when none)."""
        with store_errors(self.WHAT):
            row = self._conn.execute("SELECT csr FROM device_identities WHERE device = ?", (device,)).fetchone()
        return str(row[0]) if row is not None else ""

    def count(self, state: State) -> int:
        with store_errors(self.WHAT):
            return int(self._conn.execute("SELECT count(*) FROM device_identities WHERE state = ?",
                                          (state,)).fetchone()[0])

    def revoked_devices(self) -> set[str]:
        with store_errors(self.WHAT):
            rows = self._conn.execute("SELECT device FROM device_identities WHERE state = 'revoked'").fetchall()
        return {row[0] for row in rows}

    def revoked_certs(self, now_ms: int) -> list[tuple[int, int]]:
        """(serial, revoked at) of the revoked certificates not yet expired: the CRL's rows."""
        with store_errors(self.WHAT):
            rows = self._conn.execute("SELECT serial, revoked_ms FROM issued_certs WHERE revoked_ms IS NOT NULL"
                                      " AND not_after_ms > ? ORDER BY serial", (now_ms,)).fetchall()
        return [(int(serial, 16), int(at)) for serial, at in rows]


    def controls(self, *, after_id: int = 0, unapplied: bool = True) -> list[Control]:
        sql = ("SELECT id, action, device, reason, \"by\", at_ms, applied_ms, ok, outcome FROM identity_controls"
               " WHERE id > ?" + (" AND applied_ms IS NULL" if unapplied else "") + " ORDER BY id LIMIT 100")
        with store_errors(self.WHAT):
            rows = self._conn.execute(sql, (after_id,)).fetchall()
        return [Control(r[0], r[1], r[2], r[3], r[4], r[5], r[6], None if r[7] is None else bool(r[7]), r[8])
                for r in rows]

    def control(self, control_id: int) -> Control | None:
        found = self.controls(after_id=control_id - 1, unapplied=False)
        return found[0] if found and found[0].id == control_id else None

    # -- the CLI's and the console's writes ----------------------------------------------------
    def add_control(self, action: str, device: str, *, by: str, now_ms: int, reason: str = "") -> int:
        if action not in ACTIONS:
            raise IdentityError(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
        with self.atomic() as conn:
            row = conn.execute("INSERT INTO identity_controls (action, device, reason, \"by\", at_ms)"
                               " VALUES (?, ?, ?, ?, ?) RETURNING id",
                               (action, device, reason[:512], by, now_ms)).fetchone()
        return int(row[0])

    def add_token(self, token: str, *, uses: int, expires_ms: int, by: str, now_ms: int) -> None:
        with self.atomic() as conn:
            conn.execute("INSERT INTO enrol_tokens (digest, uses_left, expires_ms, made_by, made_ms)"
                         " VALUES (?, ?, ?, ?, ?)",
                         (token_digest(token), uses, expires_ms, by, now_ms))

    def allow_serials(self, serials: Sequence[str], *, by: str, now_ms: int) -> int:
        """Add serials to the allow-list; how many were new. `IdentityError` for an empty one or
        one longer than a request may carry."""
        for serial in serials:
            if not serial.strip() or serial != serial.strip() or len(serial) > MAX_SERIAL:
                raise IdentityError(f"serial {serial!r}: a hardware serial number is 1 to {MAX_SERIAL} characters"
                                    " with no space around it")
        with self.atomic() as conn:
            return sum(conn.execute("INSERT INTO enrol_allow (hw_serial, added_by, added_ms) VALUES (?, ?, ?)"
                                    " ON CONFLICT DO NOTHING", (serial, by, now_ms)).rowcount for serial in serials)

    # -- the leader's writes -------------------------------------------------------------------
    def take_token(self, token: str, now_ms: int) -> bool:
        """Spend one of a valid token's uses; False when it is unknown, used up or expired. One
        conditional update: two leaders asking at once never both spend the last use."""
        if not token:
            return False
        with self.atomic() as conn:
            return bool(conn.execute("UPDATE enrol_tokens SET uses_left = uses_left - 1"
                                     " WHERE digest = ? AND uses_left > 0 AND expires_ms > ?",
                                     (token_digest(token), now_ms)).rowcount)

    def take_allowed(self, hw_serial: str, device: str, now_ms: int) -> bool:
        """Bind the allow-list's entry for `hw_serial` to `device`; False when there is none or
        another device used it already (an entry approves one device, once)."""
        if not hw_serial:
            return False
        with self.atomic() as conn:
            return bool(conn.execute("UPDATE enrol_allow SET device = ?, used_ms = ? WHERE hw_serial = ?"
                                     " AND device IS NULL", (device, now_ms, hw_serial)).rowcount)

    def allow_used_by(self, hw_serial: str) -> str | None:
        """The device the allow-list's entry for `hw_serial` approved (None: unused or none)."""
        with store_errors(self.WHAT):
            row = self._conn.execute("SELECT device FROM enrol_allow WHERE hw_serial = ?", (hw_serial,)).fetchone()
        return None if row is None or row[0] is None else str(row[0])

    def vouched_for(self, *, serial: str, token: str, now_ms: int) -> bool:
        """Whether a request would be approved at once: a token with a use left, or an allow-list
        entry no device used yet (nothing is spent: `take_token`, `take_allowed` do)."""
        with store_errors(self.WHAT):
            if token and self._conn.execute("SELECT 1 FROM enrol_tokens WHERE digest = ? AND uses_left > 0"
                                            " AND expires_ms > ?", (token_digest(token), now_ms)).fetchone():
                return True
            return bool(serial) and self._conn.execute("SELECT 1 FROM enrol_allow WHERE hw_serial = ?"
                                                       " AND device IS NULL", (serial,)).fetchone() is not None

    def expire_pending(self, asked_before_ms: int) -> list[str]:
        """Forget the pending records whose device has not asked since `asked_before_ms`; their ids."""
        with self.atomic() as conn:
            rows = conn.execute("DELETE FROM device_identities WHERE state = 'pending' AND asked_ms < ?"
                                " RETURNING device", (asked_before_ms,)).fetchall()
        return sorted(str(r[0]) for r in rows)

    def record_request(self, *, device: str, fingerprint: str, csr: str, hw_serial: str, machine_id: str,
                       agent_version: str, claim: str, now_ms: int) -> Identity:
        """Record an enrolment request; the record as it stands after it. `IdentityError` when
        the device id is held by another key or revoked."""
        with self.atomic() as conn:
            found = self.get(device)
            if found is not None and found.state == "revoked":
                raise IdentityError(f"device {device} was revoked: it cannot enrol again")
            if found is not None and found.fingerprint != fingerprint and found.state != "rejected":
                held = "enrolled" if found.state == "approved" else "asked for"
                raise IdentityError(f"device {device} is {held} with"
                                    f" another key ({found.fingerprint[:16]}), not {fingerprint[:16]}")
            if found is None or found.state == "rejected" and found.fingerprint != fingerprint:
                # a new record (or one replacing a rejected one): everything else back to its default
                conn.execute("INSERT INTO device_identities (device, state, fingerprint, csr, hw_serial,"
                             " machine_id, agent_version, claim, requested_ms, asked_ms)"
                             " VALUES (?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (device) DO UPDATE SET"
                             " state = 'pending', fingerprint = excluded.fingerprint, csr = excluded.csr,"
                             " hw_serial = excluded.hw_serial, machine_id = excluded.machine_id,"
                             " agent_version = excluded.agent_version, claim = excluded.claim,"
                             " requested_ms = excluded.requested_ms, asked_ms = excluded.asked_ms, requests = 1,"
                             " cert = '', not_after_ms = 0, decided_ms = NULL, decided_by = '', reason = ''",
                             (device, fingerprint, csr, hw_serial, machine_id, agent_version, claim, now_ms, now_ms))
            else:
                conn.execute("UPDATE device_identities SET requests = requests + 1, csr = ?, hw_serial = ?,"
                             " machine_id = ?, agent_version = ?, claim = ?, asked_ms = ? WHERE device = ?",
                             (csr, hw_serial, machine_id, agent_version, claim, now_ms, device))
                if found.state == "approved" and found.not_after_ms <= now_ms:  # expired: enrol again
                    conn.execute("UPDATE device_identities SET state = 'pending', requested_ms = ?, decided_ms = NULL,"
                                 " reason = 'certificate expired' WHERE device = ?", (now_ms, device))
        record = self.get(device)
        assert record is not None
        return record

    def issued(self, device: str, *, cert: str, serial: int, not_after_ms: int, by: str, now_ms: int) -> None:
        """`device` approved (or renewed) with the certificate `cert`."""
        with self.atomic() as conn:
            changed = conn.execute("UPDATE device_identities SET state = 'approved', cert = ?, not_after_ms = ?,"
                                   " decided_ms = coalesce(CASE WHEN state = 'approved' THEN decided_ms END, ?),"
                                   " decided_by = CASE WHEN state = 'approved' THEN decided_by ELSE ? END, reason = ''"
                                   " WHERE device = ? AND state IN ('pending', 'approved')",
                                   (cert, not_after_ms, now_ms, by, device)).rowcount
            if not changed:
                raise StoreError(f"device {device} is not pending or approved")
            conn.execute("INSERT INTO issued_certs (serial, device, issued_ms, not_after_ms) VALUES (?, ?, ?, ?)",
                         (f"{serial:x}", device, now_ms, not_after_ms))

    def decide(self, device: str, state: Literal["rejected", "revoked"], *, by: str, reason: str, now_ms: int) -> None:
        with self.atomic() as conn:
            conn.execute("UPDATE device_identities SET state = ?, decided_ms = ?, decided_by = ?, reason = ?"
                         " WHERE device = ?", (state, now_ms, by, reason[:512], device))
            if state == "revoked":
                conn.execute("UPDATE issued_certs SET revoked_ms = ? WHERE device = ? AND revoked_ms IS NULL",
                             (now_ms, device))

    def claim(self, control_id: int, leader: str) -> bool:
        """Take a control for `leader` to apply; False when another leader took it first."""
        with self.atomic() as conn:
            return bool(conn.execute("UPDATE identity_controls SET claimed_by = ? WHERE id = ? AND claimed_by IS NULL",
                                     (leader or "leader", control_id)).rowcount)

    def fleet_authority(self, fingerprint: str) -> str:
        """Record `fingerprint` (of the CA certificate) as the fleet's, unless one is there; the
        fleet's, as it stands after."""
        with self.atomic() as conn:
            conn.execute("INSERT INTO identity_meta (key, value) VALUES ('ca_sha256', ?) ON CONFLICT DO NOTHING",
                         (fingerprint,))
            return str(conn.execute("SELECT value FROM identity_meta WHERE key = 'ca_sha256'").fetchone()[0])

    def applied(self, control_id: int, *, ok: bool, outcome: str, now_ms: int) -> None:
        with self.atomic() as conn:
            conn.execute("UPDATE identity_controls SET applied_ms = ?, ok = ?, outcome = ? WHERE id = ?",
                         (now_ms, int(ok), outcome[:512], control_id))


__all__ = ["ACTIONS", "COMPONENT", "Control", "Identity", "IdentityReads", "IdentityStore", "State", "reserved_reason",
           "token_digest"]
