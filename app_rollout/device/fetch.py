"""A bundle from the mirrors, fetching only what the device does not hold already.

A mirror serves the bundle as `{mirror}/{bundle sha256}.eaapp` (the leader's artifact server,
nginx, a bucket). The device writes the bundle's file itself, in order: the signed head it was
offered, then each file, copied from the version it runs when a file there has the same sha256
(the manifest names each file's hash); a changed file the manifest lists by chunks, chunk by
chunk: each chunk the running version's manifest lists too is copied from there, the rest
fetched. What is fetched goes as one `Range` request per run of consecutive bytes the device
lacks. A new version whose binary changed and whose assets did not fetches the binary only; a
large file changed in one place fetches the chunks around the change.

The partial file survives a power cut or a lost link: the next try goes on from the first file it
did not finish (inside a fetched run, from the byte where it stopped). Nothing a mirror sends is
trusted: the whole file's sha256 is checked here, and the helper checks every file against the
signed head again. httpx is imported only when a download starts
(`firmware_rollout.device.http_source` says why httpx).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from app_rollout.bundle import BLOCK, AppManifest
from app_rollout.errors import AppInstallError

MIB = 1024 * 1024
KEEP_FREE = 64 * MIB  # what a download or an install leaves free on its disk (as `doctor`'s disk check)


@dataclass(frozen=True)
class Held:
    """Bytes the device holds: `length` bytes of the file `path` from `offset`, of hash `sha256`."""

    path: Path
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True)
class Reuse:
    """What the version the device runs holds, by sha256: whole files and chunks of files."""

    files: Mapping[str, Held]
    chunks: Mapping[str, Held]

    @classmethod
    def none(cls) -> Reuse:
        return cls({}, {})

    @classmethod
    def of(cls, manifest: AppManifest, files: Path) -> Reuse:
        """The files of `manifest` as they lie under `files` (the running version's own)."""
        whole: dict[str, Held] = {}
        chunks: dict[str, Held] = {}
        for f in manifest.files:
            whole[f.sha256] = Held(files / f.path, 0, f.size, f.sha256)
            at = 0
            for length, sha256 in f.chunks:
                chunks.setdefault(sha256, Held(files / f.path, at, length, sha256))
                at += length
        return cls(whole, chunks)

    def segments(self, manifest: AppManifest, start: int) -> list[tuple[int, int, Held | None]]:
        """The payload of `manifest` from byte `start` of the bundle as (start, end, what the
        device holds of it or None), in order: a whole file held, else a chunked file's chunks."""
        out: list[tuple[int, int, Held | None]] = []
        at = start
        for f in manifest.files:
            held = self.files.get(f.sha256)
            if held is not None and held.length == f.size:
                out.append((at, at + f.size, held))
            elif f.chunks:
                offset = at
                for length, sha256 in f.chunks:
                    chunk = self.chunks.get(sha256)
                    out.append((offset, offset + length, chunk if chunk is not None and chunk.length == length
                                else None))
                    offset += length
            else:
                out.append((at, at + f.size, None))
            at += f.size
        return out


@dataclass
class Fetched:
    path: Path
    bytes_fetched: int  # over the network, this download (a resumed one: only the rest)
    bytes_reused: int = 0  # copied from the files of the version the device runs
    seconds: float = 0.0


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy_checked(held: Held, out: IO[bytes]) -> bool:
    """The bytes `held` names appended to `out` when they are there and of their hash."""
    start = out.tell()
    digest = hashlib.sha256()
    try:
        with held.path.open("rb") as f:
            f.seek(held.offset)
            left = held.length
            while left:
                block = f.read(min(BLOCK, left))
                if not block:
                    break
                digest.update(block)
                out.write(block)
                left -= len(block)
    except OSError:
        pass
    else:
        if out.tell() - start == held.length and digest.hexdigest() == held.sha256:
            return True
    out.seek(start)
    out.truncate()
    return False


def check_room(directory: Path, need: int, keep_free: int, *, what: str) -> None:
    """An `AppInstallError` when writing `need` more bytes in `directory` would leave less than
    `keep_free` on its disk (the agent's outbox and databases share it)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return
    if free - need < keep_free:
        raise AppInstallError(f"{what}: {need / MIB:.1f} MiB to write, {free / MIB:.1f} MiB free on {directory}"
                              f" (of which {keep_free / MIB:.0f} MiB stays free for the agent): nothing written")


async def fetch_bundle(mirrors: Sequence[str], digest: str, size: int, directory: Path, *, head: bytes,
                       manifest: AppManifest, reuse: Reuse | None = None, timeout_s: float = 10.0,
                       ca: str = "", keep_free: int = KEEP_FREE) -> Fetched:
    """The bundle `digest` of `size` bytes in `directory`: `head`, then each file of `manifest`
    (or chunk of one) copied from what `reuse` holds or fetched from the first mirror that serves
    its run. An `AppInstallError` names each mirror's answer when none does, or the room missing
    when the rest would leave less than `keep_free` bytes free."""
    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    done = directory / f"{digest}.eaapp"
    if done.exists() and done.stat().st_size == size:
        return Fetched(done, 0)
    if len(head) + manifest.payload_size != size:
        raise AppInstallError(f"the offer says {size} bytes, its manifest {len(head) + manifest.payload_size}")
    partial = directory / f"{digest}.eaapp.partial"
    have_already = partial.stat().st_size if partial.exists() else 0
    check_room(directory, size - min(have_already, size), keep_free,
               what=f"fetching application {manifest.name} {manifest.version}")
    reuse = reuse or Reuse.none()
    fetched = reused = 0
    with partial.open("r+b" if partial.exists() else "w+b") as out:
        have = out.seek(0, os.SEEK_END)
        if have < len(head) or not _starts_with(out, head):
            out.seek(0)
            out.truncate()
            out.write(head)
            have = len(head)
        wanted: list[tuple[int, int]] = []  # (start, end) byte runs to fetch, in order
        for start, end, local in reuse.segments(manifest, len(head)):
            if end <= have:
                continue  # written by an earlier try
            if local is not None:
                if wanted:  # the runs to fetch before it come first: the file is written in order
                    fetched += await _fetch_runs(mirrors, digest, out, wanted, timeout_s, ca)
                    wanted = []
                out.seek(start)
                out.truncate()
                have = start
                if _copy_checked(local, out):
                    reused += end - start
                    have = end
                    continue
            first = max(start, have) if not wanted else start
            if wanted and wanted[-1][1] == start:
                wanted[-1] = (wanted[-1][0], end)
            else:
                wanted.append((first, end))
        if wanted:
            fetched += await _fetch_runs(mirrors, digest, out, wanted, timeout_s, ca)
        out.flush()
        os.fsync(out.fileno())
    if partial.stat().st_size != size or _digest(partial) != digest:
        partial.unlink()
        raise AppInstallError(f"the bundle assembled from the mirrors is not {digest[:16]}… (its files differ):"
                              " fetched again at the next offer")
    os.replace(partial, done)
    return Fetched(done, fetched, reused, time.monotonic() - started)


def _starts_with(out: IO[bytes], head: bytes) -> bool:
    out.seek(0)
    return out.read(len(head)) == head


async def _fetch_runs(mirrors: Sequence[str], digest: str, out: IO[bytes], runs: list[tuple[int, int]],
                      timeout_s: float, ca: str) -> int:
    """Each run's bytes from the first mirror that serves it, written at its offset; the bytes fetched."""
    import httpx

    fetched = 0
    failures: list[str] = []
    verify: Any = ca or True
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), verify=verify, follow_redirects=True,
                                 headers={"User-Agent": "edge-agent"}) as client:
        for start, end in runs:
            for mirror in mirrors:
                url = f"{mirror.rstrip('/')}/{digest}.eaapp"
                got = await _fetch_run(client, url, out, start, end, failures)
                fetched += got
                if out.tell() == end:
                    break
                start = max(start, out.tell())  # the next mirror goes on from there
            else:
                raise AppInstallError("no mirror served the bundle: " + ("; ".join(failures[-4:])
                                                                         or "no mirror offered"))
    return fetched


async def _fetch_run(client: Any, url: str, out: IO[bytes], start: int, end: int, failures: list[str]) -> int:
    """Bytes `start`..`end` of `url` written at `start` (as far as the mirror gave them)."""
    import httpx

    out.seek(start)
    out.truncate()
    written = 0
    try:
        async with client.stream("GET", url, headers={"Range": f"bytes={start}-{end - 1}"}) as answer:
            if answer.status_code != 206:
                failures.append(f"{url}: HTTP {answer.status_code}" + (" (no ranges)" if answer.status_code == 200
                                                                        else ""))
                return 0
            async for block in answer.aiter_bytes(1 << 16):
                if out.tell() + len(block) > end:
                    failures.append(f"{url}: more than the {end - start} bytes asked for")
                    out.seek(start)
                    out.truncate()
                    return written
                out.write(block)
                written += len(block)
    except httpx.HTTPError as exc:
        failures.append(f"{url}: {type(exc).__name__}: {exc}"[:200])
    return written


__all__ = ["KEEP_FREE", "Fetched", "Held", "Reuse", "check_room", "fetch_bundle"]
