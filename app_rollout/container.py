"""A container application: what its signed manifest says of the container, and the unit the
device runs it with.

A container application's bundle carries its image as an OCI archive (a file of the bundle, so
it is fetched by chunks like any large file: a new version fetches the layers that changed) and
a `ContainerSpec` read from its compose file when the bundle is built (`app_rollout.compose`).
The device never reads the compose file: it renders the podman command from the typed, bounded
spec, so what an application may ask for is what these types can say. There is no host path,
no capability, no device and no host network among them: a container's data lives in named
volumes (`edge-app-NAME-VOLUME`, kept across versions and when the application is removed), its
ports are published on addresses of the host's, and it runs with no new privileges.

The unit follows `podman generate systemd --new`: podman runs the container detached under
conmon, tells systemd when it is up (`--sdnotify=conmon`, Type=notify), and the stop removes it,
so systemd's state (active, restarts) is the container's and the helper checks it as it checks
a service. The image is run by its ID (the config's digest the manifest signs), never pulled.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from app_rollout.errors import MalformedBundle
from app_rollout.fields import FilePath, Sha256Hex

PODMAN = "/usr/bin/podman"
CONTAINER_ID_FILE = "%t/%n.ctr-id"
# a path inside the container: absolute, no `..`, printable, no quote or specifier
ContainerPath = Annotated[str, msgspec.Meta(max_length=255,
                                             pattern=r"^(/(?!\.\.?(/|$))[A-Za-z0-9_.+@-]{1,64}){1,16}$|^/$")]
Arg = Annotated[str, msgspec.Meta(max_length=1024, pattern=r"^[^\x00-\x1f\x7f]*$")]
EnvName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
VolumeName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")]
_ID = r"([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10})"
UserSpec = Annotated[str, msgspec.Meta(pattern=rf"^{_ID}(:{_ID})?$")]
HostIp = Annotated[str, msgspec.Meta(pattern=r"^([0-9]{1,3}(\.[0-9]{1,3}){3}|\[?[0-9a-fA-F:]{2,39}\]?)?$")]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=3600)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_ARCHES = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "armv6l": "arm"}


class PublishedPort(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    host: Port
    container: Port
    host_ip: HostIp = ""  # "": every address of the host's
    protocol: Literal["tcp", "udp"] = "tcp"


class NamedVolume(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    name: VolumeName  # the device's volume is edge-app-NAME-{name}: the application's data
    target: ContainerPath
    read_only: bool = False


class ContainerHealth(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The image's own health check as compose says it (`healthcheck:`)."""

    test: Annotated[tuple[Arg, ...], msgspec.Meta(min_length=1, max_length=32)]  # argv ("CMD" form)
    shell: bool = False  # "CMD-SHELL": test[0] is one shell command line
    interval_s: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 30.0
    timeout_s: Annotated[float, msgspec.Meta(ge=1, le=600)] = 30.0
    retries: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    start_period_s: Seconds = 0.0


class ContainerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    image: FilePath  # the bundle's file holding the image (an OCI archive)
    image_id: Sha256Hex  # its config's digest: the ID the runtime gives the loaded image
    architecture: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9]{1,16}$")] = ""
    entrypoint: Annotated[tuple[Arg, ...], msgspec.Meta(max_length=64)] | None = None  # None: the image's
    command: Annotated[tuple[Arg, ...], msgspec.Meta(max_length=64)] | None = None  # None: the image's
    environment: Annotated[dict[EnvName, Arg], msgspec.Meta(max_length=64)] = {}
    ports: Annotated[tuple[PublishedPort, ...], msgspec.Meta(max_length=16)] = ()
    volumes: Annotated[tuple[NamedVolume, ...], msgspec.Meta(max_length=16)] = ()
    tmpfs: Annotated[tuple[ContainerPath, ...], msgspec.Meta(max_length=8)] = ()
    network: Literal["bridge", "none"] = "bridge"
    user: UserSpec | Literal[""] = ""
    working_dir: ContainerPath | Literal[""] = ""
    read_only: bool = False
    healthcheck: ContainerHealth | None = None
    restart: Literal["no", "on-failure", "always"] = "on-failure"
    memory_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    cpus: Annotated[float, msgspec.Meta(ge=0, le=256)] = 0.0
    pids_limit: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    stop_signal: Annotated[str, msgspec.Meta(pattern=r"^(SIG)?[A-Z0-9+]{2,12}$")] | Literal[""] = ""
    stop_grace_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 10.0


def check_container(spec: ContainerSpec, files: frozenset[str], *, source: str) -> None:
    """What a spec must also be beside its bundle's `files` (their paths): its image one of
    them, each volume and port once, a container path mounted once."""
    if spec.image not in files:
        raise MalformedBundle(f"{source}: container.image {spec.image!r}: not a file of the bundle")
    names = [v.name for v in spec.volumes]
    if len(set(names)) != len(names):
        raise MalformedBundle(f"{source}: container.volumes: volume {sorted(n for n in names if names.count(n) > 1)[0]}"
                              " is mounted twice")
    targets = [v.target for v in spec.volumes] + list(spec.tmpfs)
    if len(set(targets)) != len(targets):
        raise MalformedBundle(f"{source}: container: {sorted(t for t in targets if targets.count(t) > 1)[0]} is"
                              " mounted twice")
    published = [(p.host_ip, p.host, p.protocol) for p in spec.ports]
    if len(set(published)) != len(published):
        raise MalformedBundle(f"{source}: container.ports: a host port is published twice")
    if spec.network == "none" and spec.ports:
        raise MalformedBundle(f"{source}: container: a container with no network publishes no port")


