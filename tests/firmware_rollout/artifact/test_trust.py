"""The fleet's trust document: only newer documents signed by a trusted root are taken; the root
rotates only with the old and new roots' signatures; artifacts and releases signed by a key the
document does not list, or whose expiry passed, are refused; the held document survives a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config_rollout.errors import ReleaseSignature
from config_rollout.release import build_release, parse_release
from firmware_rollout.artifact.manifest import Manifest, make_signed_manifest, verify_signed_manifest
from firmware_rollout.errors import TrustError, WrongKey
from rollout_engine.keys import SigningKey, VerifyKey
from rollout_engine.trust import (
    STATE_FILE,
    TrustedKeys,
    load_fleet_keys,
    make_trust_document,
)

DAY_MS = 86_400_000
NOW = 1_800_000_000_000


class Clock:
    def __init__(self) -> None:
        self.ms = NOW

    def now_ms(self) -> int:
        return self.ms


ROOT, ROOT2, K1, K2 = (SigningKey.generate() for _ in range(4))


def doc(version: int, keys: list[tuple[SigningKey, int]], *, signers: tuple[SigningKey, ...] = (ROOT,),
        roots: tuple[SigningKey, ...] | None = None) -> bytes:
    return make_trust_document(version=version, roots=[r.public for r in (roots or signers)],
                               keys=[(k.public, exp) for k, exp in keys], signers=list(signers), issued_ms=NOW)


def trusted(clock: Clock, state: Path | None = None) -> TrustedKeys:
    return TrustedKeys([ROOT.public], now_ms=clock.now_ms, state_dir=state)


def manifest_signed_by(key: SigningKey) -> bytes:
    m = Manifest(name="fw", version="1.2.0", size=4096, sha256=bytes(32), chunk_size=4096, chunks=(bytes(32),))
    return make_signed_manifest(m, key).raw


def test_a_newer_document_from_the_root_is_taken_and_names_the_signing_keys() -> None:
    clock = Clock()
    keys = trusted(clock)
    assert keys.accept(doc(1, [(K1, NOW + DAY_MS)]))
    with pytest.raises(TrustError, match="not newer"):  # the same version, made again: not the one held
        keys.accept(doc(1, [(K2, NOW + DAY_MS)]))
    assert keys.signer(K1.key_id).key_id == K1.key_id
    with pytest.raises(WrongKey, match="does not list"):
        keys.signer(K2.key_id)


def test_a_lower_version_a_bad_signature_and_a_stranger_root_are_refused_and_change_nothing() -> None:
    keys = trusted(Clock())
    keys.accept(doc(3, [(K1, NOW + DAY_MS)]))
    with pytest.raises(TrustError, match="v2 is not newer than the one held \\(v3\\)"):
        keys.accept(doc(2, [(K2, NOW + DAY_MS)]))
    forged = doc(4, [(K2, NOW + DAY_MS)]).replace(b'"version":4', b'"version":5')
    with pytest.raises(TrustError, match="not signed by a trusted root"):
        keys.accept(forged)
    with pytest.raises(TrustError, match="not signed by a trusted root"):
        keys.accept(doc(6, [(K2, NOW + DAY_MS)], signers=(ROOT2,)))
    with pytest.raises(TrustError, match="malformed"):
        keys.accept(b'{"body": 1}')
    assert keys.version == 3 and keys.signer(K1.key_id)


def test_the_root_rotates_with_both_signatures_and_the_old_root_no_longer_suffices() -> None:
    keys = trusted(Clock())
    keys.accept(doc(1, [(K1, NOW + DAY_MS)]))
    with pytest.raises(TrustError, match="a new root .* must sign"):
        keys.accept(doc(2, [(K1, NOW + DAY_MS)], signers=(ROOT,), roots=(ROOT2,)))
    assert keys.accept(doc(2, [(K2, NOW + DAY_MS)], signers=(ROOT, ROOT2), roots=(ROOT2,)))
    with pytest.raises(TrustError, match="not signed by a trusted root"):
        keys.accept(doc(3, [(K1, NOW + DAY_MS)], signers=(ROOT,)))
    assert keys.accept(doc(3, [(K1, NOW + DAY_MS)], signers=(ROOT2,)))


def test_artifacts_and_releases_signed_by_a_removed_or_expired_key_are_refused(tmp_path: Path) -> None:
    clock = Clock()
    (tmp_path / "app.toml").write_text('level = "info"\n')
    keys = trusted(clock)
    keys.accept(doc(1, [(K1, NOW + DAY_MS), (K2, NOW + 2 * DAY_MS)]))
    assert verify_signed_manifest(manifest_signed_by(K1), keys).manifest.version == "1.2.0"
    release = build_release("app", "1.0.0", [tmp_path / "app.toml"], K2, created_ms=NOW)
    assert parse_release(release, keys).version == "1.0.0"
    keys.accept(doc(2, [(K2, NOW + 2 * DAY_MS)]))  # K1 removed
    with pytest.raises(WrongKey, match="trust document v2 does not list"):
        verify_signed_manifest(manifest_signed_by(K1), keys)
    clock.ms = NOW + 2 * DAY_MS  # K2's expiry
    with pytest.raises(ReleaseSignature, match="which expired at"):
        parse_release(release, keys)


def test_the_document_taken_is_kept_and_found_again_after_a_rotation(tmp_path: Path) -> None:
    clock = Clock()
    keys = trusted(clock, tmp_path)
    keys.accept(doc(1, [(K1, NOW + DAY_MS)]))
    keys.accept(doc(2, [(K2, NOW + DAY_MS)], signers=(ROOT, ROOT2), roots=(ROOT2,)))
    keys.accept(doc(3, [(K2, NOW + DAY_MS)], signers=(ROOT2,)))
    root_pem = tmp_path / "root.pem"
    root_pem.write_bytes(ROOT.public.to_pem())  # the device's config still pins the first root
    again = load_fleet_keys(public_key="", trust_root=str(root_pem), trust_document="", state_dir=tmp_path,
                            now_ms=clock.now_ms)
    assert isinstance(again, TrustedKeys) and again.version == 3 and again.signer(K2.key_id)
    state = (tmp_path / STATE_FILE).read_bytes()
    assert b'\\"version\\":3' in state
    (tmp_path / STATE_FILE).write_bytes(state.replace(b'\\"version\\":3', b'\\"version\\":9'))  # tampered
    with pytest.raises(TrustError, match="does not check"):
        load_fleet_keys(public_key="", trust_root=str(root_pem), trust_document="", state_dir=tmp_path,
                        now_ms=clock.now_ms)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.booleans()), max_size=12))
def test_the_version_held_only_ever_increases_and_only_root_signed_documents_count(
        steps: list[tuple[int, bool]]) -> None:
    keys = trusted(Clock())
    held = 0
    for version, by_root in steps:
        data = doc(version, [(K1, NOW + DAY_MS)], signers=(ROOT,) if by_root else (ROOT2,), roots=(ROOT,))
        try:
            keys.accept(data)
        except TrustError:
            assert version <= held or not by_root
        else:
            assert by_root and version >= held
            held = version
        assert keys.version == held


def test_verify_key_still_pins_one_key() -> None:
    assert isinstance(K1.public, VerifyKey)
    with pytest.raises(WrongKey):
        verify_signed_manifest(manifest_signed_by(K2), K1.public)
