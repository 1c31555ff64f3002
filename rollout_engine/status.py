"""A rollout's state as plain data: the `rollout status` screen, `--json`, the simulator's report.

Waves are stored by index from 0; every text a user reads numbers them from 1 (`wave_number`,
`wave_label`), as `rollout list` does: the canary, when the spec has one, is wave 1.
"""

from __future__ import annotations

from typing import Any

from agent.core.errors import RolloutError
from rollout_engine.store import IN_PROGRESS, TERMINAL, RolloutStore


def wave_number(idx: int) -> int:
    """The number users see for the wave stored at `idx`."""
    return idx + 1


def wave_label(idx: int, *, canary: bool = False) -> str:
    """`wave 3`, or `wave 1 (canary)` for a canary wave."""
    return f"wave {idx + 1}" + (" (canary)" if canary else "")


def describe(store: RolloutStore, rollout_id: str) -> dict[str, Any]:
    """A rollout's state as plain data: the one source of every view of it (`rollout status`
    and its `--watch`, `rollout list`, `/metrics`, the console, the simulator's report). The
    per-state totals are the sums of the per-wave counts, from one query."""
    r = store.find(rollout_id)
    if r is None:
        raise RolloutError(f"no rollout {rollout_id!r}")
    counts = store.counts(r.id)
    progress = store.progress(r.id)
    waves = []
    for w in store.waves(r.id):
        states = counts.get(w.idx, {})
        waves.append(
            {
                "index": w.idx,
                "number": wave_number(w.idx),
                "canary": w.idx == 0 and r.spec.waves.canary > 0,
                "size": w.size,
                "state": w.state,
                "succeeded": states.get("succeeded", 0),
                "finished": sum(n for s, n in states.items() if s in TERMINAL),
                "in_progress": sum(n for s, n in states.items() if s in IN_PROGRESS),
                "counts": dict(sorted(states.items())),
                "download": progress.get(w.idx, {"bytes_done": 0, "bytes_total": 0, "rate_bytes_per_s": 0.0,
                                                 "progress_reports": 0, "bytes_to_fetch": 0, "bytes_fetched": 0}),
                "started_ms": w.started_ms,
                "finished_ms": w.finished_ms,
                "detail": w.detail,
            }
        )
    totals: dict[str, int] = {}
    for states in counts.values():
        for state, n in states.items():
            totals[state] = totals.get(state, 0) + n
    offers = store.offers(r.id)
    # a canceled or aborted rollout: the devices that were updating and have not said they stopped
    cancel_pending = 0 if r.active else sum(n for s, n in totals.items() if s in IN_PROGRESS)
    after = 0
    if r.state == "aborted" and r.finished_ms is not None:
        after = len({d for d, at, _ in offers if at > r.finished_ms})
    return {
        "id": r.id,
        "name": r.name,
        "state": r.state,
        "version": r.version,
        "from_versions": {v or "?": n for v, n in store.from_versions(r.id).items()},
        "artifact": r.artifact,
        "current_wave": r.current_wave,
        "current_wave_number": wave_number(r.current_wave),
        "wave_count": r.wave_count,
        "detail": r.detail,
        "rollback_of": r.rollback_of,
        "created_ms": r.created_ms,
        "updated_ms": r.updated_ms,
        "finished_ms": r.finished_ms,
        "devices": sum(totals.values()),
        "counts": dict(sorted(totals.items())),
        "offers": len(offers),
        "devices_offered_after_abort": after,
        "cancel_pending": cancel_pending,
        "progress_reports": sum(int(p["progress_reports"]) for p in progress.values()),
        "serving": store.serving(r.id),
        "waves": waves,
        "audit": [{"control": c.id, "action": c.action, "actor": c.actor, "asked_ms": c.created_ms,
                   "applied_ms": c.applied_ms, "outcome": c.outcome, "result": c.result} for c in store.controls(r.id)],
    }


__all__ = ["describe", "wave_label", "wave_number"]
