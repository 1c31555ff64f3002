"""An image as an OCI archive: a tar of an OCI image layout (`oci-layout`, `index.json`,
`blobs/sha256/...`), as `podman save --format oci-archive` and `docker save` (Docker 25 and
later) write it.

`read_archive` checks what a bundle signs of it: one image (a manifest, not an index of
platforms), every blob the manifest names present with the digest its name says, and gives the
image's ID (its config's digest: what the runtime calls the loaded image) and architecture. The
layers are best stored uncompressed: a new version of the image then shares the bytes of every
unchanged layer with the old one, and the device fetches only the chunks that changed.
"""

from __future__ import annotations

import hashlib
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from app_rollout.errors import MalformedBundle

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
JSON_MAX = 1024 * 1024
Digest = Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}$")]


class _Descriptor(msgspec.Struct, frozen=True):
    digest: Digest
    size: Annotated[int, msgspec.Meta(ge=0)]
    mediaType: str = ""


class _Index(msgspec.Struct, frozen=True):
    manifests: Annotated[tuple[_Descriptor, ...], msgspec.Meta(max_length=64)]


class _Manifest(msgspec.Struct, frozen=True):
    config: _Descriptor
    layers: Annotated[tuple[_Descriptor, ...], msgspec.Meta(max_length=256)]
    mediaType: str = ""


class _Config(msgspec.Struct, frozen=True):
    architecture: str = ""
    os: str = ""


@dataclass(frozen=True)
class ArchiveImage:
    image_id: str  # the config's sha256 (hex)
    architecture: str
    layers: int
    size: int  # the blobs' bytes


def read_archive(path: Path, *, source: str) -> ArchiveImage:
    """The one image of the OCI archive at `path`, every blob checked against its digest; a
    `MalformedBundle` naming `source` says what is wrong."""
    try:
        with tarfile.open(path, mode="r:") as archive:
            members = {m.name.removeprefix("./"): m for m in archive.getmembers() if m.isfile()}

            def blob(descriptor: _Descriptor, what: str) -> bytes:
                name = "blobs/sha256/" + descriptor.digest.removeprefix("sha256:")
                member = members.get(name)
                if member is None:
                    raise MalformedBundle(f"{source}: {what} {descriptor.digest} is not in the archive")
                if member.size != descriptor.size:
                    raise MalformedBundle(f"{source}: {what} {descriptor.digest}: {member.size} bytes, not"
                                          f" {descriptor.size}")
                digest = hashlib.sha256()
                kept = bytearray()
                handle = archive.extractfile(member)
                assert handle is not None
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
                    if what != "layer" and len(kept) <= JSON_MAX:
                        kept += block
                if "sha256:" + digest.hexdigest() != descriptor.digest:
                    raise MalformedBundle(f"{source}: {what} {descriptor.digest}: its bytes have another digest")
                return bytes(kept)

            index_member = members.get("index.json")
            if index_member is None or "oci-layout" not in members:
                raise MalformedBundle(f"{source}: not an OCI archive (no oci-layout and index.json): save the image"
                                      " with podman save --format oci-archive")
            if index_member.size > JSON_MAX:
                raise MalformedBundle(f"{source}: index.json over {JSON_MAX} bytes")
            handle = archive.extractfile(index_member)
            assert handle is not None
            index = msgspec.json.decode(handle.read(), type=_Index)
            if len(index.manifests) != 1:
                raise MalformedBundle(f"{source}: {len(index.manifests)} images in the archive: an application's"
                                      " archive holds one")
            entry = index.manifests[0]
            if entry.mediaType not in (MANIFEST, DOCKER_MANIFEST):
                raise MalformedBundle(f"{source}: the archive holds {entry.mediaType or 'no media type'}, not one"
                                      " image's manifest (save one platform's image)")
            manifest = msgspec.json.decode(blob(entry, "manifest"), type=_Manifest)
            config_bytes = blob(manifest.config, "config")
            config = msgspec.json.decode(config_bytes, type=_Config)
            for layer in manifest.layers:
                blob(layer, "layer")
    except (OSError, tarfile.TarError) as exc:
        raise MalformedBundle(f"{source}: not a readable tar archive ({exc})") from None
    except msgspec.DecodeError as exc:
        raise MalformedBundle(f"{source}: {exc}") from None
    if config.os and config.os != "linux":
        raise MalformedBundle(f"{source}: an image for {config.os}, not linux")
    return ArchiveImage(image_id=manifest.config.digest.removeprefix("sha256:"), architecture=config.architecture,
                        layers=len(manifest.layers), size=sum(d.size for d in (manifest.config, *manifest.layers)))


__all__ = ["ArchiveImage", "read_archive"]
