"""Container applications: a bundle is built from a compose file and an OCI archive into a spec
the device renders (never the compose file); what would reach the host (its root, the agent's
data, privileges, its network) is refused in one line with nothing written; an archive whose
bytes are not its digests is refused; the helper loads the image and checks its ID with the real
podman, runs it by that ID, and removes an image only when no kept version uses it."""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

import msgspec
import pytest
from apps_support import fleet_key
from test_app_helper import RecordingSystemd

from app_rollout.bundle import build_bundle, read_bundle
from app_rollout.container import ContainerSpec, render_container_unit
from app_rollout.device.containers import Containers
from app_rollout.device.helper import AppHelper, AppRequest, encode
from app_rollout.errors import AppBundleError, AppInstallError, MalformedBundle
from app_rollout.oci import read_archive
from tests.oci_images import BUSYBOX, COMPOSE, REF, web_app

pytestmark = pytest.mark.skipif(not BUSYBOX.is_file(), reason="needs Debian's busybox-static (scripts/test.sh)")


def test_a_container_bundle_carries_the_spec_of_its_compose_service_and_its_image_id(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    src = web_app(tmp_path, "1.0.0", healthy=True)
    built = build_bundle(src, key, tmp_path / "web.eaapp")
    m = read_bundle(tmp_path / "web.eaapp", key.public).manifest
    assert (m.runtime, m.unit, built.unit) == ("container", "", None)
    spec = m.container
    assert spec is not None
    assert spec.image == "images/web.tar"
    assert spec.image_id == read_archive(src / "files" / "images" / "web.tar", source="web.tar").image_id
    assert (spec.network, spec.architecture, spec.environment) == ("none", "amd64", {"GREETING": "hello from 1.0.0"})
    assert [(v.name, v.target) for v in spec.volumes] == [("data", "/data")]
    assert spec.healthcheck is not None and spec.healthcheck.test[0] == "wget"
    assert (spec.healthcheck.interval_s, spec.healthcheck.retries) == (10.0, 3)
    unit = render_container_unit(spec, app="web", version="1.0.0")
    start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert start.startswith("ExecStart=/usr/bin/podman run ")
    for word in ('"--pull=never"', '"--name=edge-app-web"', '"--network=none"', '"--volume=edge-app-web-data:/data"',
                 '"--security-opt=no-new-privileges"', f'"{spec.image_id}"', '"echo $$APP_VERSION >> /data/starts;'):
        assert word in start, word
    assert "Type=notify" in unit and "--cidfile=%t/%n.ctr-id" in unit
    assert "ExecStartPre=/bin/rm -f %t/%n.ctr-id" in unit  # (a container killed on its stop leaves it)


REFUSED = [
    ("volumes:\n      - /:/host", "services.web.volumes: /:/host: mounts the host's root"),
    ("volumes:\n      - /var/lib/edge-agent:/agent", "mounts the agent's data"),
    ("volumes:\n      - ./here:/here", "./here:/here: mounts a host path"),
    ("volumes:\n      - type: bind\n        source: /etc\n        target: /etc", "a bind mount is not taken"),
    ("privileged: true", "services.web.privileged: not taken: an application runs with no privileges"),
    ("cap_add: [NET_ADMIN]", "services.web.cap_add: not taken: an application gains no capability"),
    ("devices: ['/dev/mem:/dev/mem']", "services.web.devices: not taken"),
    ("pid: host", "services.web.pid: not taken"),
]


@pytest.mark.parametrize(("extra", "said"), REFUSED)
def test_a_compose_service_that_reaches_the_host_is_refused_in_one_line_with_nothing_written(
        tmp_path: Path, extra: str, said: str) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    src = web_app(tmp_path, "1.0.0", healthy=True)
    mounts = "    network_mode: none\n    volumes:\n      - data:/data\n"
    compose = COMPOSE.format(ref=REF, version="1.0.0").replace(mounts, f"    {extra}\n")
    (src / "compose.yaml").write_text(compose)
    with pytest.raises(AppBundleError) as refused:
        build_bundle(src, key, tmp_path / "web.eaapp")
    assert said in str(refused.value) and str(src / "compose.yaml") in str(refused.value)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "web.eaapp").exists()


