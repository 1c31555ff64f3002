"""Downloads from HTTP mirrors with range requests, against a real nginx."""

from __future__ import annotations

import random
import shutil
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from fwhelpers import Device, Keys
from nginx_mirror import NginxMirror

from agent.core.errors import Capacity, Transient
from firmware_rollout.artifact.files import ContentDefined, build_artifact
from firmware_rollout.artifact.manifest import SignedManifest
from firmware_rollout.device.fallback import FallbackSource
from firmware_rollout.device.http_source import MirrorSource, make_client
from firmware_rollout.device.sources import ArtifactChunkSource
from firmware_rollout.device.updater import UpdaterSettings
from firmware_rollout.messages import UpdateOffer

SMALL = ContentDefined(min_size=1024, avg_size=4096, max_size=16384)
RUN = 64 * 1024  # a range request covers at most this much: a download takes several
FAST = UpdaterSettings(fetch_backoff_base_s=0.05, fetch_backoff_cap_s=0.2, fetch_attempts=20)

Mirrors = Callable[[], NginxMirror]


@pytest.fixture
def artifact(tmp_path: Path, keys: Keys) -> tuple[Path, SignedManifest, bytes]:
    data = random.Random(21).randbytes(400_000)
    image = tmp_path / "image.bin"
    image.write_bytes(data)
    out = tmp_path / "fw-1.1.0.eafw"
    signed = build_artifact(image, out, name="fw", version="1.1.0", key=keys.signing, created_ts=0,
                            content_defined=SMALL)
    return out, signed, data


def publish(mirror: NginxMirror, artifact: Path, signed: SignedManifest, *, under: str = "") -> str:
    """Put the artifact on the mirror under its content address; its base URL."""
    directory = mirror.www / under if under else mirror.www
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(artifact, directory / f"{signed.manifest.sha256.hex()}.eafw")
    return f"{mirror.url}/{under}".rstrip("/")


class Watched:
    """A source that runs `after(index)` once each chunk came through (the test's hook for a
    mirror that disappears or a link that is cut mid-download) and records what it got."""

    def __init__(self, inner: FallbackSource, after: Callable[[int], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.inner = inner
        self.after = after
        self.on_error = on_error
        self.fetched: list[int] = []

    def plan(self, indices: Sequence[int]) -> None:
        self.inner.plan(indices)

    async def fetch(self, index: int) -> bytes:
        try:
            data = await self.inner.fetch(index)
        except Exception as exc:
            if self.on_error is not None:
                self.on_error(exc)
            raise
        self.fetched.append(index)
        if self.after is not None:
            self.after(index)
        return data


async def download(device: Device, signed: SignedManifest, urls: Sequence[str], *, budget: int = 5,
                   last_resort: Path | None = None, after: Callable[[int], None] | None = None,
                   on_error: Callable[[BaseException], None] | None = None,
                   made: Callable[[FallbackSource], None] | None = None) -> tuple[str, FallbackSource]:
    client = make_client(timeout_s=5.0)
    layout = signed.manifest.layout()
    mirrors = [MirrorSource(client, url, signed.manifest, layout, max_run_bytes=RUN) for url in urls]
    sources: list[tuple[str, object]] = [(m.mirror, m) for m in mirrors]
    if last_resort is not None:
        sources.append(("leader", ArtifactChunkSource(last_resort)))
    chain = FallbackSource(sources, signed.manifest, retry_budget=budget, layout=layout,  # type: ignore[arg-type]
                           closers=[*(m.close for m in mirrors), client.aclose])
    if made is not None:
        made(chain)
    updater = await device.boot()
    try:
        await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=signed.raw), Watched(chain, after, on_error))
        return updater.status().state, chain
    finally:
        await chain.aclose()
        await updater.close()


def installed(device: Device) -> bytes:
    return (device.root / "slots" / "b" / "image").read_bytes()


async def test_a_range_download_from_nginx_installs_the_image(tmp_path: Path, keys: Keys, nginx: Mirrors,
                                                             artifact: tuple[Path, SignedManifest, bytes]) -> None:
    path, signed, data = artifact
    mirror = nginx()
    url = publish(mirror, path, signed)
    device = Device(tmp_path / "dev", keys, settings=FAST)
    state, chain = await download(device, signed, [url])
    assert state == "rebooting" and installed(device) == data
    assert chain.fetched_from[url] == signed.manifest.chunk_count and not chain.permanent_errors
    served = mirror.requests()
    ranges = [r for status, _, r in served if status == 206]
    assert len(ranges) == len(served) and ranges[0] == "bytes=0-15"  # the header first, then the image
    assert len(data) / RUN <= len(ranges) - 1 <= 2 * len(data) / RUN  # one request per run, not per chunk


async def test_a_mirror_serving_a_corrupted_chunk_is_passed_over(tmp_path: Path, keys: Keys, nginx: Mirrors,
                                                                 artifact: tuple[Path, SignedManifest, bytes]) -> None:
    path, signed, data = artifact
    bad, good = nginx(), nginx()
    bad_url, good_url = publish(bad, path, signed), publish(good, path, signed)
    served = bad.www / f"{signed.manifest.sha256.hex()}.eafw"
    corrupt = bytearray(served.read_bytes())
    layout = signed.manifest.layout()
    corrupt[signed.size + layout.offset(7) + 3] ^= 0xFF  # chunk 7 on the first mirror is bad
    served.write_bytes(bytes(corrupt))
    device = Device(tmp_path / "dev", keys, settings=FAST)
    state, chain = await download(device, signed, [bad_url, good_url])
    assert state == "rebooting" and installed(device) == data
    assert chain.fetched_from[bad_url] == 7  # chunks 0-6; chunk 7 and the rest from the good one
    assert chain.fetched_from[good_url] == signed.manifest.chunk_count - 7
    assert len(chain.permanent_errors) == 1 and "bad chunk 7" in chain.permanent_errors[0]


