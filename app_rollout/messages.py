"""The wire messages of an application rollout: the leader's offer of a bundle to a device (its
reports are every kind's `RolloutReport`)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from app_rollout.bundle import HEAD_MAX

KIND_APP_OFFER = "app.offer"
KIND_APP_CANCEL = "app.cancel"

Mirror = Annotated[str, msgspec.Meta(max_length=512)]


class AppOffer(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """Install this application (the head verified by the device against the fleet's key before
    anything; every file of the bundle against the head)."""

    rollout_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    head: Annotated[bytes, msgspec.Meta(max_length=HEAD_MAX)]  # the bundle's signed head
    bundle: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]  # the bundle file's sha256: its name on a mirror
    size: Annotated[int, msgspec.Meta(ge=0)]  # the bundle file's size
    mirrors: Annotated[tuple[Mirror, ...], msgspec.Meta(max_length=8)] = ()
    maintenance_windows: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=16)], ...],
                                   msgspec.Meta(max_length=16)] = ()
    trust: Annotated[bytes, msgspec.Meta(max_length=64 * 1024)] = b""  # as UpdateOffer.trust


__all__ = ["KIND_APP_CANCEL", "KIND_APP_OFFER", "AppOffer"]