@pytest.mark.parametrize(("change", "said"), [
    (lambda c: c.replace("network_mode: none", "network_mode: host"), "network_mode 'host': bridge or none"),
    (lambda c: c.replace("services:\n", "services:\n  db:\n    image: x\n"),
     "2 services: an application is one service"),
    (lambda c: c.replace(f"image: {REF}:1.0.0", "image: docker.io/library/nginx"),
     "image 'docker.io/library/nginx': not an image of the bundle (app.toml's [images] names localhost/web:1.0.0)"),
    (lambda c: c.replace("      - data:/data", "      - cache:/cache"),
     "volume 'cache' is not declared under the file's top-level volumes"),
    (lambda c: c.replace("interval: 10s", "interval: soon"), "healthcheck.interval: 'soon': a duration"),
])
def test_a_compose_file_the_device_could_not_run_as_written_is_refused(tmp_path: Path, change, said: str) -> None:  # type: ignore[no-untyped-def]
    key, _, _ = fleet_key(tmp_path / "keys")
    src = web_app(tmp_path, "1.0.0", healthy=True)
    (src / "compose.yaml").write_text(change(COMPOSE.format(ref=REF, version="1.0.0")))
    with pytest.raises(AppBundleError, match="compose.yaml") as refused:
        build_bundle(src, key, tmp_path / "web.eaapp")
    assert said in str(refused.value)


