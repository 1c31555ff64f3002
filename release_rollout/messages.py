"""The wire message of a release rollout: the leader's offer of a release to a device, carrying
each part's own offer as its kind makes it (its reports are every kind's `RolloutReport`)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from release_rollout.document import FILE_MAX, PARTS_MAX, PartId

KIND_RELEASE_OFFER = "release.offer"
KIND_RELEASE_CANCEL = "release.cancel"
PART_OFFER_MAX = 512 * 1024


class PartOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One part's offer, as its kind makes it for this device (msgpack of its offer message)."""

    part: PartId  # as the document's order names it
    payload: Annotated[bytes, msgspec.Meta(max_length=PART_OFFER_MAX)]


class ReleaseOffer(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """Converge on this release, all or nothing (the document verified by the device against the
    fleet's key before anything; each part's offer against the document)."""

    rollout_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    document: Annotated[bytes, msgspec.Meta(max_length=FILE_MAX)]
    parts: Annotated[tuple[PartOffer, ...], msgspec.Meta(max_length=PARTS_MAX)]
    maintenance_windows: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=16)], ...],
                                   msgspec.Meta(max_length=16)] = ()
    trust: Annotated[bytes, msgspec.Meta(max_length=64 * 1024)] = b""  # as UpdateOffer.trust


__all__ = ["KIND_RELEASE_CANCEL", "KIND_RELEASE_OFFER", "PART_OFFER_MAX", "PartOffer", "ReleaseOffer"]
