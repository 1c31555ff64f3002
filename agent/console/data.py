"""What each console page shows, read from the leader's database and its outbox."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.console.charts import Series, online_series, rollout_series
from agent.core.clock import SystemClock
from agent.core.errors import ConfigError, EdgeAgentError, RolloutError
from agent.core.sql import StoreTarget
from agent.leader.fleet_view import DeviceDetail, DeviceFilter, DevicePage, device_detail, list_devices
from agent.leader.identities import Control, Identity
from agent.leader.readonly import open_leader_db
from agent.leader.reject_view import RejectCount, RejectRow
from agent.leader.status import FleetStatus, fleet_status
from config_rollout.attempt_acks import AttemptAck
from rollout_engine.kinds import Described
from rollout_engine.spec import DEFAULT_KIND

PAGE = 50


@dataclass(frozen=True, slots=True)
class Fleet:
    summary: FleetStatus
    page: DevicePage
    filter: DeviceFilter
    online: Series  # the devices online over the last FLEET_CHART_S


FLEET_CHART_S = 86_400  # the fleet chart's span


def fleet(db: StoreTarget, flt: DeviceFilter) -> Fleet:
    now_ms = SystemClock().now_ms()
    with open_leader_db(db) as leader:
        return Fleet(fleet_status(leader, now_ms, stale_limit=0), list_devices(leader, flt), flt,
                     online_series(leader.registry.online_history(now_ms - FLEET_CHART_S * 1000)))


def device(db: StoreTarget, device_id: str) -> DeviceDetail | None:
    with open_leader_db(db) as leader:
        return device_detail(leader, device_id, rejects=20)


@dataclass(frozen=True, slots=True)
class Rejects:
    counts: list[RejectCount]
    rows: list[RejectRow]


def rejects(db: StoreTarget, device_id: str | None) -> Rejects:
    with open_leader_db(db) as leader:
        return Rejects(leader.rejects.counts(device=device_id), leader.rejects.newest(device=device_id, limit=100))


def audit(db: StoreTarget, *, days: float = 30.0, shown: int = 500) -> list[Any]:
    """The operators' newest actions (the audit trail), newest first."""
    import time

    from agent.leader.audit_view import audit_trail

    with open_leader_db(db) as leader:
        return audit_trail(leader, since_ms=int((time.time() - days * 86_400) * 1000), limit=shown)[::-1][:shown]


def _has_rollouts(db: StoreTarget) -> bool:
    with open_leader_db(db) as leader:
        return leader.rollouts.present


def rollouts(db: StoreTarget) -> list[dict[str, Any]]:
    """Every rollout, newest first, as `rollout status --json` describes it."""
    if not _has_rollouts(db):
        return []
    from rollout_engine.status import describe
    from rollout_engine.store import RolloutStore

    with RolloutStore.open_readonly(db, clock=SystemClock()) as store:
        return [describe(store, r.id) for r in reversed(store.rollouts())]


DEVICES_SHOWN = 500  # devices of one rollout listed on its page


@dataclass(frozen=True)
class RolloutPage:
    described: dict[str, Any]  # as `rollout status --json` describes it
    actions: list[str]  # the controls that apply now
    devices: list[Any]  # its devices in `state` (all: ""), by wave and id, at most DEVICES_SHOWN
    more: bool  # more matched than are listed
    states: list[str]  # the states its devices are in
    chart: Series  # its devices by kind over time
    serves_image: bool = True  # its kind downloads an image (firmware): the download columns mean something
    spec_rollback: str = ""  # the rollback artifact its spec names (the file's name; "": none)


