"""Pruning the per-device rows of finished rollouts (`RolloutStore.prune_finished`).

What goes: a finished rollout's `rollout_devices`, `rollout_offers` and applied
`rollout_controls` rows, once it finished longer ago than the retention. These grow by about one
row per device per rollout and only serve the live orchestration and the recent audit trail.

What stays, and why: the rollout's summary row in `rollouts` (state, spec, version, detail,
created/finished times) and its `rollout_waves` rows (a few per rollout, with each wave's size,
state and times). Nothing else in the store holds a rollout's history: the per-device rows are
the only copy of which device ended in which state, so dropping the summary too would make
`rollout list` forget the rollout. Once pruned, `rollout status` still shows the summary and the
waves (their sizes and states) and, appended to its detail when the pruning starts, the final
count of devices per state; per-wave counts, offers and `--devices` are gone, and a rollback of the pruned
rollout is refused ("no device took version ..."): it no longer knows which devices took it.

Never touched: a running or paused rollout, a finished one with a device still mid-update (a
stopped rollout lets devices that were installing finish and report), and a control not applied
yet (the running leader answers it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from firmware_rollout.rollout_store import RolloutStore

#: The rollout states after which nothing is offered again (`ROLLOUT_STATES` minus the active ones).
FINISHED: Final[tuple[str, ...]] = ("succeeded", "aborted", "canceled")

#: Marks a rollout whose per-device rows were pruned, in its `detail`.
PRUNED_NOTE: Final = "device rows pruned"

_IN_PROGRESS = "('notified', 'downloading', 'installing', 'rebooting', 'verifying')"

# (table, the key selecting one rollout's prunable rows, the column that names a row)
_TABLES: Final[tuple[tuple[str, str, str], ...]] = (
    ("rollout_offers", "rollout_id = ?", "rowid"),
    ("rollout_controls", "rollout_id = ? AND applied_ms IS NOT NULL", "id"),
    ("rollout_devices", "rollout_id = ?", "device_id"),
)


def prunable_rollouts(store: RolloutStore, cutoff_ms: int) -> list[str]:
    """Ids of the rollouts that finished before `cutoff_ms` and still hold prunable rows, oldest first."""
    finished = ", ".join("?" * len(FINISHED))
    has_rows = " OR ".join(f"EXISTS (SELECT 1 FROM {t} WHERE {where.replace('?', 'r.id')})" for t, where, _ in _TABLES)
    rows = store._q(
        f"SELECT r.id FROM rollouts r WHERE r.state IN ({finished})"
        " AND COALESCE(r.finished_ms, r.updated_ms) < ?"
        f" AND NOT EXISTS (SELECT 1 FROM rollout_devices d WHERE d.rollout_id = r.id AND d.state IN {_IN_PROGRESS})"
        f" AND ({has_rows}) ORDER BY COALESCE(r.finished_ms, r.updated_ms), r.seq",
        (*FINISHED, cutoff_ms),
    )
    return [str(r[0]) for r in rows]


def _note_totals(store: RolloutStore, rollout_id: str) -> None:
    """Append the final per-state device counts to the rollout's detail before its device rows
    go (once: the first batch that reaches the rollout), so its status still tells how it ended."""
    detail = store._q("SELECT detail FROM rollouts WHERE id = ?", (rollout_id,))[0][0]
    totals = store.totals(rollout_id)
    if PRUNED_NOTE in detail or not totals:
        return
    counts = ", ".join(f"{state} {n}" for state, n in sorted(totals.items()))
    note = f"{PRUNED_NOTE}: {sum(totals.values())} devices ({counts})"
    store._q("UPDATE rollouts SET detail = ? WHERE id = ?", (f"{detail}; {note}" if detail else note, rollout_id))


def prune_finished(store: RolloutStore, cutoff_ms: int, limit: int | None) -> int:
    """Delete at most `limit` rows (None: all) of rollouts finished before `cutoff_ms`, in one
    transaction, oldest rollout first; how many were deleted."""
    budget = -1 if limit is None else max(0, limit)
    if budget == 0:
        return 0
    candidates = prunable_rollouts(store, cutoff_ms)
    if not candidates:
        return 0  # nothing due: no write transaction
    removed = 0
    with store.atomic():
        for rollout_id in candidates:
            _note_totals(store, rollout_id)
            for table, where, key in _TABLES:
                left = -1 if budget < 0 else budget - removed
                if left == 0:
                    return removed
                removed += store._delete(
                    f"DELETE FROM {table} WHERE rollout_id = ? AND {key} IN"
                    f" (SELECT {key} FROM {table} WHERE {where} LIMIT ?)",
                    (rollout_id, rollout_id, left),
                )
    return removed


__all__ = ["FINISHED", "PRUNED_NOTE", "prunable_rollouts", "prune_finished"]
