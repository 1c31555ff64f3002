"""A bundle from the mirrors: one HTTP GET per mirror, resumed with `Range` from what a partial
file holds, so a download cut by a power loss or a lost link goes on where it stopped.

A mirror serves the bundle as `{mirror}/{bundle sha256}.eaapp` (the leader's artifact server,
nginx, a bucket). Nothing it sends is trusted: the whole file's sha256 is checked here, and the
helper checks every file against the signed head again. httpx is imported only when a download
starts (`firmware_rollout.device.http_source` says why httpx).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app_rollout.errors import AppInstallError


@dataclass
class Fetched:
    path: Path
    bytes_fetched: int  # over the network, this download (a resumed one: only the rest)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


async def fetch_bundle(mirrors: Sequence[str], digest: str, size: int, directory: Path, *,
                       timeout_s: float = 10.0, ca: str = "") -> Fetched:
    """The bundle `digest` of `size` bytes in `directory`, fetched from the first mirror that
    serves it whole; an `AppInstallError` naming each mirror's answer when none does."""
    import httpx

    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    done = directory / f"{digest}.eaapp"
    if done.exists() and done.stat().st_size == size:
        return Fetched(done, 0)
    partial = directory / f"{digest}.eaapp.partial"
    fetched = 0
    failures: list[str] = []
    verify: object = ca or True
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), verify=verify,  # type: ignore[arg-type]
                                 follow_redirects=True, headers={"User-Agent": "edge-agent"}) as client:
        for mirror in mirrors:
            url = f"{mirror.rstrip('/')}/{digest}.eaapp"
            have = partial.stat().st_size if partial.exists() else 0
            if have > size:
                partial.unlink()
                have = 0
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                async with client.stream("GET", url, headers=headers) as answer:
                    if answer.status_code == 200 and have:
                        have = 0  # the mirror ignores ranges: the whole file again
                    elif answer.status_code not in (200, 206):
                        failures.append(f"{url}: HTTP {answer.status_code}")
                        continue
                    with partial.open("r+b" if have else "wb") as f:
                        f.seek(have)
                        f.truncate()
                        async for block in answer.aiter_bytes(1 << 16):
                            if f.tell() + len(block) > size:
                                raise AppInstallError(f"{url}: more than the {size} bytes offered")
                            f.write(block)
                            fetched += len(block)
                        f.flush()
                        os.fsync(f.fileno())
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {type(exc).__name__}: {exc}"[:200])
                continue
            except AppInstallError as exc:
                partial.unlink(missing_ok=True)
                failures.append(str(exc))
                continue
            if partial.stat().st_size != size:
                failures.append(f"{url}: {partial.stat().st_size} of {size} bytes")
                continue
            if _digest(partial) != digest:
                partial.unlink()
                failures.append(f"{url}: a file of another sha256")
                continue
            os.replace(partial, done)
            return Fetched(done, fetched)
    raise AppInstallError("no mirror served the bundle: " + ("; ".join(failures) or "no mirror offered"))


__all__ = ["Fetched", "fetch_bundle"]
