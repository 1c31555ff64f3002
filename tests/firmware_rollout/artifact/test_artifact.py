from __future__ import annotations

import os
from pathlib import Path

import pytest
from fwhelpers import CHUNK, Keys, make_artifact

from agent.core.errors import ArtifactError, BadSignature, Downgrade
from firmware_rollout.artifact.files import inspect_artifact, read_image_chunk, sign_artifact, verify_artifact
from firmware_rollout.artifact.manifest import HEADER_SIZE, SIGNATURE_BLOCK_SIZE
from firmware_rollout.errors import ChunkMismatch, Incompatible, KeyFileError, MalformedArtifact, Unsigned, WrongKey
from rollout_engine.keys import SigningKey, load_signing_key, load_verify_key


def flip(path: Path, offset: int) -> Path:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    tampered = path.with_name(f"tampered-{offset}.eafw")
    tampered.write_bytes(bytes(data))
    return tampered


def test_round_trip(tmp_path: Path, keys: Keys) -> None:
    path, signed = make_artifact(tmp_path, keys.signing, hardware=["rpi4", "rpi5"], min_version="1.0.0")
    verified = verify_artifact(path, keys.verify, hardware="rpi4", installed_version="1.0.0")
    assert verified.manifest == signed.manifest
    m = verified.manifest
    assert (m.name, m.version, m.size, m.chunk_size, m.chunk_count) == ("fw", "1.1.0", 5 * CHUNK + 100, CHUNK, 6)
    assert path.stat().st_size == signed.size + m.size
    assert read_image_chunk(path, signed, 5) == (tmp_path / "image-1.1.0-1.bin").read_bytes()[5 * CHUNK :]
    info = inspect_artifact(path).to_dict()
    assert info["key_id"] == keys.verify.key_id_hex and info["signed"] is True


def test_every_header_byte_is_protected(tmp_path: Path, keys: Keys) -> None:
    path, _ = make_artifact(tmp_path, keys.signing)
    reasons = {}
    for offset in range(HEADER_SIZE):
        with pytest.raises(ArtifactError) as err:
            verify_artifact(flip(path, offset), keys.verify)
        reasons[offset] = str(err.value)
    assert all("bad magic" in reasons[i] for i in range(4))
    assert all("unsupported artifact format" in reasons[i] for i in (4, 5))
    assert all("reserved" in reasons[i] for i in (6, 7, 12, 13, 14, 15))
    assert all(reasons[i] for i in (8, 9, 10, 11))  # length: out of range, truncated or signature


def test_every_manifest_byte_is_covered_by_the_signature(tmp_path: Path, keys: Keys) -> None:
    path, signed = make_artifact(tmp_path, keys.signing)
    for offset in range(HEADER_SIZE, HEADER_SIZE + signed.manifest_length):
        with pytest.raises(BadSignature, match="bad signature"):
            verify_artifact(flip(path, offset), keys.verify)


def test_signature_block_bytes(tmp_path: Path, keys: Keys) -> None:
    path, signed = make_artifact(tmp_path, keys.signing)
    start = HEADER_SIZE + signed.manifest_length
    for offset in range(start, start + 8):
        with pytest.raises(BadSignature, match="key id field"):
            verify_artifact(flip(path, offset), keys.verify)
    for offset in range(start + 8, start + SIGNATURE_BLOCK_SIZE):
        with pytest.raises(BadSignature, match="does not verify") as err:
            verify_artifact(flip(path, offset), keys.verify)
        assert not isinstance(err.value, WrongKey)


def test_one_byte_in_each_chunk(tmp_path: Path, keys: Keys) -> None:
    path, signed = make_artifact(tmp_path, keys.signing)
    for index in range(signed.manifest.chunk_count):
        for where in (0, signed.manifest.chunk_length(index) - 1):
            offset = signed.size + index * CHUNK + where
            with pytest.raises(ChunkMismatch, match=f"tampered chunk: chunk {index} of 6"):
                verify_artifact(flip(path, offset), keys.verify)


def test_truncated_or_extended_file_is_a_size_mismatch(tmp_path: Path, keys: Keys) -> None:
    path, signed = make_artifact(tmp_path, keys.signing)
    data = path.read_bytes()
    for name, body in (("short", data[:-1]), ("long", data + b"\0"), ("image-less", data[: signed.size])):
        target = tmp_path / name
        target.write_bytes(body)
        with pytest.raises(MalformedArtifact, match="size mismatch"):
            verify_artifact(target, keys.verify)
    for cut in (0, 3, HEADER_SIZE + 2, signed.size - 1):
        target = tmp_path / f"cut{cut}"
        target.write_bytes(data[:cut])
        with pytest.raises(MalformedArtifact, match="truncated|bad magic"):
            verify_artifact(target, keys.verify)


def test_wrong_key_is_named(tmp_path: Path, keys: Keys) -> None:
    path, _ = make_artifact(tmp_path, SigningKey.generate())
    with pytest.raises(WrongKey, match=f"pinned key is {keys.verify.key_id_hex}"):
        verify_artifact(path, keys.verify)


