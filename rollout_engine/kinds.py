"""A rollout kind: what the engine asks of the thing a rollout installs.

The engine (spec, plan, gates, orchestrator, store, status) knows no kind. A kind is a module
that gives it two things, and one entry in the leader's table of kinds
(`agent.leader.rollout_kinds`) that names them:

    KindTraits   what the kind is, without a leader: its name in a spec (`kind = "..."`), which
                 spec fields apply to it, what its devices' cancels are called on the wire, and
                 how the CLI and the console describe one of its files (`describe`)
    RolloutKind  the kind on a running leader: it admits a release for a rollout, says which
                 version each device holds now, makes each device's offer, and (when it has a
                 compliance gate) tells which devices hold the release in sync

Its third part is on the device: a worker part that takes the kind's offers and cancels and sends
`rollout_engine.messages.RolloutReport`s (the firmware updater, the configuration targets).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.core.errors import ConfigError
from rollout_engine.plan import DeviceInfo
from rollout_engine.spec import RolloutSpec
from rollout_engine.store import DeviceRow, RolloutRow


@dataclass(frozen=True, slots=True)
class Described:
    """A kind's file as the CLI and the console show it (read, not yet verified: the leader
    verifies the whole file when a rollout admits it)."""

    name: str  # what it is called (a firmware's name, a config release's target)
    version: str
    size: int  # bytes a device takes in
    what: str  # in a few words: "firmware: 12 chunks", "config release for target app: 2 documents"
    installs: str  # what `rollout start` says a rollout of it installs: "version 1.1.0"
    rollback: bool = False  # signed as a rollback: it may go below what a device holds
    rollback_from: tuple[str, ...] = ()  # the versions a rollback replaces
    lane: str = ""  # the part of a device a rollout of it holds (`KindTraits.lane`)


@dataclass(frozen=True, slots=True)
class KindTraits:
    """What a kind is, known without a leader."""

    name: str  # the spec's `kind`
    installs: str  # what a rollout of it installs, in a few words ("firmware", "config release")
    cancel_kind: str  # the wire kind its devices take a `RolloutCancel` under
    describe: Callable[[Path], Described]  # one of its files; a `RolloutError` says why it cannot
    file_suffixes: tuple[str, ...] = ()  # its files in the leader's store (the console lists them)
    download_only: bool = False  # `rollout.download_only` applies: download now, install on approval
    compliance: bool = False  # `gates.min_compliance_pct` applies: the kind tells a device in sync
    skips_held: bool = False  # a device already holding the version is not targeted
    report_kinds: tuple[str, ...] = ()  # older wire names its devices' reports come under
    # what a start goes on despite, against the targets' registry records (a downgrade for some);
    # a `RolloutError` when the rollout could only fail
    check_targets: Callable[[Described, str, Sequence[DeviceInfo]], list[str]] | None = None
    # the part of a device a release holds (an application, a config target): two unfinished
    # rollouts of the kind hold a device together when their lanes differ; None: the whole kind
    lane: Callable[[bytes], str] | None = None
    # the firmware image a rollout of it serves (its chunks over MQTT, the artifact server): the
    # leader's copy and its signed manifest, from what the rollout stores; None: it serves none
    image: Callable[[RolloutRow], tuple[str, bytes] | None] | None = None

    def image_of(self, r: RolloutRow) -> tuple[str, bytes] | None:
        return self.image(r) if self.image is not None else None

    def lane_of(self, release: bytes) -> str:
        return self.lane(release) if self.lane is not None else ""

    def holds_with(self, lane: str) -> Callable[[RolloutRow], bool]:
        """Whether a rollout holds its devices against a new one of this kind in `lane`."""
        return lambda r: r.spec.rollout.kind == self.name and self.lane_of(r.signed_manifest) == lane

    def check_spec(self, spec: RolloutSpec, *, source: str) -> None:
        """The spec's fields that apply to other kinds only: a `ConfigError` naming the first."""
        if spec.rollout.download_only and not self.download_only:
            raise ConfigError(source, "rollout.download_only",
                              f'a {self.installs} rollout applies at once (kind = "{self.name}")')
        if spec.gates.min_compliance_pct and not self.compliance:
            raise ConfigError(source, "gates.min_compliance_pct",
                              f'a {self.installs} rollout has no compliance gate (kind = "{self.name}")')


@dataclass(frozen=True, slots=True)
class Admitted:
    """A release a kind took for a rollout."""

    version: str
    artifact: str  # the leader's copy, what it serves and keeps
    release: bytes  # what the rollout stores and the kind offers from (a signed manifest, a config release)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message for one device, for the leader's outbox."""

    device: str
    kind: str  # the wire kind
    payload: bytes
    key: str  # the outbox key: a newer message under it replaces one not yet sent


@dataclass(frozen=True, slots=True)
class OfferContext:
    """What the leader adds to every offer of a rollout."""

    mirrors: tuple[str, ...]  # HTTP(S) mirrors: the spec's, then the leader's own artifact server
    trust: bytes  # the fleet's trust document the leader holds ("" when it pins a key)
    approved_waves: frozenset[int]  # waves of a download-only rollout whose install was approved


class RolloutKind(Protocol):
    """A kind on a running leader."""

    @property
    def traits(self) -> KindTraits: ...

    def admit(self, artifact: str, *, undone: RolloutRow | None) -> Admitted:
        """Check the release at `artifact` and keep the leader's copy; `undone`: the rollout a
        rollback undoes. A `RolloutError` says why not."""

    def held(self, release: bytes, devices: Sequence[DeviceInfo]) -> dict[str, str]:
        """device -> the version of what `release` installs it holds now (as it last said)."""

    def offers(self, r: RolloutRow, devices: Sequence[DeviceRow], context: OfferContext) -> list[Outgoing]:
        """Each device's offer of rollout `r`."""

    def in_sync(self, release: bytes, devices: Sequence[str]) -> set[str]:
        """Of `devices`, those that hold `release` as it was offered, unchanged (asked only of a
        kind with `traits.compliance`)."""


__all__ = ["Admitted", "Described", "KindTraits", "OfferContext", "Outgoing", "RolloutKind"]
