"""Shared helpers of the firmware tests (imported by name: the test dirs are not packages)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from firmware_rollout.artifact import build_artifact
from firmware_rollout.keys import SigningKey, VerifyKey, generate_keypair, load_signing_key, load_verify_key
from firmware_rollout.manifest import SignedManifest

CHUNK = 1024


@dataclass
class Keys:
    dir: Path
    private_path: Path
    public_path: Path
    signing: SigningKey
    verify: VerifyKey


def make_keys(tmp_path: Path) -> Keys:
    paths = generate_keypair(tmp_path / "keys")
    return Keys(
        tmp_path / "keys", paths.private, paths.public, load_signing_key(paths.private), load_verify_key(paths.public)
    )


def make_image(path: Path, size: int, seed: int = 1) -> Path:
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def make_artifact(
    tmp_path: Path,
    key: SigningKey | None,
    *,
    version: str = "1.1.0",
    size: int = 5 * CHUNK + 100,
    seed: int = 1,
    name: str = "fw",
    **kwargs: object,
) -> tuple[Path, SignedManifest]:
    image = make_image(tmp_path / f"image-{version}-{seed}.bin", size, seed)
    out = tmp_path / f"fw-{version}-{seed}.eafw"
    signed = build_artifact(
        image, out, name=name, version=version, key=key, created_ts=1_700_000_000_000, chunk_size=CHUNK, **kwargs
    )  # type: ignore[arg-type]
    return out, signed