async def test_a_mirror_that_disappears_mid_download_hands_over_to_the_next(
        tmp_path: Path, keys: Keys, nginx: Mirrors, artifact: tuple[Path, SignedManifest, bytes]) -> None:
    path, signed, data = artifact
    first, second = nginx(), nginx()
    urls = [publish(first, path, signed), publish(second, path, signed)]

    def gone(index: int) -> None:
        if index == 20:
            first.stop(signal.SIGKILL)  # every connection cut at once, mid-run

    device = Device(tmp_path / "dev", keys, settings=FAST)
    state, chain = await download(device, signed, urls, after=gone)
    assert state == "rebooting" and installed(device) == data
    # what the first one had sent before it died (chunk 20 and what was already on the wire) counts
    taken = chain.fetched_from[urls[0]]
    assert 21 <= taken < signed.manifest.chunk_count
    assert chain.fetched_from[urls[1]] == signed.manifest.chunk_count - taken
    assert not chain.permanent_errors and chain.failovers == 1
    first_range = [r for status, _, r in second.requests() if status == 206][1]
    start = signed.size + signed.manifest.layout().offset(taken)
    assert first_range.startswith(f"bytes={start}-")  # the second mirror picked up at the next chunk


async def test_busy_answers_are_capacity_with_the_servers_retry_after(
        nginx: Mirrors, artifact: tuple[Path, SignedManifest, bytes]) -> None:
    path, signed, _ = artifact
    mirror = nginx()
    layout = signed.manifest.layout()
    async with make_client() as client:
        for under, status, delay_ms in (("busy", 429, 3000), ("unavailable", 503, 1000)):
            source = MirrorSource(client, publish(mirror, path, signed, under=under), signed.manifest, layout)
            with pytest.raises(Capacity) as caught:
                await source.fetch(0)
            assert caught.value.retry_after_ms == delay_ms and str(status) in str(caught.value)
            chain = FallbackSource([("m", source), ("leader", ArtifactChunkSource(path))], signed.manifest)
            with pytest.raises(Capacity):  # busy is not a failure: the updater waits, the same mirror again
                await chain.fetch(0)
            assert not chain.permanent_errors


async def test_a_404_is_permanent_for_that_mirror_and_the_next_one_serves(
        tmp_path: Path, keys: Keys, nginx: Mirrors, artifact: tuple[Path, SignedManifest, bytes]) -> None:
    path, signed, data = artifact
    mirror = nginx()
    good = publish(mirror, path, signed, under="fw")
    device = Device(tmp_path / "dev", keys, settings=FAST)
    state, chain = await download(device, signed, [f"{mirror.url}/empty", good])
    assert state == "rebooting" and installed(device) == data
    assert len(chain.permanent_errors) == 1 and "404" in chain.permanent_errors[0]
    assert chain.fetched_from[good] == signed.manifest.chunk_count


async def test_the_retry_budget_stops_the_device_after_so_many_permanent_errors(
        tmp_path: Path, keys: Keys, nginx: Mirrors, artifact: tuple[Path, SignedManifest, bytes]) -> None:
    path, signed, _ = artifact
    mirror = nginx()
    urls = [f"{mirror.url}/none-{i}" for i in range(3)]
    device = Device(tmp_path / "dev", keys, settings=FAST)
    state, chain = await download(device, signed, urls, budget=2, last_resort=path)
    assert state == "failed"
    assert device.sent[-1].state == "failed" and "retry budget spent: 2 permanent errors" in device.sent[-1].detail
    assert len(mirror.requests()) == 2  # the third mirror and the leader were never asked: no more data spent
    assert chain.fetched_from["leader"] == 0


async def test_a_cut_link_resumes_from_the_last_verified_chunk(
        tmp_path: Path, keys: Keys, nginx: Mirrors, artifact: tuple[Path, SignedManifest, bytes]) -> None:
    path, signed, data = artifact
    mirror = nginx()
    url = publish(mirror, path, signed)
    errors: list[BaseException] = []
    resumed_at: list[int] = []
    logged: list[int] = []

    def cut(index: int) -> None:
        if index == 30:
            mirror.stop(signal.SIGKILL)

    def back(exc: BaseException) -> None:  # the link comes back after the first failed fetch
        errors.append(exc)
        resumed_at.append(chain_box[0].fetched_from[url])  # chunks 0..n-1 verified: n comes next
        logged.append(len(mirror.requests()))
        mirror.start()

    chain_box: list[FallbackSource] = []
    device = Device(tmp_path / "dev", keys, settings=FAST)
    state, chain = await download(device, signed, [url], after=cut, on_error=back, made=chain_box.append)
    assert state == "rebooting" and installed(device) == data
    assert errors and isinstance(errors[0], Transient)
    assert chain.fetched_from[url] == signed.manifest.chunk_count  # each chunk once: nothing fetched twice
    assert resumed_at[0] > 30
    status, _, first_after = mirror.requests()[logged[0]]  # the restarted mirror's first request
    start = signed.size + signed.manifest.layout().offset(resumed_at[0])
    assert status == 206 and first_after.startswith(f"bytes={start}-")  # from the first chunk not yet verified
