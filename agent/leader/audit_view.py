"""The operators' audit trail: every rollout control (start, pause, resume, approve, next, cancel,
rollback), identity action (approve, reject, revoke, a batch token, an allowed serial),
configuration layer change (set, unset, order), acknowledged configuration attempt and remote
session, with who did it and when, read through the store that owns each record and merged in
time order.

`edge-agent audit` prints it or exports it as JSON lines; the console's Audit page shows the
newest. Each entry's `actor` is what its record says: the CLI's user (and who became it through
sudo) on its host, the console's operator and address, the operator on the leader's socket.
"""

from __future__ import annotations

import msgspec

from agent.leader.readonly import LeaderDb


class AuditEntry(msgspec.Struct, kw_only=True, frozen=True):
    at_ms: int
    actor: str
    area: str  # "rollout", "identity", "layers", "config", "session"
    action: str
    subject: str  # the rollout, the device, the target and key, the device and target, the session's device
    outcome: str = ""
    detail: str = ""


def audit_trail(db: LeaderDb, *, since_ms: int = 0, limit: int = 1000) -> list[AuditEntry]:
    """The operators' actions since `since_ms`, oldest first (at most `limit` of each kind)."""
    found: list[AuditEntry] = []
    for at, who, action, rollout, arg, outcome in db.rollouts.controls_since(since_ms, limit=limit):
        found.append(AuditEntry(at_ms=at, actor=who, area="rollout", action=action, subject=rollout,
                                outcome=outcome, detail=arg))
    for at, who, action, subject, outcome in db.identities.actions(since_ms=since_ms, limit=limit):
        found.append(AuditEntry(at_ms=at, actor=who, area="identity", action=action, subject=subject, outcome=outcome))
    for change in db.layers.changes(since_ms=since_ms, limit=limit):
        where = f"{change.target} {change.scope} {change.selector} {change.document} {change.key}".split()
        found.append(AuditEntry(at_ms=change.at_ms, actor=change.by, area="layers", action=change.action,
                                subject=" ".join(where), detail=change.value or ""))
    for ack in db.attempt_acks.since(since_ms, limit=limit):
        found.append(AuditEntry(at_ms=ack.at_ms, actor=ack.by, area="config", action="acknowledge",
                                subject=f"{ack.device_id} {ack.target}", outcome=ack.outcome,
                                detail=f"attempt {ack.attempt}, holding {ack.version or 'nothing'}"))
    for s in db.sessions.sessions(since_ms=since_ms, limit=limit):
        took = f", {(s.closed_ms - s.opened_ms) / 1000:.0f} s" if s.closed_ms is not None else ""
        found.append(AuditEntry(
            at_ms=s.opened_ms, actor=s.operator, area="session", action=s.op, subject=s.device_id,
            outcome=f"{s.state}{took}" + (f": {s.reason}" if s.reason else ""),
            detail=f"{s.target} ({s.bytes_to_device} bytes to the device, {s.bytes_from_device} from it"
                   + (f", exit {s.exit_code})" if s.exit_code is not None else ")") + f" [session {s.sid}]"))
    found.sort(key=lambda e: e.at_ms)
    return found


__all__ = ["AuditEntry", "audit_trail"]
