"""Content-defined chunks: what `firmware build` makes by default, and what deltas stand on."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
from fwhelpers import Keys

from firmware_rollout.artifact.files import ContentDefined, build_artifact, read_image_chunk, verify_artifact
from firmware_rollout.artifact.manifest import Manifest, decode_manifest, encode_manifest
from firmware_rollout.errors import ArtifactError, MalformedArtifact

SMALL = ContentDefined(min_size=1024, avg_size=4096, max_size=16384)


def _build(tmp: Path, keys: Keys, data: bytes, version: str, **kwargs: object) -> Manifest:
    image = tmp / f"image-{version}.bin"
    image.write_bytes(data)
    signed = build_artifact(image, tmp / f"fw-{version}.eafw", name="fw", version=version, key=keys.signing,
                            created_ts=0, **kwargs)  # type: ignore[arg-type]
    return signed.manifest


def _shared(a: Manifest, b: Manifest) -> int:
    return len(set(a.chunks) & set(b.chunks))


def test_chunk_boundaries_survive_an_insertion_where_fixed_chunks_do_not(tmp_path: Path, keys: Keys) -> None:
    v1 = random.Random(5).randbytes(400_000)
    v2 = v1[:150_000] + b"a few new bytes in the middle" + v1[150_000:]
    cdc1 = _build(tmp_path, keys, v1, "1.0.0", content_defined=SMALL)
    cdc2 = _build(tmp_path, keys, v2, "1.1.0", content_defined=SMALL)
    fixed1 = _build(tmp_path, keys, v1, "1.0.1", chunk_size=4096)
    fixed2 = _build(tmp_path, keys, v2, "1.1.1", chunk_size=4096)
    assert cdc1.content_defined and sum(cdc1.chunk_lengths) == cdc1.size
    # content-defined: only the chunk or two around the insertion differ
    assert cdc2.chunk_count - _shared(cdc1, cdc2) <= 2
    # fixed: every chunk after the insertion moved
    assert fixed2.chunk_count - _shared(fixed1, fixed2) > fixed2.chunk_count / 2
    assert 1024 <= min(cdc1.chunk_lengths[:-1]) and max(cdc1.chunk_lengths) <= 16384 == SMALL.max_size


def test_a_content_defined_artifact_verifies_and_each_chunk_reads_at_its_offset(tmp_path: Path, keys: Keys) -> None:
    data = random.Random(6).randbytes(100_000)
    manifest = _build(tmp_path, keys, data, "1.0.0", content_defined=SMALL)
    artifact = tmp_path / "fw-1.0.0.eafw"
    signed = verify_artifact(artifact, keys.verify)
    layout = manifest.layout()
    pieces = [read_image_chunk(artifact, signed, i, layout) for i in range(manifest.chunk_count)]
    assert b"".join(pieces) == data
    assert [len(p) for p in pieces] == list(manifest.chunk_lengths)
    assert layout.span(1, 2) == (manifest.chunk_lengths[0], sum(manifest.chunk_lengths[:3]))


def test_a_manifest_whose_chunk_lengths_do_not_add_up_is_refused(tmp_path: Path, keys: Keys) -> None:
    manifest = _build(tmp_path, keys, random.Random(7).randbytes(50_000), "1.0.0", content_defined=SMALL)
    short = msgspec.structs.replace(manifest, chunk_lengths=(*manifest.chunk_lengths[:-1], 1))
    with pytest.raises(MalformedArtifact, match="add up to"):
        decode_manifest(msgspec.msgpack.encode(short))
    fewer = msgspec.structs.replace(manifest, chunk_lengths=manifest.chunk_lengths[:-1])
    with pytest.raises(MalformedArtifact, match="chunk lengths"):
        encode_manifest(fewer)
    bad_mirror = msgspec.structs.replace(manifest, mirrors=("ftp://mirror.example/fw",))
    with pytest.raises(MalformedArtifact, match="mirror"):
        encode_manifest(bad_mirror)


def test_a_fixed_chunk_manifest_encodes_as_before(tmp_path: Path, keys: Keys) -> None:
    """An agent that predates content-defined chunks still reads a fixed-chunk manifest: the new
    fields are left out of its encoding."""
    manifest = _build(tmp_path, keys, random.Random(8).randbytes(10_000), "1.0.0", chunk_size=1024)
    raw = msgspec.msgpack.decode(encode_manifest(manifest))
    assert "chunk_lengths" not in raw and "mirrors" not in raw


def test_bad_chunk_bounds_are_one_error() -> None:
    with pytest.raises(ArtifactError, match="min <= avg <= max"):
        ContentDefined(min_size=8192, avg_size=4096, max_size=16384)