def test_an_archive_whose_layer_is_not_its_digest_is_refused(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    src = web_app(tmp_path, "1.0.0", healthy=True)
    archive = src / "files" / "images" / "web.tar"
    data = bytearray(archive.read_bytes())
    at = data.index(b"web 1.0.0")  # (the application layer's index.html)
    data[at:at + 3] = b"WEB"
    archive.write_bytes(bytes(data))
    with pytest.raises(MalformedBundle, match="its bytes have another digest"):
        build_bundle(src, key, tmp_path / "web.eaapp")
    with tarfile.open(archive, "w") as tar:  # not an OCI layout at all
        tar.add(src / "compose.yaml", "compose.yaml")
    with pytest.raises(MalformedBundle, match="not an OCI archive"):
        build_bundle(src, key, tmp_path / "web.eaapp")


def test_a_spec_that_could_name_a_host_path_does_not_decode() -> None:
    base = {"image": "images/web.tar", "image_id": "a" * 64}
    for bad in ({"volumes": [{"name": "/etc", "target": "/etc"}]}, {"volumes": [{"name": "d", "target": "/../x"}]},
                {"network": "host"}, {"tmpfs": ["relative"]}, {"user": "root; rm -rf /"}, {"privileged": True}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({**base, **bad}, type=ContainerSpec)


class RecordingContainers(Containers):
    """The runtime's answers where no container can run (this machine's sandbox): loads are
    recorded, the health check answers `healthy` (the board test runs the real podman)."""

    def __init__(self) -> None:
        super().__init__(via=())
        self.loaded: list[str] = []
        self.forgotten: list[str] = []
        self.healthy = True

    def load(self, archive: Path, image_id: str, *, what: str) -> None:
        assert archive.is_file()
        self.loaded.append(image_id)

    async def healthcheck(self, app: str, *, timeout_s: float) -> tuple[int, str]:
        return (0, "") if self.healthy else (1, "unhealthy")

    async def forget(self, image_id: str) -> None:
        self.forgotten.append(image_id)


async def test_the_helper_runs_the_image_by_its_id_and_removes_an_image_no_kept_version_uses(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    runtime = RecordingContainers()
    helper = AppHelper(key=key.public, root=tmp_path / "apps", unit_dir=tmp_path / "units", hidden=(),
                       systemd=RecordingSystemd(), containers=runtime, durable=False)

    async def ask(op: str, name: str = "", **fields: object) -> str:
        reply = await helper.handle(encode(AppRequest(op=op, name=name, **fields)), 0)  # type: ignore[arg-type]
        return reply.error or str(reply.exit_code)

    ids = {}
    for version in ("1.0.0", "2.0.0", "3.0.0"):
        src = web_app(tmp_path, version, healthy=version != "3.0.0")
        build_bundle(src, key, tmp_path / f"web-{version}.eaapp")
        ids[version] = read_archive(src / "files" / "images" / "web.tar", source="web").image_id
        assert await ask("install", path=str(tmp_path / f"web-{version}.eaapp")) == "0"
    assert runtime.loaded == [ids["1.0.0"], ids["2.0.0"], ids["3.0.0"]]
    for version in ("1.0.0", "2.0.0"):
        assert await ask("start", "web", version=version) == "0"
        assert ids[version] in (tmp_path / "units" / "edge-app-web.service").read_text()
        assert await ask("check", "web") == "0"  # the container's own health check
        assert await ask("commit", "web") == "0"
    assert runtime.forgotten == []  # 1.0.0 is kept to go back to
    assert await ask("start", "web", version="3.0.0") == "0"
    runtime.healthy = False
    assert await ask("check", "web") == "1"
    assert await ask("revert", "web") == "0"
    assert runtime.forgotten == [ids["3.0.0"]]
    assert ids["2.0.0"] in (tmp_path / "units" / "edge-app-web.service").read_text()
    src = web_app(tmp_path, "4.0.0", healthy=True)
    shutil.copy(tmp_path / "web-2.0.0" / "files" / "images" / "web.tar", src / "files" / "images" / "web.tar")
    built = build_bundle(src, key, tmp_path / "web-4.0.0.eaapp")  # (2.0.0's image, another environment)
    assert built.manifest.container is not None and built.manifest.container.image_id == ids["2.0.0"]
    assert await ask("install", path=str(tmp_path / "web-4.0.0.eaapp")) == "0"
    assert await ask("start", "web", version="4.0.0") == "0"
    runtime.healthy = True
    assert await ask("commit", "web") == "0"  # 1.0.0 goes; 2.0.0, kept, shares its image with 4.0.0
    assert runtime.forgotten == [ids["3.0.0"], ids["1.0.0"]]


@pytest.mark.skipif(not shutil.which("podman") or os.geteuid() != 0, reason="needs Debian's podman, as root")
def test_podman_loads_the_archive_and_an_image_of_another_id_is_refused(tmp_path: Path) -> None:
    src = web_app(tmp_path, "1.0.0", healthy=True)
    archive = src / "files" / "images" / "web.tar"
    image_id = read_archive(archive, source="web.tar").image_id
    runtime = Containers(shutil.which("podman") or "podman", via=())  # (no systemd here to run it beside)
    runtime.load(archive, image_id, what="install web 1.0.0")  # real podman: loaded, the ID checked
    with pytest.raises(AppInstallError, match="the archive's image is not sha256:"):
        runtime.load(archive, "0" * 64, what="install web 1.0.0")
    with pytest.raises(AppInstallError, match="not installed: this device runs no container application"):
        Containers(str(tmp_path / "no-podman"), via=()).load(archive, image_id, what="install web 1.0.0")


class FlakyContainers(RecordingContainers):
    """A container whose health check fails `failing` times first (its image's start period)."""

    def __init__(self, failing: int) -> None:
        super().__init__()
        self.failing = failing
        self.asked = 0

    async def healthcheck(self, app: str, *, timeout_s: float) -> tuple[int, str]:
        self.asked += 1
        return (1, "starting") if self.asked <= self.failing else (0, "")


@pytest.mark.parametrize(("failing", "outcome"), [(2, "succeeded"), (10_000, "failed")])
async def test_a_container_is_healthy_once_its_own_check_passes_within_the_timeout(
        tmp_path: Path, failing: int, outcome: str) -> None:
    from test_app_module import local_fetch

    from agent.core.clock import SystemClock
    from app_rollout.bundle import read_head
    from app_rollout.device.client import InProcessHelper
    from app_rollout.device.module import AppModule
    from app_rollout.messages import AppOffer

    key, _, _ = fleet_key(tmp_path / "keys")
    runtime = FlakyContainers(failing)
    helper = AppHelper(key=key.public, root=tmp_path / "apps", unit_dir=tmp_path / "units", hidden=(),
                       systemd=RecordingSystemd(), containers=runtime, durable=False)
    store = tmp_path / "store"
    store.mkdir()
    clock = SystemClock()
    module = AppModule(InProcessHelper(helper, clock=clock), key=key.public, state_dir=tmp_path / "state",
                       clock=clock, fetch=local_fetch(store))
    built = tmp_path / "web.eaapp"
    build_bundle(web_app(tmp_path, "1.0.0", healthy=True, settle_s=0, timeout_s=3 if failing > 2 else 600), key, built)
    shutil.copyfile(built, store / f"{1:064x}.eaapp")
    offer = AppOffer(rollout_id="r1", head=read_head(built), bundle=f"{1:064x}", size=built.stat().st_size)
    said: list[tuple[str, str]] = []

    async def report(rollout_id: str, version: str, state: str, phase: str, detail: str, *,
                     until_ms: int = 0) -> None:
        said.append((state, detail))

    await module.apply(offer, module.check(offer), report)
    assert said[-1][0] == outcome
    if outcome == "failed":
        assert "its container's healthcheck did not pass within 3s (last exit 1: starting)" in said[-1][1]
    else:
        assert runtime.asked == 3


@pytest.mark.skipif(not shutil.which("systemd-analyze") or not Path("/usr/bin/podman").is_file(),
                    reason="needs systemd-analyze and podman")
def test_systemd_analyze_verify_says_nothing_about_a_container_unit(tmp_path: Path) -> None:
    import subprocess

    key, _, _ = fleet_key(tmp_path / "keys")
    built = build_bundle(web_app(tmp_path, "1.0.0", healthy=True), key, tmp_path / "web.eaapp")
    assert built.manifest.container is not None
    unit = tmp_path / "edge-app-web.service"
    unit.write_text(render_container_unit(built.manifest.container, app="web", version="1.0.0"))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=120)
    assert "edge-app-web" not in proc.stdout + proc.stderr and proc.returncode == 0, proc.stdout + proc.stderr