def rollout(db: StoreTarget, rollout_id: str, *, state: str = "") -> RolloutPage | None:
    """A rollout's page: its description, the controls that apply now, its devices."""
    if not _has_rollouts(db):
        return None
    from agent.leader.rollout_kinds import serves_image
    from rollout_engine.controls import allowed_actions
    from rollout_engine.status import describe
    from rollout_engine.store import RolloutStore

    with RolloutStore.open_readonly(db, clock=SystemClock()) as store:
        row = store.find(rollout_id)
        if row is None:
            return None
        members = store.devices(rollout_id)
        chosen = sorted((d for d in members if not state or d.state == state), key=lambda d: (d.wave, d.device_id))
        described = describe(store, rollout_id)
        end_ms = described["finished_ms"] or SystemClock().now_ms()
        chart = rollout_series(described["created_ms"], end_ms, len(members), store.state_changes(rollout_id),
                               now={d.device_id: d.state for d in members})
        return RolloutPage(described, allowed_actions(store, rollout_id), chosen[:DEVICES_SHOWN],
                           len(chosen) > DEVICES_SHOWN, sorted({d.state for d in members}), chart,
                           serves_image(row.spec.rollout.kind), _named_rollback(row.spec))


@dataclass(frozen=True)
class ArtifactChoice:
    """One file of the leader's store, as the console lists it (parsed, not yet trusted: the
    leader checks it whole when a rollout admits it)."""

    file: str  # its name in the leader's store (what the form sends back: never a path)
    path: Path
    manifest: Described  # what its kind reads of it
    kind: str  # the kind that installs it (`agent.leader.rollout_kinds`)

    @property
    def rollback(self) -> bool:
        return self.manifest.rollback

    @property
    def size(self) -> int:
        return self.manifest.size

    @property
    def what(self) -> str:
        """What it is, in a few words."""
        return self.manifest.what

    @property
    def tagged(self) -> bool:
        """Its kind is said beside it (any but the default's)."""
        return self.kind != DEFAULT_KIND


def artifacts(directory: Path) -> list[ArtifactChoice]:
    """The leader's store: the files of every kind, by name, newest version first; a file that
    does not parse is left out."""
    from agent.leader.rollout_kinds import ROLLOUT_KINDS
    from rollout_engine.version import Version

    found = []
    for name, entry in ROLLOUT_KINDS.items() if directory.is_dir() else ():
        for suffix in entry.traits.file_suffixes:
            for path in sorted(directory.glob(f"*{suffix}")):
                try:
                    found.append(ArtifactChoice(path.name, path, entry.traits.describe(path), name))
                except EdgeAgentError:
                    continue

    def order(a: ArtifactChoice) -> tuple[str, str, Version]:
        try:
            version = Version.parse(a.manifest.version)
        except EdgeAgentError:
            version = Version.parse("0.0.0")
        return (a.kind, a.manifest.name, version)

    return sorted(found, key=order, reverse=True)


def file_suffixes() -> str:
    """What the upload takes: every kind's files (".eafw,.eacfg,.eaapp")."""
    from agent.leader.rollout_kinds import ROLLOUT_KINDS

    return ",".join(suffix for entry in ROLLOUT_KINDS.values() for suffix in entry.traits.file_suffixes)


def start(db: StoreTarget, rollout_id: str, start_control: str, *, actor: str = "") -> int:
    """Queue a rollout's start exactly as `edge-agent rollout start` does; the control's id."""
    from rollout_engine.store import RolloutStore

    with RolloutStore.open(db, clock=SystemClock()) as store:
        if store.get(rollout_id) is not None:
            raise RolloutError(f"rollout {rollout_id!r} exists already")
        return store.add_control(rollout_id, "start", start_control, actor=actor)


def start_control(db: StoreTarget, rollout_id: str) -> Any:
    """The newest start control for `rollout_id` (a `ControlRow`), or None."""
    if not _has_rollouts(db):
        return None
    from rollout_engine.store import RolloutStore

    with RolloutStore.open_readonly(db, clock=SystemClock()) as store:
        starts = [c for c in store.controls(rollout_id) if c.action == "start"]
        return starts[-1] if starts else None


