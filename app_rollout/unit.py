"""What an application's systemd unit may ask for, and the unit the device runs.

A bundle carries a unit of its own (`[Unit]`, `[Service]`, `[Install]`), written as for any
service. The device never installs it as written: `check_unit` takes only the keys an
application may set, one per line, and refuses anything else in one line that names the key:

    [Unit]     Description, Documentation; After=, Wants= of targets only (network-online.target)
    [Service]  Type (simple, exec, notify), ExecStart (one), ExecReload, ExecStop, Restart,
               RestartSec, TimeoutStartSec, TimeoutStopSec, WatchdogSec, Environment,
               SyslogIdentifier, KillSignal, MemoryMax, CPUQuota, TasksMax
    [Install]  WantedBy=multi-user.target

A command is a file of the bundle (`bin/server`, executable in the manifest) or a program of the
system under /usr/bin or /bin, with no prefix (`+`, `!` would run it as root or unsandboxed).
So a unit cannot name a user, a capability, a device, a path to write or a root-run step:
`render_unit` adds the sandbox itself. Every application runs as its own dynamic user, with its
files read-only, its data in `/var/lib/edge-apps/NAME` kept across versions (`$STATE_DIRECTORY`),
the agent's data and config out of its sight, no new privileges and no capabilities.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from app_rollout.errors import UnitRefused

MAX_UNIT = 16 * 1024
MAX_LINE = 4096
DATA_ROOT = "edge-apps"  # StateDirectory=edge-apps/NAME: /var/lib/edge-apps/NAME
SYSTEM_PROGRAMS = ("/usr/bin/", "/bin/")
EXEC_KEYS = ("ExecStart", "ExecReload", "ExecStop")
_TARGET = re.compile(r"^[A-Za-z0-9_.:-]{1,64}\.target$")
_KEY = re.compile(r"^[A-Za-z]{1,64}$")
_DURATION = re.compile(r"^(infinity|[0-9]{1,6}(\.[0-9]{1,3})?(us|ms|s|min|h)?( ?[0-9]{1,6}(us|ms|s|min|h)?){0,3})$")
_AMOUNT = re.compile(r"^(infinity|[0-9]{1,12}[KMGT]?|[0-9]{1,3}%)$")
_SIGNAL = re.compile(r"^(SIG)?[A-Z0-9+]{2,12}$")
_ASSIGNMENT = r'("[A-Za-z_][A-Za-z0-9_]{0,63}=[^"\\]{0,1024}"|[A-Za-z_][A-Za-z0-9_]{0,63}=\S{0,1024})'
_ENVIRONMENT = re.compile(rf"^{_ASSIGNMENT}( {_ASSIGNMENT}){{0,31}}$")


def _one_of(*values: str) -> re.Pattern[str]:
    return re.compile("^(" + "|".join(re.escape(v) for v in values) + ")$")


# section -> key -> the value's pattern (None: a command, or free text within the line cap)
_ALLOWED: Mapping[str, Mapping[str, re.Pattern[str] | None]] = {
    "Unit": {"Description": None, "Documentation": re.compile(r"^\S{1,512}( \S{1,512}){0,7}$"),
             "After": None, "Wants": None},
    "Service": {"Type": _one_of("simple", "exec", "notify"), "ExecStart": None, "ExecReload": None, "ExecStop": None,
                "Restart": _one_of("no", "on-failure", "on-abnormal", "on-abort", "always"),
                "RestartSec": _DURATION, "TimeoutStartSec": _DURATION, "TimeoutStopSec": _DURATION,
                "WatchdogSec": _DURATION, "Environment": _ENVIRONMENT,
                "SyslogIdentifier": re.compile(r"^[A-Za-z0-9_.-]{1,64}$"), "KillSignal": _SIGNAL,
                "MemoryMax": _AMOUNT, "CPUQuota": re.compile(r"^[0-9]{1,4}%$"), "TasksMax": _AMOUNT},
    "Install": {"WantedBy": _one_of("multi-user.target")},
}
_WHY_NOT = {  # what a refused key would have given, said in its refusal
    "User": "an application runs as its own dynamic user", "Group": "an application runs as its own dynamic user",
    "DynamicUser": "an application always runs as its own dynamic user",
    "AmbientCapabilities": "an application has no capabilities",
    "CapabilityBoundingSet": "an application has no capabilities",
    "ExecStartPre": "only ExecStart, ExecReload and ExecStop run", "ExecStartPost": "only ExecStart, ExecReload"
                                                                                  " and ExecStop run",
    "PermissionsStartOnly": "nothing of an application runs as root",
    "ReadWritePaths": "an application writes only its data directory", "BindPaths": "an application sees only its"
                                                                                    " own files",
    "DeviceAllow": "an application opens no device", "PrivateDevices": "an application opens no device",
    "NoNewPrivileges": "an application never gains privileges",
}


@dataclass(frozen=True)
class AppUnit:
    """A unit as checked: its lines per section, in order (key, value)."""

    unit: tuple[tuple[str, str], ...]
    service: tuple[tuple[str, str], ...]

    def commands(self) -> list[str]:
        """Every command the unit runs (a bundle's path or a system program)."""
        return [_command(v) for k, v in self.service if k in EXEC_KEYS]


def _command(value: str) -> str:
    return value.strip().split(None, 1)[0] if value.strip() else ""


def check_unit(text: str, *, executables: frozenset[str], source: str) -> AppUnit:
    """`text` as an application's unit, checked; `executables`: the bundle's files that may run.
    An `UnitRefused` names `source`, the line's section and key, and why."""
    if len(text.encode()) > MAX_UNIT:
        raise UnitRefused(f"{source}: the unit is over {MAX_UNIT} bytes")
    sections: dict[str, list[tuple[str, str]]] = {"Unit": [], "Service": [], "Install": []}
    section = ""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        where = f"{source}: line {number}"
        if not line or line[0] in "#;":
            continue
        if len(line) > MAX_LINE:
            raise UnitRefused(f"{where}: over {MAX_LINE} characters")
        if line.endswith("\\"):
            raise UnitRefused(f"{where}: a line continued with \\ is not taken: one key per line")
        if line.startswith("["):
            if not line.endswith("]") or line[1:-1] not in sections:
                raise UnitRefused(f"{where}: section {line}: an application's unit has [Unit], [Service] and"
                                  " [Install] only")
            section = line[1:-1]
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not _KEY.match(key):
            raise UnitRefused(f"{where}: not a KEY=value line")
        if not section:
            raise UnitRefused(f"{where}: {key}= before any section")
        allowed = _ALLOWED[section]
        if key not in allowed:
            why = _WHY_NOT.get(key, f"[{section}] takes {', '.join(allowed)}")
            raise UnitRefused(f"{where}: [{section}] {key}= is not taken: {why}")
        pattern = allowed[key]
        if key in ("After", "Wants"):
            if not all(_TARGET.match(t) for t in value.split()) or not value:
                raise UnitRefused(f"{where}: [Unit] {key}={value}: an application orders itself after targets"
                                  " only (network-online.target)")
        elif key in EXEC_KEYS:
            _check_command(value, executables, f"{where}: [Service] {key}=")
        elif pattern is not None and not pattern.match(value):
            raise UnitRefused(f"{where}: [{section}] {key}={value}: not a value this key takes here")
        if "\x00" in value:
            raise UnitRefused(f"{where}: a NUL byte")
        sections[section].append((key, value))
    starts = [v for k, v in sections["Service"] if k == "ExecStart"]
    if len(starts) != 1:
        raise UnitRefused(f"{source}: [Service] needs exactly one ExecStart= (it has {len(starts)})")
    return AppUnit(unit=tuple(sections["Unit"]), service=tuple(sections["Service"]))


def _check_command(value: str, executables: frozenset[str], where: str) -> None:
    command = _command(value)
    if not command:
        raise UnitRefused(f"{where}: no command")
    if command[0] in "@-:+!|":
        raise UnitRefused(f"{where}{value}: a command prefix ({command[0]}) is not taken: every command runs as"
                          " the application's own user")
    if any(c in command for c in "\"'$%\\"):
        raise UnitRefused(f"{where}{command}: the command is a plain path (no quotes, variables or specifiers)")
    if command.startswith("/"):
        if not command.startswith(SYSTEM_PROGRAMS) or "/../" in command or "/./" in command:
            raise UnitRefused(f"{where}{command}: a command is a file of the bundle (bin/server) or a program"
                              " under /usr/bin or /bin")
        return
    if command not in executables:
        raise UnitRefused(f"{where}{command}: not an executable file of the bundle (its mode in app.toml's"
                          " files is 0755)")


def service_name(app: str) -> str:
    """The systemd unit an application runs as."""
    return f"edge-app-{app}.service"


def render_unit(app: AppUnit, *, name: str, version: str, files_dir: str, hidden: tuple[str, ...]) -> str:
    """The unit the device installs as `edge-app-NAME.service`: the checked lines, the bundle's
    commands at `files_dir`, and the sandbox; `hidden`: paths the application may not see (the
    agent's data and config)."""
    out = [f"# edge-app-{name}.service: application {name} {version}, written by edge-agent (do not edit)",
           "[Unit]"]
    out += [f"{k}={v}" for k, v in app.unit] or [f"Description=application {name} {version}"]
    out += ["", "[Service]"]
    for key, value in app.service:
        if key in EXEC_KEYS:
            command = _command(value)
            rest = value.strip()[len(command):]
            value = (command if command.startswith("/") else f"{files_dir}/{command}") + rest
        out.append(f"{key}={value}")
    out += [f"WorkingDirectory={files_dir}",
            f'Environment="APP_NAME={name}" "APP_VERSION={version}" "APP_FILES={files_dir}"',
            "DynamicUser=yes",
            f"StateDirectory={DATA_ROOT}/{name}",
            "StateDirectoryMode=0700",
            "ProtectSystem=strict",
            "ProtectHome=yes",
            "PrivateTmp=yes",
            "PrivateDevices=yes",
            "NoNewPrivileges=yes",
            "CapabilityBoundingSet=",
            "AmbientCapabilities=",
            "ProtectKernelTunables=yes",
            "ProtectKernelModules=yes",
            "ProtectKernelLogs=yes",
            "ProtectControlGroups=yes",
            "ProtectClock=yes",
            "ProtectHostname=yes",
            "RestrictSUIDSGID=yes",
            "RestrictRealtime=yes",
            "RestrictNamespaces=yes",
            "LockPersonality=yes",
            "RemoveIPC=yes",
            "UMask=0077"]
    out += [f"InaccessiblePaths=-{path}" for path in hidden]
    out += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(out)


__all__ = ["DATA_ROOT", "MAX_UNIT", "AppUnit", "check_unit", "render_unit", "service_name"]
