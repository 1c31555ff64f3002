"""Controls of a running rollout, as an operator asks for them (the CLI, the console): checked
here against the rollout's state, then queued in `rollout_controls` for the leader's
orchestrator, which applies them on its next tick and records the result."""

from __future__ import annotations

from pathlib import Path

from agent.core.errors import ConfigError, RolloutError
from rollout_engine.store import RolloutStore

ACTIONS = ("pause", "resume", "cancel", "next", "approve", "rollback")


def allowed_actions(store: RolloutStore, rollout_id: str) -> list[str]:
    """The controls that apply to the rollout now (what a console offers)."""
    r = store.find(rollout_id)
    if r is None:
        return []
    out = []
    for action in ACTIONS:
        try:
            _check(store, rollout_id, action, None)
        except (RolloutError, ConfigError):
            continue
        out.append(action)
    return out


def request_control(store: RolloutStore, rollout_id: str, action: str, artifact: str | None = None, *,
                    actor: str = "") -> int:
    """Queue `action` for the leader on behalf of `actor` (the audit record); the control's id.
    A control that does not apply now is a `RolloutError` (or `ConfigError` for a rollback
    artifact that is not there) saying why."""
    arg = _check(store, rollout_id, action, artifact)
    return store.add_control(rollout_id, action, arg, actor=actor)


def _check(store: RolloutStore, rollout_id: str, action: str, artifact: str | None) -> str:
    if action not in ACTIONS:
        raise RolloutError(f"unknown control {action!r} (one of {', '.join(ACTIONS)})")
    r = store.find(rollout_id)
    if r is None:
        raise RolloutError(f"no rollout {rollout_id!r} (see `edge-agent rollout list`)")
    if action != "rollback" and not r.active:
        raise RolloutError(f"rollout {r.id} is {r.state}; `{action}` applies to a running or paused rollout")
    if action == "pause" and r.state != "running":
        raise RolloutError(f"rollout {r.id} is {r.state}, not running")
    if action == "resume" and r.state != "paused":
        raise RolloutError(f"rollout {r.id} is {r.state}, not paused")
    if action == "approve":
        wave = store.wave(r.id, r.current_wave)
        if wave is None or wave.state != "awaiting_approval":
            raise RolloutError(f"rollout {r.id}: wave {r.current_wave + 1} is {wave.state if wave else '?'}, "
                               "not awaiting approval")
    if action == "next" and r.current_wave + 1 >= r.wave_count:
        raise RolloutError(f"rollout {r.id}: wave {r.current_wave + 1} is the last wave")
    arg = ""
    if action == "rollback":
        arg = str(Path(artifact).resolve()) if artifact else ""
        if arg and not Path(arg).is_file():
            raise ConfigError(str(artifact), None, "artifact not found")
        if not arg and not r.spec.rollout.rollback_artifact:
            raise RolloutError(f"rollout {r.id} names no rollback_artifact; give --artifact PREVIOUS.eafw")
    return arg


__all__ = ["ACTIONS", "allowed_actions", "request_control"]
