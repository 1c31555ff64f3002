"""Delta benchmark: what a device downloads to go from v1 to v2, against the full image, Debian's
casync and xdelta3, and what serving it costs the leader over HTTP against MQTT chunks.

    python scripts/bench_delta.py [--quick] [--devices N] [--fleet-mb M] [--delta-devices N] [--base-tree DIR]

1. Images from real content: squashfs images (what RAUC bundles hold) of a Python environment
   of pinned wheels from PyPI, and v2 of it with a few packages upgraded to newer releases
   (real version deltas), one removed and one added.
2. Bytes for v1 -> v2: the full image; ours (the chunks of v2's content-defined manifest that
   v1's does not have, plus the signed manifest itself); casync with its default chunk sizes
   (the chunks of v2's store missing from v1's store, as stored: compressed, plus the index);
   xdelta3 -9 (the best server-computed patch for that exact version pair).
3. A device assembling v2: the real `Updater` with v1 installed in its active slot, copying what
   it has and range-fetching the rest from a real leader's artifact server (`edge-agent run`
   in its own process): the device's CPU and wall time.
4. The leader's CPU per GB served: its artifact server (HTTP range requests) against its
   ConfigServers (MQTT chunk requests over a real mosquitto), read from the leader process.
5. A fleet: N devices download an M MB image from the leader's artifact server at once; they
   must all finish, and the server must never answer more than its bound at once. Then a wave
   of a delta rollout's size (1,000 devices) fetches the v1 -> v2 delta at once.

Without --quick both images also hold /usr/share (real files, unchanged between the versions),
which makes them the size of a device's root filesystem.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_install import Healthy, NoReboot, cpu_s  # noqa: E402  (the other benchmarks' pieces)
from bench_mqtt import free_port, mosquitto  # noqa: E402

from agent.core.clock import SystemClock  # noqa: E402
from firmware_rollout.artifact.files import ContentDefined, build_artifact  # noqa: E402
from firmware_rollout.artifact.manifest import SignedManifest  # noqa: E402
from firmware_rollout.device.sources import ArtifactChunkSource  # noqa: E402
from firmware_rollout.device.updater import Updater  # noqa: E402
from firmware_rollout.messages import UpdateOffer  # noqa: E402
from rollout_engine.keys import generate_keypair, load_signing_key, load_verify_key  # noqa: E402

#: v1's environment (pinned) and what v2 changes, a minor upgrade: three packages to newer
#: releases, one removed, one added. numpy is the bulk (compiled code and data, as on a device).
V1 = {"numpy": "1.26.2", "pip": "23.3.1", "setuptools": "69.0.2", "pygments": "2.16.1", "rich": "13.7.0",
      "requests": "2.31.0", "urllib3": "2.0.7", "idna": "3.6", "certifi": "2023.11.17",
      "charset-normalizer": "3.3.2", "jinja2": "3.1.2", "markupsafe": "2.1.3", "click": "8.1.7",
      "packaging": "23.2", "attrs": "23.1.0", "pyparsing": "3.1.1", "six": "1.16.0", "wheel": "0.42.0",
      "msgspec": "0.18.5"}
V2_UPGRADES = {"urllib3": "2.1.0", "idna": "3.7", "certifi": "2024.2.2"}
V2_REMOVED = ("six",)
V2_ADDED = {"typing-extensions": "4.9.0"}


def log(message: str) -> None:
    print(f"[bench_delta] {message}", file=sys.stderr, flush=True)


def need(tool: str) -> str:
    found = shutil.which(tool) or next((p for p in (f"/usr/sbin/{tool}", f"/usr/bin/{tool}") if os.access(p, os.X_OK)),
                                       None)
    if found is None:
        raise SystemExit(f"bench_delta: {tool} is not installed (apt-get install {tool_package(tool)})")
    return found


def tool_package(tool: str) -> str:
    return {"mksquashfs": "squashfs-tools"}.get(tool, tool)


# -- 1. the images ---------------------------------------------------------------------------------
def _wheel(cache: Path, name: str, version: str) -> Path | None:
    prefix = f"{name.replace('-', '_')}-{version}-".lower()
    found = sorted(p for p in cache.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def wheels(cache: Path, pins: dict[str, str]) -> list[Path]:
    """The pinned wheels, downloaded once into `cache` (no dependencies: the pins are the set)."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [f"{n}=={v}" for n, v in pins.items() if _wheel(cache, n, v) is None]
    if missing:
        log(f"downloading {len(missing)} wheels from PyPI into {cache}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--platform", "manylinux2014_x86_64", "--platform", "any",
                        "--dest", str(cache), *missing], check=True)
    out = []
    for n, v in pins.items():
        found = _wheel(cache, n, v)
        if found is None:
            raise SystemExit(f"bench_delta: no wheel of {n} {v} in {cache}")
        out.append(found)
    return out


