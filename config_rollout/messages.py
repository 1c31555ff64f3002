"""The wire message of a config rollout: the leader's offer of a release to a device, with the
layer values the leader renders for that device (its reports are the firmware's `RolloutReport`,
so the wave engine reads both alike)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from config_rollout.layers import MAX_VALUES, LayerValue

KIND_CONFIG_OFFER = "config.offer"
KIND_CONFIG_CANCEL = "config.cancel"
OFFER_RELEASE_MAX = 512 * 1024  # a release offered inline, in one MQTT message


class ConfigOffer(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """Apply this release (verified by the device against the fleet's key before anything)."""

    rollout_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    release: Annotated[bytes, msgspec.Meta(max_length=OFFER_RELEASE_MAX)]
    # the leader's layer values for this device: its groups in their stated order, then its own
    layers: Annotated[tuple[LayerValue, ...], msgspec.Meta(max_length=MAX_VALUES)] = ()
    # device-local "HH:MM-HH:MM": the apply starts only inside one (the offer waits, cancelable)
    maintenance_windows: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=16)], ...],
                                   msgspec.Meta(max_length=16)] = ()
    trust: Annotated[bytes, msgspec.Meta(max_length=64 * 1024)] = b""  # as UpdateOffer.trust


__all__ = ["KIND_CONFIG_CANCEL", "KIND_CONFIG_OFFER", "OFFER_RELEASE_MAX", "ConfigOffer"]