def holders(db: StoreTarget, devices: list[str], *, kind: str, lane: str) -> dict[str, tuple[str, str]]:
    """The devices of `devices` an unfinished rollout of `kind` in `lane` holds (a start would be
    refused for them): device -> (its rollout, its state there)."""
    from agent.leader.rollout_kinds import traits_of
    from rollout_engine.store import RolloutStore

    among = traits_of(kind, source="the form").holds_with(lane)
    with RolloutStore.open_readonly(db, clock=SystemClock()) as store:
        return store.holders(devices, among=among)


def control(db: StoreTarget, rollout_id: str, action: str, *, artifact: Path | None = None, actor: str = "") -> int:
    """Queue a control exactly as `edge-agent rollout ACTION ID [--artifact]` does; its id.
    Only into existing rollout tables."""
    from rollout_engine.controls import request_control
    from rollout_engine.store import RolloutStore

    with RolloutStore.open_existing(db, clock=SystemClock()) as store:
        return request_control(store, rollout_id, action, str(artifact) if artifact is not None else None,
                               actor=actor)


def control_pending(db: StoreTarget, control_id: int) -> bool:
    """Whether rollout control `control_id` is queued and not applied yet (False once the leader
    applied or refused it, or when there is no such control)."""
    if not _has_rollouts(db):
        return False
    from rollout_engine.store import RolloutStore

    with RolloutStore.open_readonly(db, clock=SystemClock()) as store:
        found = store.control(control_id)
        return found is not None and found.applied_ms is None


@dataclass(frozen=True)
class ConfigLayers:
    """The configuration layers page: each target's groups in their order, and its values."""

    orders: dict[str, list[str]]
    rows: list[Any]  # `config_rollout.layer_store.LayerRow`s in force, groups in order, then devices


def config_layers(db: StoreTarget) -> ConfigLayers:
    import time

    with open_leader_db(db) as leader:
        reads = leader.layers
        rows = reads.rows(now_ms=int(time.time() * 1000))
        return ConfigLayers({t: reads.group_order(t) for t in sorted({r.target for r in rows})}, rows)


@dataclass(frozen=True)
class Identities:
    on: bool  # the leader keeps device identities ([identity] in its config)
    rows: list[Identity]
    outcomes: list[Control]  # the newest decisions, with what the leader made of them


def identities(db: StoreTarget) -> Identities:
    """Every device identity on record, pending first, and the newest decisions."""
    from agent.core.errors import StoreError
    from agent.leader.identities import IdentityStore

    try:
        store = IdentityStore.open_readonly(db)
    except StoreError:
        return Identities(False, [], [])
    with store:
        rows = store.listed()
        recent = store.controls(unapplied=False)[-10:]
    order = {"pending": 0, "approved": 1, "rejected": 2, "revoked": 3}
    return Identities(True, sorted(rows, key=lambda r: (order[r.state], r.device)), list(reversed(recent)))


def identity_control(db: StoreTarget, form: dict[str, str], actor: str) -> int:
    """Approve, reject or revoke one device from the identities page, as `edge-agent devices`
    does: a control the running leader applies (it alone holds the CA's key)."""
    import time

    from agent.core.errors import IdentityError
    from agent.leader.identities import ACTIONS, IdentityStore

    action, device = form.get("action", ""), form.get("device", "").strip()
    if action not in ACTIONS:
        raise ConfigError("action", None, f"one of {', '.join(ACTIONS)}")
    with IdentityStore.open_readonly(db) as reads:
        found = reads.get(device)
    if found is None:
        raise IdentityError(f"no enrolment of {device!r}")
    with IdentityStore.open(db) as store:
        return store.add_control(action, device, by=actor, now_ms=int(time.time() * 1000),
                                 reason=form.get("reason", "")[:512])