def device_architecture(machine: str) -> str:
    """The OCI architecture of a kernel's machine name (`uname -m`)."""
    return _ARCHES.get(machine, machine)


def volume_name(app: str, volume: str) -> str:
    return f"edge-app-{app}-{volume}"


def container_name(app: str) -> str:
    return f"edge-app-{app}"


def _quoted(arg: str) -> str:
    """`arg` as one word of a unit's command line: quoted, with systemd's specifiers and
    variables escaped (so `$HOME` and `%h` reach the container as written)."""
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def run_arguments(spec: ContainerSpec, *, app: str, version: str, runtime: str = PODMAN) -> list[str]:
    """The `podman run` command line of the container of `app` at `version`."""
    argv = [runtime, "run", f"--cidfile={CONTAINER_ID_FILE}", "--cgroups=no-conmon", "--rm", "--sdnotify=conmon",
            "-d", "--replace", f"--name={container_name(app)}", "--pull=never", "--security-opt=no-new-privileges",
            f"--label=edge-agent.app={app}", f"--label=edge-agent.version={version}", "--log-driver=journald",
            f"--network={spec.network}"]
    for port in spec.ports:
        host_ip = f"{port.host_ip}:" if port.host_ip else ""
        argv.append(f"--publish={host_ip}{port.host}:{port.container}/{port.protocol}")
    for volume in spec.volumes:
        argv.append(f"--volume={volume_name(app, volume.name)}:{volume.target}{':ro' if volume.read_only else ''}")
    argv += [f"--tmpfs={path}" for path in spec.tmpfs]
    if spec.user:
        argv.append(f"--user={spec.user}")
    if spec.working_dir:
        argv.append(f"--workdir={spec.working_dir}")
    if spec.read_only:
        argv.append("--read-only")
    if spec.memory_bytes:
        argv.append(f"--memory={spec.memory_bytes}")
    if spec.cpus:
        argv.append(f"--cpus={spec.cpus:g}")
    if spec.pids_limit:
        argv.append(f"--pids-limit={spec.pids_limit}")
    if spec.stop_signal:
        argv.append(f"--stop-signal={spec.stop_signal}")
    argv.append(f"--stop-timeout={int(spec.stop_grace_s)}")
    health = spec.healthcheck
    if health is not None:
        test = health.test[0] if health.shell else msgspec.json.encode(list(health.test)).decode()
        argv += [f"--health-cmd={test}", f"--health-interval={_duration(health.interval_s)}",
                 f"--health-timeout={_duration(health.timeout_s)}", f"--health-retries={health.retries}",
                 f"--health-start-period={_duration(health.start_period_s)}"]
    argv += [f"--env={key}={value}" for key, value in sorted(spec.environment.items())]
    argv += [f"--env=APP_NAME={app}", f"--env=APP_VERSION={version}"]
    if spec.entrypoint is not None:
        argv.append(f"--entrypoint={msgspec.json.encode(list(spec.entrypoint)).decode()}")
    argv.append(spec.image_id)
    if spec.command is not None:
        argv += list(spec.command)
    return argv


def render_container_unit(spec: ContainerSpec, *, app: str, version: str, runtime: str = PODMAN) -> str:
    """The unit the device installs as `edge-app-NAME.service` for a container application."""
    argv = run_arguments(spec, app=app, version=version, runtime=runtime)
    fixed = argv[:3]  # the runtime, "run" and the container ID file (`%t/%n`: systemd's specifiers)
    run = " ".join([*fixed, *(_quoted(a) for a in argv[3:])])
    return "\n".join([
        f"# edge-app-{app}.service: application {app} {version} (container), written by edge-agent (do not edit)",
        "[Unit]",
        f"Description=application {app} {version} (container)",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Environment=PODMAN_SYSTEMD_UNIT=%n",
        f"Restart={spec.restart}",
        "RestartSec=5",
        f"TimeoutStopSec={int(spec.stop_grace_s) + 60}",
        "TimeoutStartSec=600",
        f"ExecStartPre=/bin/rm -f {CONTAINER_ID_FILE}",
        f"ExecStart={run}",
        f"ExecStop={runtime} stop --ignore -t {int(spec.stop_grace_s)} --cidfile={CONTAINER_ID_FILE}",
        f"ExecStopPost={runtime} rm -f --ignore -t {int(spec.stop_grace_s)} --cidfile={CONTAINER_ID_FILE}",
        "Type=notify",
        "NotifyAccess=all",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        ""])


__all__ = ["PODMAN", "ContainerHealth", "ContainerSpec", "NamedVolume", "PublishedPort", "check_container",
           "container_name", "device_architecture", "render_container_unit", "run_arguments", "volume_name"]