def test_downgrade_refused_signed_rollback_accepted(tmp_path: Path, keys: Keys) -> None:
    old, _ = make_artifact(tmp_path, keys.signing, version="1.0.0")
    with pytest.raises(Downgrade, match="lower than installed 1.1.0"):
        verify_artifact(old, keys.verify, installed_version="1.1.0")
    verify_artifact(old, keys.verify, installed_version="1.0.0")  # same version is no downgrade
    rollback, _ = make_artifact(tmp_path, keys.signing, version="1.0.0", seed=2, rollback=True)
    assert verify_artifact(rollback, keys.verify, installed_version="1.1.0").manifest.rollback
    # The rollback flag is signed: clearing it by editing the manifest breaks the signature.
    data = rollback.read_bytes()
    marker = b"\xa8rollback\xc3"
    assert data.count(marker) == 1
    forged = tmp_path / "forged.eafw"
    forged.write_bytes(data.replace(marker, b"\xa8rollback\xc2"))
    with pytest.raises(BadSignature):
        verify_artifact(forged, keys.verify, installed_version="1.1.0")


def test_incompatible_hardware_and_min_version(tmp_path: Path, keys: Keys) -> None:
    path, _ = make_artifact(tmp_path, keys.signing, hardware=["rpi4"], min_version="1.0.5")
    with pytest.raises(Incompatible, match="image is for rpi4, this device is rpi3"):
        verify_artifact(path, keys.verify, hardware="rpi3")
    with pytest.raises(Incompatible, match="at least version 1.0.5"):
        verify_artifact(path, keys.verify, hardware="rpi4", installed_version="1.0.4")


def test_unsigned_then_signed(tmp_path: Path, keys: Keys) -> None:
    path, signed = make_artifact(tmp_path, None)
    assert not signed.is_signed
    with pytest.raises(Unsigned, match="unsigned"):
        verify_artifact(path, keys.verify)
    copy = tmp_path / "signed-copy.eafw"
    sign_artifact(path, keys.signing, out=copy)
    verify_artifact(copy, keys.verify)
    with pytest.raises(Unsigned):
        verify_artifact(path, keys.verify)  # --out leaves the original alone
    sign_artifact(path, keys.signing)
    verify_artifact(path, keys.verify)


def test_resign_with_another_key(tmp_path: Path, keys: Keys) -> None:
    other = SigningKey.generate()
    path, _ = make_artifact(tmp_path, other)
    sign_artifact(path, keys.signing)
    verify_artifact(path, keys.verify)
    with pytest.raises(WrongKey):
        verify_artifact(path, other.public)


def test_sign_refuses_a_tampered_image(tmp_path: Path, keys: Keys) -> None:
    path, signed = make_artifact(tmp_path, None)
    tampered = flip(path, signed.size + 3 * CHUNK + 7)
    with pytest.raises(ChunkMismatch, match="chunk 3"):
        sign_artifact(tampered, keys.signing)


def test_key_files(tmp_path: Path, keys: Keys) -> None:
    with pytest.raises(KeyFileError, match="cannot read key file"):
        load_verify_key(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a key")
    with pytest.raises(KeyFileError, match="not a PEM public key"):
        load_verify_key(garbage)
    with pytest.raises(KeyFileError, match="not a PEM private key"):
        load_signing_key(garbage)
    with pytest.raises(KeyFileError, match="not a PEM private key"):
        load_signing_key(keys.public_path)  # the public key where the private one belongs
    assert keys.private_path.stat().st_mode & 0o777 == 0o600


def test_missing_artifact_is_a_typed_error(tmp_path: Path, keys: Keys) -> None:
    with pytest.raises(ArtifactError, match="cannot read"):
        verify_artifact(tmp_path / "nope.eafw", keys.verify)


def test_streaming_verify_uses_bounded_memory(tmp_path: Path, keys: Keys) -> None:
    import tracemalloc

    from firmware_rollout.artifact.files import build_artifact

    image = tmp_path / "big.img"
    with image.open("wb") as handle:
        for _ in range(32):
            handle.write(os.urandom(1024 * 1024))
    artifact = tmp_path / "big.eafw"
    tracemalloc.start()
    try:
        build_artifact(image, artifact, name="big", version="1.0.0", key=keys.signing, created_ts=0)
        _, build_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        verify_artifact(artifact, keys.verify)
        _, verify_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert build_peak < 4 * 1024 * 1024 and verify_peak < 2 * 1024 * 1024, (build_peak, verify_peak)


def test_a_rollback_replaces_only_the_versions_it_names(tmp_path: Path, keys: Keys) -> None:
    rollback, _ = make_artifact(tmp_path, keys.signing, version="1.0.0", seed=3, rollback=True,
                                rollback_from=("1.1.0",))
    assert verify_artifact(rollback, keys.verify, installed_version="1.1.0").manifest.rollback_from == ("1.1.0",)
    with pytest.raises(Downgrade, match="replaces only version 1.1.0, this device runs 2.0.0"):
        verify_artifact(rollback, keys.verify, installed_version="2.0.0")
    # the list is signed: widening it breaks the signature
    data = rollback.read_bytes()
    forged = tmp_path / "widened.eafw"
    forged.write_bytes(data.replace(b"1.1.0", b"2.0.0", 1))
    with pytest.raises(BadSignature):
        verify_artifact(forged, keys.verify, installed_version="2.0.0")
    with pytest.raises(MalformedArtifact, match="not signed as a rollback"):
        make_artifact(tmp_path, keys.signing, version="1.0.0", seed=4, rollback_from=("1.1.0",))