def tree(work: Path, name: str, wheel_files: Sequence[Path]) -> Path:
    """A root filesystem: the wheels installed into usr/lib/python3/dist-packages."""
    root = work / name
    site = root / "usr" / "lib" / "python3" / "dist-packages"
    site.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                    "--no-index", "--target", str(site), *map(str, wheel_files)], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (root / "etc").mkdir()
    (root / "etc" / "os-release").write_text(f'NAME="bench"\nVERSION="{name}"\n')
    return root


def squashfs(root: Path, image: Path, base: Path | None = None) -> Path:
    """`root` (and `base`, the same in both versions, as its own top-level directory) as squashfs."""
    sources = [str(root), *([str(base)] if base is not None else [])]
    subprocess.run([need("mksquashfs"), *sources, str(image), "-noappend", "-no-progress", "-quiet", "-no-xattrs",
                    "-all-root", "-mkfs-time", "0", "-all-time", "0", "-comp", "gzip"], check=True,
                   stdout=subprocess.DEVNULL)
    return image


def images(work: Path, base: Path | None) -> tuple[Path, Path, dict[str, object]]:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edge-agent" / "bench-wheels"
    v1_pins = dict(V1)
    v2_pins = {n: V2_UPGRADES.get(n, v) for n, v in v1_pins.items() if n not in V2_REMOVED} | V2_ADDED
    img1 = squashfs(tree(work, "v1", wheels(cache, v1_pins)), work / "v1.img", base)
    img2 = squashfs(tree(work, "v2", wheels(cache, v2_pins)), work / "v2.img", base)
    changed = sorted(n for n in v2_pins if v1_pins.get(n) != v2_pins[n]) + [f"-{n}" for n in V2_REMOVED]
    return img1, img2, {"packages_v1": len(v1_pins), "packages_v2": len(v2_pins), "changed": changed,
                        "base_tree": str(base) if base is not None else None}


# -- 2. bytes ----------------------------------------------------------------------------------------
def ours(s1: SignedManifest, s2: SignedManifest) -> int:
    have = set(s1.manifest.chunks)
    layout = s2.manifest.layout()
    return sum(layout.length(i) for i, d in enumerate(s2.manifest.chunks) if d not in have) + s2.size


def casync_bytes(work: Path, img1: Path, img2: Path) -> int | None:
    casync = shutil.which("casync")
    if casync is None:
        log("casync is not installed (apt-get install casync): no casync baseline")
        return None
    s1, s2 = work / "casync-v1.castr", work / "casync-v2.castr"
    for store, index, image in ((s1, work / "v1.caibx", img1), (s2, work / "v2.caibx", img2)):
        subprocess.run([casync, "make", f"--store={store}", str(index), str(image)], check=True,
                       stdout=subprocess.DEVNULL)
    have = {p.name for p in s1.rglob("*.cacnk")}
    missing = sum(p.stat().st_size for p in s2.rglob("*.cacnk") if p.name not in have)
    return missing + (work / "v2.caibx").stat().st_size


def xdelta_bytes(work: Path, img1: Path, img2: Path) -> int | None:
    xdelta3 = shutil.which("xdelta3")
    if xdelta3 is None:
        log("xdelta3 is not installed (apt-get install xdelta3): no xdelta3 baseline")
        return None
    patch = work / "v1-v2.xdelta"
    subprocess.run([xdelta3, "-e", "-9", "-f", "-s", str(img1), str(img2), str(patch)], check=True)
    return patch.stat().st_size


