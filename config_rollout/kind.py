"""Configuration as a rollout kind (`rollout_engine.kinds`): a signed config release, checked
and kept by the leader, offered inline as a `ConfigOffer` with the layer values the leader renders
for each device, canceled as `config.cancel`, applied commit-confirmed by the device's target of
the release's name. Its compliance gate reads the targets' state from the devices' heartbeats."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from agent.core.codec import encode
from agent.core.errors import RolloutError
from agent.core.files import atomic_write
from agent.protocol import ConfigState
from config_rollout.errors import ConfigReleaseError
from config_rollout.layers import LayerValue
from config_rollout.messages import KIND_CONFIG_CANCEL, KIND_CONFIG_OFFER, OFFER_RELEASE_MAX, ConfigOffer
from config_rollout.release import MAGIC, MANIFEST_MAX, SUFFIX, ConfigRelease, parse_release, peek_release
from rollout_engine.keys import Verifier
from rollout_engine.kinds import Admitted, Described, KindTraits, OfferContext, Outgoing
from rollout_engine.plan import DeviceInfo
from rollout_engine.store import DeviceRow, RolloutRow
from rollout_engine.version import Version

HEAD_MAX = len(MAGIC) + 4 + MANIFEST_MAX  # what `describe` reads of a file: the manifest at most


def describe_release(path: Path) -> Described:
    """A config release's manifest, read (not verified)."""
    try:
        with path.open("rb") as f:
            m = peek_release(f.read(HEAD_MAX))
    except (ConfigReleaseError, OSError) as exc:
        raise RolloutError(f"config release {path}: {getattr(exc, 'strerror', None) or exc}") from None
    n = len(m.documents)
    return Described(name=m.name, version=m.version, size=sum(d.size for d in m.documents), lane=m.name,
                     what=f"config release for target {m.name}: {n} document{'s' if n != 1 else ''}",
                     installs=f"config release {m.name} {m.version}")


def release_lane(release: bytes) -> str:
    """A rollout of a config release holds its target on a device (another target's may run beside)."""
    try:
        return peek_release(release).name
    except ConfigReleaseError:
        return ""


CONFIG = KindTraits(name="config", installs="config release", cancel_kind=KIND_CONFIG_CANCEL,
                    describe=describe_release, file_suffixes=(SUFFIX,), compliance=True, lane=release_lane)


def keep_release(keys: Verifier | None, directory: Path, source: str) -> tuple[ConfigRelease, Path, bytes]:
    """A config release checked whole as a device checks it, small enough to ride in one offer,
    kept in `directory` by its id: (the release, the copy, its bytes). A `RolloutError` says why not."""
    if keys is None:
        raise RolloutError(f"cannot check config release {source}: the leader's config has no [firmware]"
                           " public_key or trust_root (the fleet's key, as the devices pin it)")
    try:
        with open(source, "rb") as f:
            data = f.read(OFFER_RELEASE_MAX + 1)
    except OSError as exc:
        raise RolloutError(f"config release {source}: {exc.strerror or exc}") from None
    if len(data) > OFFER_RELEASE_MAX:
        raise RolloutError(f"config release {source}: over {OFFER_RELEASE_MAX // 1024} KiB, too large to offer")
    try:
        release = parse_release(data, keys, source=source, max_document_bytes=OFFER_RELEASE_MAX)
    except ConfigReleaseError as exc:
        raise RolloutError(str(exc)) from None
    kept = directory / f"{release.release_id[:32]}{SUFFIX}"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o750)
        atomic_write(kept, data, mode=0o640)
    except OSError as exc:
        raise RolloutError(f"config release {source}: cannot keep it as {kept}: {exc.strerror or exc}") from None
    return release, kept, data


class ConfigFleet(Protocol):
    """What the config kind reads of the leader's registry."""

    def config_states(self) -> dict[str, tuple[tuple[str, ...], dict[str, ConfigState]]]:
        """device -> (its tags, what each of its configuration targets holds), as its heartbeats say."""


#: The leader's layer values for devices of a target: (target, device -> its tags) -> device -> values.
LayerValues = Callable[[str, dict[str, tuple[str, ...]]], dict[str, tuple[LayerValue, ...]]]


class ConfigKind:
    """Configuration on a leader: releases checked against `keys` (the fleet's, as devices pin
    them) and kept in `directory`; each offer carries its device's layer values."""

    traits = CONFIG

    def __init__(self, *, keys: Verifier | None, directory: Path, fleet: ConfigFleet,
                 layer_values: LayerValues | None = None,
                 tags: Callable[[], dict[str, tuple[str, ...]]] | None = None) -> None:
        self.keys = keys
        self.directory = directory
        self.fleet = fleet
        self.layer_values = layer_values
        self.tags = tags

    def admit(self, artifact: str, *, undone: RolloutRow | None) -> Admitted:
        """A rollback rolls forward: the old content under a version above the one it undoes."""
        release, kept, data = keep_release(self.keys, self.directory, artifact)
        if undone is not None and Version.parse(release.version) <= Version.parse(undone.version):
            raise RolloutError(f"a config rollback rolls forward: release {release.name} {release.version} must hold"
                               f" the old content under a version above {undone.version} (versions only increase)")
        return Admitted(version=release.version, artifact=str(kept), release=data)

    def _holding(self, target: str) -> dict[str, ConfigState]:
        """device -> what its target `target` holds, as its heartbeats say."""
        return {device: held[target] for device, (_, held) in self.fleet.config_states().items() if target in held}

    def held(self, release: bytes, devices: Sequence[DeviceInfo]) -> dict[str, str]:
        holding = self._holding(peek_release(release).name)
        return {d.device_id: holding[d.device_id].version for d in devices if d.device_id in holding}

    def offers(self, r: RolloutRow, devices: Sequence[DeviceRow], context: OfferContext) -> list[Outgoing]:
        values_of: dict[str, tuple[LayerValue, ...]] = {}
        if self.layer_values is not None and devices:
            target = peek_release(r.signed_manifest).name
            wanted = {d.device_id for d in devices}
            tags = self.tags() if self.tags is not None else {}
            values_of = self.layer_values(target, {device: tags.get(device, ()) for device in wanted})
        windows = tuple(r.spec.device.maintenance_windows)
        return [Outgoing(d.device_id, KIND_CONFIG_OFFER, encode(ConfigOffer(
            rollout_id=r.id, release=r.signed_manifest, layers=values_of.get(d.device_id, ()),
            maintenance_windows=windows, trust=context.trust)), key=f"config.offer:{r.id}") for d in devices]

    def in_sync(self, release: bytes, devices: Sequence[str]) -> set[str]:
        shown = peek_release(release)  # (verified when the rollout started)
        holding = self._holding(shown.name)
        return {device for device in devices if (held := holding.get(device)) is not None
                and held.version == shown.version and held.state == "committed" and not held.drifted}


__all__ = ["CONFIG", "ConfigFleet", "ConfigKind", "LayerValues", "describe_release", "keep_release"]
