"""A compose file read into a container application's spec, when its bundle is built.

A container application is one compose service. `container_spec` takes the keys a device may
run and nothing else, in one line naming the file and the key:

    image            a reference app.toml's [images] names (an OCI archive of the bundle's files)
    command, entrypoint, environment, ports, volumes (named volumes), tmpfs, network_mode
    (bridge or none), user, working_dir, read_only, healthcheck, restart, mem_limit, cpus,
    pids_limit, stop_signal, stop_grace_period

So a compose file that mounts a host path (the host's root, the agent's data, a socket), asks
for privileges, capabilities or devices, or shares the host's network, PIDs or IPC is refused
when the bundle is built: its spec could not say it, and the device renders only the spec.
PyYAML is imported here only: `app build` of a container application needs it
(`edge-agent[cli]`), nothing else does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from app_rollout.container import ContainerSpec
from app_rollout.errors import AppBundleError
from app_rollout.oci import read_archive

TAKEN = ("image", "command", "entrypoint", "environment", "ports", "volumes", "tmpfs", "network_mode", "user",
         "working_dir", "read_only", "healthcheck", "restart", "mem_limit", "cpus", "pids_limit", "stop_signal",
         "stop_grace_period")
_WHY_NOT = {
    "privileged": "an application runs with no privileges", "cap_add": "an application gains no capability",
    "devices": "an application opens no device of the host's", "pid": "an application sees only its own processes",
    "ipc": "an application shares no IPC with the host", "userns_mode": "an application keeps its user namespace",
    "security_opt": "the device sets the container's security options",
    "sysctls": "an application changes no kernel setting", "cgroup_parent": "the device places the container",
    "container_name": "the device names the container edge-app-NAME", "volumes_from": "an application mounts only"
                                                                                      " its own volumes",
    "build": "a bundle carries a built image ([images] in app.toml)", "depends_on": "an application is one service",
}
_DURATION = re.compile(r"^((?P<h>[0-9]+)h)?((?P<m>[0-9]+)m(?!s))?((?P<s>[0-9.]+)s)?((?P<ms>[0-9]+)ms)?$")
_MEMORY = re.compile(r"^(?P<n>[0-9]+)(?P<unit>[bkmg]?)b?$", re.IGNORECASE)
_PORT = re.compile(r"^((?P<ip>[0-9.]+|\[[0-9a-fA-F:]+\]):)?(?P<host>[0-9]{1,5}):(?P<container>[0-9]{1,5})"
                   r"(/(?P<proto>tcp|udp))?$")
_AGENT_PATHS = ("/var/lib/edge-agent", "/etc/edge-agent", "/run/edge-agent")


def _seconds(value: object, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.match(str(value)) if value else None
    if match is None:
        raise AppBundleError(f"{where}: {value!r}: a duration such as 30s, 1m30s or 500ms")
    parts = match.groupdict()
    return (float(parts["h"] or 0) * 3600 + float(parts["m"] or 0) * 60 + float(parts["s"] or 0)
            + float(parts["ms"] or 0) / 1000)


def _words(value: object, where: str) -> list[str]:
    if isinstance(value, str):
        import shlex

        try:
            return shlex.split(value)
        except ValueError as exc:
            raise AppBundleError(f"{where}: {exc}") from None
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value]
    raise AppBundleError(f"{where}: a string or a list of strings")


def _environment(value: object, where: str) -> dict[str, str]:
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    if isinstance(value, list):
        pairs = {}
        for item in value:
            key, eq, val = str(item).partition("=")
            if not eq:
                raise AppBundleError(f"{where}: {item!r}: KEY=value (a variable of the host's is not passed in)")
            pairs[key] = val
        return pairs
    raise AppBundleError(f"{where}: a mapping or a list of KEY=value")


def _ports(value: object, where: str) -> list[dict[str, object]]:
    if not isinstance(value, list):
        raise AppBundleError(f"{where}: a list")
    ports: list[dict[str, object]] = []
    for item in value:
        if isinstance(item, dict):
            unknown = set(item) - {"target", "published", "host_ip", "protocol", "mode"}
            if unknown:
                raise AppBundleError(f"{where}: {sorted(unknown)[0]}: a port takes target, published, host_ip,"
                                     " protocol")
            if "published" not in item:
                raise AppBundleError(f"{where}: {item!r}: a port names the host's port (published)")
            ports.append({"host": int(item["published"]), "container": int(item["target"]),
                          "host_ip": str(item.get("host_ip", "")), "protocol": str(item.get("protocol", "tcp"))})
            continue
        match = _PORT.match(str(item))
        if match is None:
            raise AppBundleError(f"{where}: {item!r}: HOST:CONTAINER, IP:HOST:CONTAINER, with /tcp or /udp (a"
                                 " published port names the host's port)")
        ports.append({"host": int(match["host"]), "container": int(match["container"]),
                      "host_ip": match["ip"] or "", "protocol": match["proto"] or "tcp"})
    return ports


def _volumes(value: object, where: str, declared: set[str]) -> tuple[list[dict[str, object]], list[str]]:
    """Named volumes, and tmpfs mounts given as volumes of type tmpfs."""
    if not isinstance(value, list):
        raise AppBundleError(f"{where}: a list")
    volumes: list[dict[str, object]] = []
    tmpfs: list[str] = []
    for item in value:
        if isinstance(item, dict):
            kind = item.get("type", "volume")
            source, target = str(item.get("source", "")), str(item.get("target", ""))
            read_only = bool(item.get("read_only", False))
            if kind == "tmpfs":
                tmpfs.append(target)
                continue
            if kind != "volume":
                raise AppBundleError(f"{where}: {source or item!r}: a {kind} mount is not taken: an application"
                                     " keeps its data in named volumes")
        else:
            source, _, rest = str(item).partition(":")
            target, _, options = rest.partition(":")
            read_only = "ro" in options.split(",")
            if not target:
                raise AppBundleError(f"{where}: {item!r}: NAME:/path (an anonymous volume is not kept across versions)")
        if source.startswith(("/", ".", "~")) or "$" in source:
            seen = ("the host's root" if source.rstrip("/") == "" else
                    "the agent's data" if source.startswith(_AGENT_PATHS) else "a host path")
            raise AppBundleError(f"{where}: {source}:{target}: mounts {seen}: an application keeps its data in named"
                                 " volumes (NAME:/path)")
        if source not in declared:
            raise AppBundleError(f"{where}: volume {source!r} is not declared under the file's top-level volumes")
        volumes.append({"name": source, "target": target, "read_only": read_only})
    return volumes, tmpfs


def _healthcheck(value: object, where: str) -> dict[str, object] | None:
    if not isinstance(value, dict):
        raise AppBundleError(f"{where}: a mapping")
    unknown = set(value) - {"test", "interval", "timeout", "retries", "start_period", "disable", "start_interval"}
    if unknown:
        raise AppBundleError(f"{where}: {sorted(unknown)[0]}: not a key of a health check")
    if value.get("disable"):
        return None
    test = value.get("test")
    if isinstance(test, str):
        words, shell = [test], True
    elif isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL", "NONE"):
        if test[0] == "NONE":
            return None
        words, shell = [str(t) for t in test[1:]], test[0] == "CMD-SHELL"
        if shell:
            words = [" ".join(words)]
    else:
        raise AppBundleError(f"{where}.test: [\"CMD\", ...], [\"CMD-SHELL\", \"...\"] or a shell command line")
    check: dict[str, object] = {"test": words, "shell": shell}
    for key, field in (("interval", "interval_s"), ("timeout", "timeout_s"), ("start_period", "start_period_s")):
        if key in value:
            check[field] = _seconds(value[key], f"{where}.{key}")
    if "retries" in value:
        check["retries"] = value["retries"]
    return check


def _memory(value: object, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _MEMORY.match(str(value))
    if match is None:
        raise AppBundleError(f"{where}: {value!r}: bytes, or a number with k, m or g")
    return int(match["n"]) * {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match["unit"].lower()]


def container_spec(compose_path: Path, images: dict[str, str], files_root: Path) -> ContainerSpec:
    """The spec of the one service of the compose file at `compose_path`; `images`: reference ->
    the OCI archive's path under `files_root` (app.toml's [images]). An `AppBundleError` names
    the file and the key."""
    try:
        import yaml  # only a container application's `app build` reads YAML
    except ImportError:
        raise AppBundleError("a compose file needs the PyYAML package: pip install 'edge-agent[cli]'") from None
    try:
        document = yaml.safe_load(compose_path.read_text())
    except OSError as exc:
        raise AppBundleError(f"{compose_path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise AppBundleError(f"{compose_path}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(document, dict) or not isinstance(document.get("services"), dict):
        raise AppBundleError(f"{compose_path}: services: a compose file names its services")
    unknown_top = set(document) - {"services", "volumes", "version", "name"}
    if unknown_top:
        raise AppBundleError(f"{compose_path}: {sorted(unknown_top)[0]}: not taken (a compose file of an application"
                             " has services, volumes, version, name)")
    services = document["services"]
    if len(services) != 1:
        raise AppBundleError(f"{compose_path}: services: {len(services)} services: an application is one service"
                             " (one bundle for each)")
    (service_name, service), = services.items()
    where = f"{compose_path}: services.{service_name}"
    if not isinstance(service, dict):
        raise AppBundleError(f"{where}: a mapping")
    for key in service:
        if key not in TAKEN:
            why = _WHY_NOT.get(key, f"a service takes {', '.join(TAKEN)}")
            raise AppBundleError(f"{where}.{key}: not taken: {why}")
    declared_volumes = document.get("volumes") or {}
    if not isinstance(declared_volumes, dict):
        raise AppBundleError(f"{compose_path}: volumes: a mapping of volume names")
    for vname, options in declared_volumes.items():
        if options:
            raise AppBundleError(f"{compose_path}: volumes.{vname}: a volume of the device's own (no driver, no"
                                 " options, not external)")
    reference = str(service.get("image", ""))
    if reference not in images:
        named = ", ".join(sorted(images)) or "none"
        raise AppBundleError(f"{where}.image {reference!r}: not an image of the bundle (app.toml's [images] names"
                             f" {named})")
    archive_path = images[reference]
    image = read_archive(files_root / archive_path, source=f"{files_root / archive_path}")
    spec: dict[str, Any] = {"image": archive_path, "image_id": image.image_id, "architecture": image.architecture}
    try:
        spec.update(_service(service, where, declared_volumes))
    except (TypeError, ValueError) as exc:
        raise AppBundleError(f"{where}: {exc}") from None
    try:
        return msgspec.convert(spec, type=ContainerSpec)
    except msgspec.ValidationError as exc:
        raise AppBundleError(f"{where}: {exc}") from None


def _service(service: dict[str, Any], where: str, declared_volumes: dict[str, Any]) -> dict[str, Any]:
    """The spec's fields of a service's keys (each checked as far as compose's own forms go)."""
    spec: dict[str, Any] = {}
    if "command" in service:
        spec["command"] = _words(service["command"], f"{where}.command")
    if "entrypoint" in service:
        spec["entrypoint"] = _words(service["entrypoint"], f"{where}.entrypoint")
    if "environment" in service:
        spec["environment"] = _environment(service["environment"], f"{where}.environment")
    if "ports" in service:
        spec["ports"] = _ports(service["ports"], f"{where}.ports")
    tmpfs: list[str] = []
    if "volumes" in service:
        spec["volumes"], tmpfs = _volumes(service["volumes"], f"{where}.volumes", set(declared_volumes))
    if "tmpfs" in service:
        more = service["tmpfs"]
        tmpfs += [more] if isinstance(more, str) else [str(t) for t in more or ()]
    if tmpfs:
        spec["tmpfs"] = tmpfs
    if "network_mode" in service:
        mode = service["network_mode"]
        if mode not in ("bridge", "none"):
            raise AppBundleError(f"{where}.network_mode {mode!r}: bridge or none (an application does not share the"
                                 " host's network or another container's)")
        spec["network"] = mode
    for key in ("user", "working_dir", "read_only", "stop_signal"):
        if key in service:
            spec[key] = str(service[key]) if key != "read_only" else bool(service[key])
    if "healthcheck" in service:
        spec["healthcheck"] = _healthcheck(service["healthcheck"], f"{where}.healthcheck")
    if "restart" in service:
        restart = str(service["restart"])
        spec["restart"] = {"unless-stopped": "always"}.get(restart, restart)
    if "mem_limit" in service:
        spec["memory_bytes"] = _memory(service["mem_limit"], f"{where}.mem_limit")
    if "cpus" in service:
        spec["cpus"] = float(service["cpus"])
    if "pids_limit" in service:
        spec["pids_limit"] = int(service["pids_limit"])
    if "stop_grace_period" in service:
        spec["stop_grace_s"] = _seconds(service["stop_grace_period"], f"{where}.stop_grace_period")
    return spec


__all__ = ["TAKEN", "container_spec"]