# -- the leader in its own process -------------------------------------------------------------------
def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"bench_delta: a child exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_delta: nothing listens on port {port}")
        time.sleep(0.05)


class Leader:
    """`edge-agent run` as the leader: the artifact server on `http_port`, /metrics on `metrics_port`."""

    def __init__(self, work: Path, broker: int, public: Path, max_downloads: int) -> None:
        self.work = work
        self.http_port, self.metrics_port = free_port(), free_port()
        self.config = work / "leader.toml"
        self.config.write_text(
            f'[agent]\nrole = "leader"\ndevice_id = "gw"\nfleet = "bench"\ndata_dir = "{work / "gw"}"\n'
            f'[mqtt]\nurl = "mqtt://127.0.0.1:{broker}"\n[metrics]\nlisten = "127.0.0.1:{self.metrics_port}"\n'
            f'[firmware]\npublic_key = "{public}"\n'
            f'[artifacts]\nlisten = "127.0.0.1:{self.http_port}"\nmax_downloads = {max_downloads}\nretry_after_s = 1\n'
            # every simulated device is on 127.0.0.1: one address, given the whole bound
            f'max_downloads_per_address = {max_downloads}\n')
        out = (work / "leader.log").open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(self.config)],
                                     stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        out.close()
        wait_port(self.http_port, self.proc)
        # a worker per rollout to target (they pin no key: they take no update themselves)
        self.workers = []
        for tag in ("v2", "fleet"):
            worker = work / f"worker-{tag}.toml"
            worker.write_text(f'[agent]\nrole = "worker"\ndevice_id = "bench-{tag}"\nfleet = "bench"\n'
                              f'data_dir = "{work / tag}"\ntags = ["{tag}"]\n'
                              f'[mqtt]\nurl = "mqtt://127.0.0.1:{broker}"\n[heartbeat]\ninterval_s = 1.0\n')
            out = (work / f"worker-{tag}.log").open("ab")
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "run", "--config", str(worker)], stdout=out,
                stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}))
            out.close()
        deadline = time.monotonic() + 60
        while self._registered() < 2:
            if time.monotonic() > deadline:
                raise SystemExit("bench_delta: the workers never registered with the leader")
            time.sleep(0.2)

    def _registered(self) -> int:
        from agent.core.errors import StoreError
        from agent.leader.readonly import open_leader_db

        db = self.work / "gw" / "leader.db"
        if not db.exists():
            return 0
        try:
            with open_leader_db(db) as leader:
                return leader.registry.count()
        except StoreError:
            return 0

    def roll_out(self, artifact: Path, rollout_id: str) -> None:
        """Admit `artifact` into the leader's store (a rollout of it: nothing else serves it)."""
        spec = self.work / f"{rollout_id}.toml"
        spec.write_text(f'[rollout]\nname = "{rollout_id}"\nartifact = "{artifact}"\n[waves]\ncounts = [1]\n'
                        f'[targets]\nselect = "tags"\ntags = ["{rollout_id}"]\n[device]\ntimeout_s = 86400\n')
        subprocess.run([sys.executable, "-m", "agent.cli", "rollout", "start", str(spec), "--config",
                        str(self.config), "--id", rollout_id], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})

    def cpu_s(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return float(t.user + t.system)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    @property
    def mirror(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/artifacts"

    def stop(self) -> None:
        for proc in (*self.workers, self.proc):
            proc.send_signal(signal.SIGTERM)
        for proc in (*self.workers, self.proc):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- 3. a device assembling v2 -----------------------------------------------------------------------
async def assemble(work: Path, a1: Path, a2: Path, s2: SignedManifest, public: Path, mirror: str) -> dict[str, float]:
    """Install v1 from its artifact, commit it, then time the update to v2 from the leader."""
    from firmware_rollout.device.fallback import FallbackSource
    from firmware_rollout.device.http_source import MirrorSource, make_client

    key = load_verify_key(public)
    state = work / "device"

    async def boot() -> Updater:
        return await Updater.open(state, device_id="dev", verify_key=key, clock=SystemClock(), health=Healthy(),
                                  rebooter=NoReboot(), initial_version="1.0.0")

    updater = await boot()
    v1 = ArtifactChunkSource(a1)
    await updater.offer(UpdateOffer(rollout_id="v1", signed_manifest=v1.signed_manifest), v1)
    await updater.close()
    updater = await boot()
    await updater.resume()  # the trial boot of v1: committed
    await updater.close()
    updater = await boot()
    assert updater.active_version == "1.1.0", updater.status()
    client = make_client()
    source = MirrorSource(client, mirror, s2.manifest, s2.manifest.layout())
    chain = FallbackSource([("leader", source)], s2.manifest)
    cpu0, t0 = cpu_s(), time.perf_counter()
    await updater.offer(UpdateOffer(rollout_id="v2", signed_manifest=s2.raw), chain)
    wall, cpu = time.perf_counter() - t0, cpu_s() - cpu0
    state_now = updater.status().state
    detail = updater.status().detail
    await chain.aclose()
    await client.aclose()
    await updater.close()
    if state_now != "rebooting":
        raise SystemExit(f"bench_delta: the device's update to v2 ended {state_now}: {detail}")
    return {"device_wall_s": wall, "device_cpu_s": cpu, "device_fetched_bytes": float(source.bytes_received),
            "device_range_requests": float(source.requests)}


# -- 4. the leader's CPU per GB ------------------------------------------------------------------------
async def http_cost(leader: Leader, mirror: str, signed: SignedManifest, total_bytes: int) -> float:
    """Fetch the image in ranges of 8 MiB until `total_bytes`; the leader's CPU s per GB."""
    import httpx

    url = f"{mirror}/{signed.manifest.sha256.hex()}.eafw"
    size = signed.manifest.size
    got = 0
    cpu0 = leader.cpu_s()
    async with httpx.AsyncClient(timeout=60) as client:
        while got < total_bytes:
            for start in range(0, size, 8 << 20):
                end = min(size, start + (8 << 20)) - 1
                async with client.stream("GET", url, headers={"Range": f"bytes={signed.size + start}-"
                                                                       f"{signed.size + end}"}) as r:
                    async for block in r.aiter_raw():
                        got += len(block)
                if got >= total_bytes:
                    break
    return (leader.cpu_s() - cpu0) / (got / 1e9)


async def mqtt_cost(leader: Leader, broker: int, rollout_id: str, signed: SignedManifest, total_bytes: int) -> float:
    """Chunk requests of 128 KiB pieces over mosquitto, four in flight, like a device's window."""
    from agent.app import make_transport
    from agent.core.config import AgentConfig, convert
    from agent.core.errors import Capacity
    from agent.core.ids import IdGenerator
    from firmware_rollout.device.chunk_client import ChunkClient
    from firmware_rollout.messages import ChunkRequest

    clock = SystemClock()
    config = convert({"agent": {"role": "worker", "device_id": "bench-dev", "fleet": "bench"},
                      "mqtt": {"url": f"mqtt://127.0.0.1:{broker}", "reply_timeout_s": 30.0}}, AgentConfig,
                     source="bench")
    transport = make_transport(config, clock=clock)
    await transport.start()
    await transport.connected.wait_open()
    client = ChunkClient(transport, clock=clock, fleet="bench", device_id="bench-dev", ids=IdGenerator(clock))
    await client.start()
    layout = signed.manifest.layout()
    pieces = [(i, off, min(128 * 1024, layout.length(i) - off)) for i in range(signed.manifest.chunk_count)
              for off in range(0, layout.length(i), 128 * 1024)]
    got = 0
    cpu0 = leader.cpu_s()
    queue = list(pieces)

    async def lane() -> None:
        nonlocal got
        while got < total_bytes:
            if not queue:
                queue.extend(pieces)
            index, offset, length = queue.pop(0)
            try:
                chunk = await client.request(ChunkRequest(rollout_id=rollout_id, index=index, offset=offset,
                                                          length=length))
            except Capacity as exc:  # busy, or over this device's share of the intake: as a device does
                queue.insert(0, (index, offset, length))
                await asyncio.sleep(exc.retry_after_ms / 1000)
                continue
            got += len(chunk.data)

    await asyncio.gather(*(lane() for _ in range(4)))
    cost = (leader.cpu_s() - cpu0) / (got / 1e9)
    await client.stop()
    await transport.stop()
    return cost


# -- 5. a fleet downloading at once --------------------------------------------------------------------
async def fleet(mirror: str, signed: SignedManifest, devices: int) -> dict[str, float]:
    from agent.core.errors import Capacity
    from firmware_rollout.device.fallback import FallbackSource
    from firmware_rollout.device.http_source import MirrorSource, make_client

    manifest = signed.manifest
    layout = manifest.layout()
    busy = 0

    async def device(n: int) -> bool:
        nonlocal busy
        client = make_client(timeout_s=60)
        chain = FallbackSource([("leader", MirrorSource(client, mirror, manifest, layout))], manifest)
        whole = hashlib.sha256()
        try:
            for index in range(manifest.chunk_count):
                while True:
                    try:
                        whole.update(await chain.fetch(index))
                        break
                    except Capacity as exc:
                        busy += 1
                        await asyncio.sleep(exc.retry_after_ms / 1000 * random.uniform(0.5, 1.0))
        finally:
            await chain.aclose()
            await client.aclose()
        return whole.digest() == manifest.sha256

    t0 = time.perf_counter()
    results = await asyncio.gather(*(device(n) for n in range(devices)))
    return {"fleet_wall_s": time.perf_counter() - t0, "fleet_finished": float(sum(results)),
            "fleet_busy_answers_seen": float(busy)}


async def delta_fleet(mirror: str, s1: SignedManifest, s2: SignedManifest, devices: int) -> dict[str, float]:
    """`devices` devices with v1 each fetch the chunks of v2 they lack, all at once, from the
    leader's artifact server: the data plane of a delta rollout's wave of that size."""
    from agent.core.errors import Capacity
    from firmware_rollout.device.fallback import FallbackSource
    from firmware_rollout.device.http_source import MirrorSource, make_client

    manifest = s2.manifest
    layout = manifest.layout()
    have = set(s1.manifest.chunks)
    missing = [i for i, d in enumerate(manifest.chunks) if d not in have]
    client = make_client(timeout_s=120)  # one pool for the bench process; each device its own source
    fetched = 0

    async def device() -> bool:
        nonlocal fetched
        source = MirrorSource(client, mirror, manifest, layout)
        chain = FallbackSource([("leader", source)], manifest)
        chain.plan(missing)
        try:
            for index in missing:
                while True:
                    try:
                        data = await chain.fetch(index)  # not `fetched += await ...`: that reads before it awaits
                        fetched += len(data)
                        break
                    except Capacity as exc:
                        await asyncio.sleep(exc.retry_after_ms / 1000 * random.uniform(0.5, 1.0))
        finally:
            await chain.aclose()
        return chain.fetched_from["leader"] == len(missing)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(device() for _ in range(devices)))
    wall = time.perf_counter() - t0
    await client.aclose()
    return {"delta_fleet_wall_s": wall, "delta_fleet_finished": float(sum(results)),
            "delta_fleet_bytes": float(fetched), "delta_fleet_chunks_each": float(len(missing))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller fleet image and shorter cost runs")
    parser.add_argument("--devices", type=int, default=50)
    parser.add_argument("--fleet-mb", type=int, default=None, help="the fleet's image (default 200; quick 20)")
    parser.add_argument("--max-downloads", type=int, default=16, help="the leader's bound")
    parser.add_argument("--delta-devices", type=int, default=None,
                        help="devices fetching the v1 -> v2 delta at once (default 1000; quick 200)")
    parser.add_argument("--base-tree", type=Path, default=None,
                        help="a directory of real files both versions hold unchanged (e.g. /usr/share), for an"
                             " image of a device's size (default: /usr/share without --quick, none with it)")
    args = parser.parse_args()
    fleet_mb = args.fleet_mb or (20 if args.quick else 200)
    delta_devices = args.delta_devices or (200 if args.quick else 1000)
    base = args.base_tree
    if base is None and not args.quick and Path("/usr/share").is_dir():
        base = Path("/usr/share")
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        work = Path(tmp)
        log("building the v1 and v2 images")
        img1, img2, contents = images(work, base)
        paths = generate_keypair(work / "keys")
        key = load_signing_key(paths.private)
        cdc = ContentDefined()
        t0 = time.perf_counter()
        s1 = build_artifact(img1, work / "v1.eafw", name="rootfs", version="1.1.0", key=key, created_ts=0,
                            content_defined=cdc)
        s2 = build_artifact(img2, work / "v2.eafw", name="rootfs", version="1.2.0", key=key, created_ts=0,
                            content_defined=cdc)
        build_s = time.perf_counter() - t0
        full = s2.manifest.size
        delta = ours(s1, s2)
        log("casync and xdelta3 baselines")
        casync = casync_bytes(work, img1, img2)
        xdelta = xdelta_bytes(work, img1, img2)
        fleet_image = work / "fleet.img"
        fleet_image.write_bytes(random.Random(7).randbytes(fleet_mb << 20))
        sf = build_artifact(fleet_image, work / "fleet.eafw", name="rootfs", version="2.0.0", key=key, created_ts=0,
                            content_defined=cdc)
        with mosquitto(work) as broker:
            leader = Leader(work, broker, paths.public, args.max_downloads)
            try:
                leader.roll_out(work / "v2.eafw", "v2")
                leader.roll_out(work / "fleet.eafw", "fleet")
                log("a device assembling v2 from v1 and the leader's artifact server")
                device = asyncio.run(assemble(work, work / "v1.eafw", work / "v2.eafw", s2, paths.public,
                                              leader.mirror))
                cost_bytes = (256 if args.quick else 1024) << 20
                log(f"the leader's CPU for {cost_bytes >> 20} MiB over HTTP and {cost_bytes >> 22} MiB over MQTT")
                http = asyncio.run(http_cost(leader, leader.mirror, sf, cost_bytes))
                mqtt = asyncio.run(mqtt_cost(leader, broker, "fleet", sf, cost_bytes // 4))
                log(f"{args.devices} devices downloading {fleet_mb} MB at once")
                fleet_figures = asyncio.run(fleet(leader.mirror, sf, args.devices))
                max_concurrent = leader.metric("ea_artifact_http_downloads_max")
                busy_total = leader.metric("ea_artifact_http_busy_total")
                log(f"{delta_devices} devices fetching the v1 -> v2 delta at once")
                delta_figures = asyncio.run(delta_fleet(leader.mirror, s1, s2, delta_devices))
                max_concurrent = max(max_concurrent, leader.metric("ea_artifact_http_downloads_max"))
            finally:
                leader.stop()
    result: dict[str, object] = {
        "quick": args.quick,
        "content": contents,
        "full_bytes": full,
        "delta_bytes": delta,
        "casync_bytes": casync,
        "xdelta3_bytes": xdelta,
        "delta_vs_full": delta / full,
        "delta_vs_casync": delta / casync if casync else None,
        "delta_vs_xdelta3": delta / xdelta if xdelta else None,
        "chunks_v2": s2.manifest.chunk_count,
        "manifest_bytes_v2": s2.size,
        "build_s_both": build_s,
        **device,
        "leader_cpu_s_per_gb_http": http,
        "leader_cpu_s_per_gb_mqtt": mqtt,
        "http_vs_mqtt_cpu": http / mqtt,
        "fleet_devices": args.devices,
        "fleet_image_mb": fleet_mb,
        **fleet_figures,
        "fleet_max_concurrent": max_concurrent,
        "fleet_bound": args.max_downloads,
        "fleet_busy_answers": busy_total,
        "delta_fleet_devices": delta_devices,
        **delta_figures,
    }
    result["targets"] = {
        "delta_vs_casync<=1.2": casync is not None and delta / casync <= 1.2,
        "delta_vs_full<=0.25": delta / full <= 0.25,
        "http_cpu<=mqtt_cpu/10": http <= mqtt / 10,
        "fleet_all_finished": fleet_figures["fleet_finished"] == args.devices,
        "fleet_within_bound": max_concurrent <= args.max_downloads,
        "delta_fleet_all_finished": delta_figures["delta_fleet_finished"] == delta_devices,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
