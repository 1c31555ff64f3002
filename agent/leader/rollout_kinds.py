"""The leader's table of rollout kinds: what `kind = "..."` in a spec can name.

Each entry is a kind's traits (`rollout_engine.kinds.KindTraits`: known without a leader, read by
the CLI and the console) and its factory, which makes the kind on a running leader from what the
leader holds (`KindHost`). Adding a kind: a module with its traits, its leader side and its worker
part (`docs/architecture.md`, "Adding a rollout kind"), one line here, and its part in the
worker's list (`agent.app.roles`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.core.errors import ConfigError
from agent.protocol import ConfigState
from app_rollout.kind import APP, AppKind
from config_rollout.kind import CONFIG, ConfigKind
from config_rollout.layers import LayerValue
from firmware_rollout.orchestration.kind import FIRMWARE, FirmwareKind
from release_rollout.kind import RELEASE, ReleaseKind
from rollout_engine.keys import Verifier
from rollout_engine.kinds import KindTraits, RolloutKind


class KindHost(Protocol):
    """What a leader gives its kinds."""

    @property
    def keys(self) -> Verifier | None:
        """The fleet's keys, as devices pin them (None: the leader's config sets none)."""

    @property
    def artifacts_dir(self) -> Path:
        """Where the leader keeps the files its rollouts admitted."""

    def config_states(self) -> dict[str, tuple[tuple[str, ...], dict[str, ConfigState]]]:
        """device -> (its tags, what each configuration target holds), as its heartbeats say."""

    def device_tags(self) -> dict[str, tuple[str, ...]]:
        """device -> its tags, for every device the registry knows."""

    def layer_values(self, target: str, devices: dict[str, tuple[str, ...]]) -> dict[str, tuple[LayerValue, ...]]:
        """The configuration layers' values for each of `devices` (device -> its tags) of `target`."""

    def app_versions(self, name: str) -> dict[str, str]:
        """device -> the committed version of application `name`, as its heartbeats say."""


@dataclass(frozen=True)
class KindEntry:
    traits: KindTraits
    make: Callable[[KindHost], RolloutKind]


def _firmware(host: KindHost) -> RolloutKind:
    from firmware_rollout.orchestration.artifacts import ArtifactStore

    return FirmwareKind(ArtifactStore(host.artifacts_dir, host.keys))


def _config(host: KindHost) -> RolloutKind:
    return ConfigKind(keys=host.keys, directory=host.artifacts_dir, fleet=host, layer_values=host.layer_values,
                      tags=host.device_tags)


def _app(host: KindHost) -> RolloutKind:
    return AppKind(keys=host.keys, directory=host.artifacts_dir, versions=host.app_versions)


def _release(host: KindHost) -> RolloutKind:
    """A release's parts are admitted, held and offered by the kinds of this table."""
    return ReleaseKind(keys=host.keys, directory=host.artifacts_dir,
                       parts={FIRMWARE.name: _firmware(host), CONFIG.name: _config(host), APP.name: _app(host)})


ROLLOUT_KINDS: Mapping[str, KindEntry] = {
    FIRMWARE.name: KindEntry(FIRMWARE, _firmware),
    CONFIG.name: KindEntry(CONFIG, _config),
    APP.name: KindEntry(APP, _app),
    RELEASE.name: KindEntry(RELEASE, _release),
}


def traits_of(name: str, *, source: str, kinds: Mapping[str, KindEntry] = ROLLOUT_KINDS) -> KindTraits:
    """The traits of kind `name` (a spec's `rollout.kind`); a `ConfigError` naming `source`, the
    key and the kinds there are."""
    entry = kinds.get(name)
    if entry is None:
        raise ConfigError(source, "rollout.kind", f"{name!r} is not a rollout kind: the kinds are"
                                                  f" {', '.join(sorted(kinds))}")
    return entry.traits


def serves_image(kind: str, *, kinds: Mapping[str, KindEntry] = ROLLOUT_KINDS) -> bool:
    """Whether a rollout of `kind` downloads an image (its chunks, the artifact server): the
    download figures and columns mean something for it. An unknown kind is taken to."""
    entry = kinds.get(kind)
    return entry is None or entry.traits.image is not None


__all__ = ["ROLLOUT_KINDS", "KindEntry", "KindHost", "serves_image", "traits_of"]
