"""`make_artifact`: a key pair and a small signed artifact, for tests, demos and the simulator.

    artifact, public_key = make_artifact(tmp_path, version="1.1.0")

The image bytes are drawn from a generator seeded by `seed` and `version`, and the creation
time is fixed, so the same arguments give the same artifact byte for byte. The key pair is made
once per `work_dir` (`work_dir/keys/private.pem`, `public.pem`) and reused by later calls, so
several versions built in one directory are signed by the same fleet key.
"""

from __future__ import annotations

import random
from pathlib import Path

from firmware_rollout.artifact.files import build_artifact
from rollout_engine.keys import generate_keypair, load_signing_key

FIXTURE_CREATED_MS = 1_700_000_000_000


def make_artifact(
    work_dir: Path,
    *,
    version: str = "1.1.0",
    size: int = 8 * 4096,
    seed: int = 0,
    chunk_size: int = 4096,
    rollback: bool = False,
    rollback_from: tuple[str, ...] = (),
    name: str = "fw",
) -> tuple[Path, Path]:
    """Build `work_dir/fw-VERSION.eafw` from `size` seeded random bytes in chunks of
    `chunk_size`; returns (artifact, public key path)."""
    keys_dir = work_dir / "keys"
    if not (keys_dir / "private.pem").exists():
        generate_keypair(keys_dir)
    image = work_dir / f"image-{version}.bin"
    image.write_bytes(random.Random(f"image:{seed}:{version}").randbytes(size))
    out = work_dir / f"{name}-{version}.eafw"
    build_artifact(
        image,
        out,
        name=name,
        version=version,
        key=load_signing_key(keys_dir / "private.pem"),
        created_ts=FIXTURE_CREATED_MS,
        chunk_size=chunk_size,
        rollback=rollback,
        rollback_from=rollback_from,
    )
    return out, keys_dir / "public.pem"


__all__ = ["FIXTURE_CREATED_MS", "make_artifact"]