def change_layer(db: StoreTarget, form: dict[str, str], actor: str) -> str:
    """Set or unset one value from the layers page's form, as `edge-agent config layer set|unset`
    does (the same checks: a `ConfigError` names the field); what was done, in words."""
    import json
    import time

    from config_rollout.layer_store import LayerEdit, LayerStore

    unset = form.get("action") == "unset"
    now_ms = int(time.time() * 1000)
    edit = LayerEdit.checked(target=form.get("target", ""), scope=form.get("scope", ""),
                             selector=form.get("selector", "").strip(), document=form.get("document", "").strip(),
                             key=form.get("key", "").strip(), value_text=None if unset else form.get("value", ""),
                             expires_text=None if unset else form.get("expires", "").strip(), now_ms=now_ms)
    with open_leader_db(db):  # (a leader's database, or a StoreError: nothing is created elsewhere)
        pass
    with LayerStore.open(db) as store:
        if unset:
            gone = store.unset(edit.target, edit.scope, edit.selector, edit.document, edit.key, by=actor,
                               now_ms=now_ms)
            return (f"{edit.target} {edit.scope} {edit.selector} {edit.document}: unset {edit.key}" if gone else
                    f"{edit.target} {edit.scope} {edit.selector} {edit.document}: no value {edit.key} to unset")
        store.set_value(edit.target, edit.scope, edit.selector, edit.document, edit.key, edit.value, set_by=actor,
                        now_ms=now_ms, expires_ms=edit.expires_ms)
    return (f"{edit.target} {edit.scope} {edit.selector} {edit.document}: {edit.key} = {json.dumps(edit.value)}"
            " (offered with the target's next config rollout)")


def acknowledge(db: StoreTarget, target: str, device: str | None, actor: str) -> list[AttemptAck]:
    """Acknowledge the open attempts at `target` (of `device`, or of every device with one), as
    `edge-agent config acknowledge` does; a `ConfigError` says why nothing was."""
    import re
    import time

    from agent.leader.attempts import acknowledge_attempts
    from config_rollout.layer_store import TARGET

    if not re.match(TARGET, target):
        raise ConfigError("target", None, f"{target[:64]!r} is not a configuration target's name")
    done = acknowledge_attempts(db, target, None if device is None else [device], by=actor,
                                now_ms=int(time.time() * 1000), field="device")
    if not done:
        raise ConfigError("target", None, f"{target}: no attempt to acknowledge (each device's last one committed"
                          " or was acknowledged already)")
    return done


def rollback_choices(directory: Path, version: str) -> list[ArtifactChoice]:
    """The store's artifacts signed as a rollback of `version` (naming it among those they replace)."""
    return [a for a in artifacts(directory) if a.rollback and version in a.manifest.rollback_from]


def spec_rollback(db: StoreTarget, rollout_id: str) -> str:
    """The rollback artifact a rollout's spec names (the file's name; "" when it names none: a
    rollout the console started, or a spec without one)."""
    if not _has_rollouts(db):
        return ""
    from rollout_engine.store import RolloutStore

    with RolloutStore.open_readonly(db, clock=SystemClock()) as store:
        found = store.find(rollout_id)
        return _named_rollback(found.spec) if found is not None else ""


def _named_rollback(spec: Any) -> str:
    return Path(spec.rollout.rollback_artifact).name if spec.rollout.rollback_artifact else ""


def rollout_version(db: StoreTarget, rollout_id: str) -> str | None:
    """The version a rollout installs (None: no such rollout)."""
    if not _has_rollouts(db):
        return None
    from rollout_engine.store import RolloutStore

    with RolloutStore.open_readonly(db, clock=SystemClock()) as store:
        found = store.find(rollout_id)
        return found.version if found is not None else None


def dead_letters(outbox: Path) -> tuple[int, list[dict[str, Any]]]:
    """(how many, the oldest 100) of the dead letters in the leader's outbox, as `dlq list
    --json` shows them."""
    if not outbox.exists():
        return 0, []
    from agent.outbox.commands import read_dead_letters

    return read_dead_letters(outbox, limit=100)


__all__ = ["DEVICES_SHOWN", "FLEET_CHART_S", "PAGE", "ArtifactChoice", "Fleet", "Rejects", "RolloutPage",
           "acknowledge", "artifacts", "control", "dead_letters", "device", "file_suffixes", "fleet", "holders",
           "rejects", "rollback_choices", "rollout", "rollout_version", "rollouts", "start", "start_control"]
