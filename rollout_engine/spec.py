"""The rollout spec: a TOML file saying what to install where, in which waves, behind which gates.

    [rollout]
    name = "camera 1.2.0"
    artifact = "fw-1.2.0.eafw"          # relative to the spec file
    kind = "firmware"                   # what it installs: a kind of the leader's table (firmware, config)
    seed = 7                            # wave assignment is deterministic for a seed

    [targets]
    select = "all"                      # all | tags | versions | devices
    tags = ["cam"]                      # select = "tags": devices carrying any of these tags
    versions = ["1.1.0"]                # select = "versions": devices running one of these
    devices = ["pi-0001", "pi-0002"]    # select = "devices": exactly these...
    devices_file = "bench-boards.txt"   # ...and/or the ids of this file (one a line, # comments)
    online = true                       # only devices online (true) or offline (false) when planned
    seen_within_s = 3600                # only devices heard from within this long
    match = { arch = "aarch64", board = "Raspberry Pi 4*" }   # and what they report (glob patterns)
    include_new = false                 # devices that come to match during the rollout join the last open wave

    [waves]
    canary = 2                          # the canary wave, first (0: none)
    counts = [10, 50]                   # or percents = [10, 30, 60], or ramp = { base = 5, factor = 2.0 }

    [gates]
    success_threshold_pct = 95.0        # of a wave's devices must succeed to go on
    soak_s = 300                        # updated devices must keep heartbeating this long
    manual_approval = false             # wait for `edge-agent rollout approve` between waves
    failure_threshold_pct = 20.0        # of finished devices failed/rejected/timed out/rolled back...
    min_finished = 5                    # ...once at least this many finished
    failure_action = "abort"            # abort | pause

    [device]
    timeout_s = 1800                    # no progress for this long: timed_out
    retries = 1                         # failed / timed out devices are offered again
    retry_backoff_s = 60                # doubled per retry
    maintenance_windows = ["01:00-05:00"]   # device-local; an install starts only inside one

    [download]
    servers = 2                         # ConfigServer actors on the leader
    mailbox_capacity = 2                # each; a full one answers busy
    chunk_size = 0                      # bytes per chunk message; 0: the artifact's chunk size
    rate_bytes_per_s = 0                # per server; 0: unlimited
    mirrors = ["https://cdn.example.com/fw"]  # HTTP(S) mirrors serving {sha256}.eafw, tried first;
                                        # then the leader's artifact server, then MQTT chunks

Every mistake is one `ConfigError` naming the file and the dotted key.
"""

from __future__ import annotations

import datetime
import math
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from agent.core.config import convert, decode_toml
from agent.core.errors import ConfigError
from rollout_engine.windows import parse_window

Pct = Annotated[float, msgspec.Meta(ge=0, le=100)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class _Section(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


#: What a rollout installs: the name of a kind in the leader's table (`rollout_engine.kinds`).
KindName = Annotated[str, msgspec.Meta(min_length=1, max_length=32, pattern=r"^[a-z][a-z0-9_]*$")]
#: What a spec without `kind` installs (specs were written before rollouts had kinds).
DEFAULT_KIND = "firmware"


class RolloutSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    artifact: Annotated[str, msgspec.Meta(min_length=1)]  # a file of the kind: a firmware artifact, a config release
    kind: KindName = DEFAULT_KIND
    seed: int = 0
    rollback_artifact: str = ""  # offered by `rollout rollback` unless the command names one
    # the id of an unfinished rollout whose not yet offered devices this one takes over
    supersede: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # each wave downloads and verifies, then waits for `rollout approve` to install
    download_only: bool = False


TargetId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
MAX_LISTED_DEVICES = 100_000


class TargetsSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    select: Literal["all", "tags", "versions", "devices"] = "all"
    tags: list[str] = msgspec.field(default_factory=list)
    versions: list[str] = msgspec.field(default_factory=list)
    devices: Annotated[list[TargetId], msgspec.Meta(max_length=MAX_LISTED_DEVICES)] = msgspec.field(
        default_factory=list)
    devices_file: str = ""  # read into `devices` when the spec is loaded (kept as an absolute path)
    online: bool | None = None
    seen_within_s: Annotated[float, msgspec.Meta(gt=0, le=366 * 86_400)] | None = None
    # what the devices report of themselves (their heartbeats' facts: arch, board, os), each a
    # glob pattern the device's value must match; with any `select`
    match: Annotated[dict[Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")],
                          Annotated[str, msgspec.Meta(min_length=1, max_length=128)]],
                     msgspec.Meta(max_length=8)] = msgspec.field(default_factory=dict)
    include_new: bool = False


class Ramp(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    base: PositiveInt
    factor: Annotated[float, msgspec.Meta(ge=1.0, le=100.0)] = 2.0


class WavesSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    canary: NonNegInt = 0
    counts: list[PositiveInt] | None = None
    percents: list[Annotated[float, msgspec.Meta(gt=0, le=100)]] | None = None
    ramp: Ramp | None = None


class AbortCriteria(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Abort when more than this share of the finished devices ended so (unset: only the
    overall `failure_threshold_pct` counts them)."""

    failed_pct: Pct | None = None
    timed_out_pct: Pct | None = None
    rejected_pct: Pct | None = None
    rolled_back_pct: Pct | None = None


class GatesSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    success_threshold_pct: Pct = 100.0
    soak_s: NonNegFloat = 0.0
    manual_approval: bool = False
    failure_threshold_pct: Pct = 100.0
    min_finished: PositiveInt = 1
    failure_action: Literal["abort", "pause"] = "abort"
    abort: AbortCriteria = msgspec.field(default_factory=AbortCriteria)
    # on an abort, offer `rollout.rollback_artifact` to the devices the rollout had updated
    on_abort: Literal["nothing", "rollback"] = "nothing"
    # a config rollout's wave passes only once this share of it is in sync by the devices' own
    # heartbeats (the release's version committed, no local edit); waited for compliance_wait_s
    min_compliance_pct: Pct = 0.0
    compliance_wait_s: PositiveFloat = 300.0


class ScheduleSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """When the rollout may run, and how fast it offers the image (AWS IoT Jobs' scheduling and
    rollout rate, in our terms). Times are ISO 8601 with a zone, e.g. "2026-12-02T01:00:00Z"."""

    start_at: str = ""  # empty: at once
    end_at: str = ""  # empty: no end
    end_behavior: Literal["stop", "cancel"] = "stop"  # stop: no new offers, updates in progress finish
    devices_per_minute: NonNegInt = 0  # offers per minute at most; 0: no limit

    def start_ms(self) -> int | None:
        return _epoch_ms(self.start_at) if self.start_at else None

    def end_ms(self) -> int | None:
        return _epoch_ms(self.end_at) if self.end_at else None


def _epoch_ms(text: str) -> int:
    """An ISO 8601 time with a zone as ms since the epoch; ValueError for anything else."""
    when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if when.tzinfo is None:
        raise ValueError(f"{text!r} names no time zone (add Z for UTC, or +01:00)")
    return int(when.timestamp() * 1000)


class DeviceSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    timeout_s: PositiveFloat = 1800.0
    retries: NonNegInt = 0
    retry_backoff_s: NonNegFloat = 60.0
    maintenance_windows: list[str] = msgspec.field(default_factory=list)


class DownloadSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    servers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    mailbox_capacity: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 2
    chunk_size: NonNegInt = 0
    rate_bytes_per_s: NonNegInt = 0
    mirrors: Annotated[list[Annotated[str, msgspec.Meta(max_length=400)]], msgspec.Meta(max_length=8)] = (
        msgspec.field(default_factory=list))


class RolloutSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    rollout: RolloutSection
    targets: TargetsSection = msgspec.field(default_factory=TargetsSection)
    waves: WavesSection
    gates: GatesSection = msgspec.field(default_factory=GatesSection)
    device: DeviceSection = msgspec.field(default_factory=DeviceSection)
    download: DownloadSection = msgspec.field(default_factory=DownloadSection)
    schedule: ScheduleSection = msgspec.field(default_factory=ScheduleSection)

    @property
    def windows(self) -> list[tuple[int, int]]:
        """Maintenance windows as (start, end) seconds of the device-local day."""
        return [parse_window(w) for w in self.device.maintenance_windows]

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)


def check_spec(spec: RolloutSpec, *, source: str) -> RolloutSpec:
    """Checks msgspec cannot express; raises `ConfigError(source, key, reason)`."""
    waves = spec.waves
    given = [name for name in ("counts", "percents", "ramp") if getattr(waves, name) is not None]
    if len(given) != 1:
        raise ConfigError(source, "waves", "give exactly one of counts, percents or ramp")
    if waves.counts is not None and not waves.counts:
        raise ConfigError(source, "waves.counts", "must list at least one wave")
    if waves.percents is not None:
        if not waves.percents:
            raise ConfigError(source, "waves.percents", "must list at least one wave")
        total = sum(waves.percents)
        if not math.isclose(total, 100.0, abs_tol=0.01):
            raise ConfigError(source, "waves.percents", f"must add up to 100, not {total:g}")
    targets = spec.targets
    if targets.select == "tags" and not targets.tags:
        raise ConfigError(source, "targets.tags", 'select = "tags" needs at least one tag')
    if targets.select == "versions" and not targets.versions:
        raise ConfigError(source, "targets.versions", 'select = "versions" needs at least one version')
    for i, text in enumerate(spec.device.maintenance_windows):
        try:
            parse_window(text)
        except ValueError as exc:
            raise ConfigError(source, f"device.maintenance_windows.{i}", str(exc)) from None
    for key in ("start_at", "end_at"):
        text = getattr(spec.schedule, key)
        if text:
            try:
                _epoch_ms(text)
            except ValueError as exc:
                raise ConfigError(source, f"schedule.{key}", f"not a time: {exc} (e.g. 2026-12-02T01:00:00Z)") from None
    start, end = spec.schedule.start_ms(), spec.schedule.end_ms()
    if start is not None and end is not None and end <= start:
        raise ConfigError(source, "schedule.end_at", "must be after schedule.start_at")
    if spec.gates.on_abort == "rollback" and not spec.rollout.rollback_artifact:
        raise ConfigError(source, "gates.on_abort", '"rollback" needs rollout.rollback_artifact')
    t = spec.targets
    given_keys: tuple[tuple[str, str, bool], ...] = (
        ("tags", "tags", bool(t.tags)), ("versions", "versions", bool(t.versions)),
        ("devices", "devices", bool(t.devices)), ("devices_file", "devices", bool(t.devices_file)))
    for key, select, present in given_keys:
        if present and t.select != select:
            raise ConfigError(source, f"targets.{key}", f'applies with select = "{select}" (select is "{t.select}")')
    if t.select == "devices" and not t.devices and not t.devices_file:
        raise ConfigError(source, "targets.devices", 'select = "devices" needs the devices\' ids (devices or '
                                                     'devices_file)')
    for i, mirror in enumerate(spec.download.mirrors):
        if not mirror.startswith(("http://", "https://")):
            raise ConfigError(source, f"download.mirrors.{i}", f"{mirror!r} is not an http:// or https:// URL")
    chunk = spec.download.chunk_size
    if chunk and chunk < 256:
        raise ConfigError(source, "download.chunk_size", "must be 0 (the artifact's) or at least 256 bytes")
    return spec


def soak_warning(spec: RolloutSpec, *, heartbeat_s: float, source: str, devices: str = "devices") -> str | None:
    """One line when `gates.soak_s` is shorter than the `devices`' heartbeat interval, else None.

    The soak passes a device only if the leader heard a heartbeat from it after the soak began;
    a soak shorter than the interval can end before that heartbeat, and the device then counts
    as failed (with every device beating on the same beat, as simulated ones do, the whole wave
    fails). A warning, not an error: a fleet may beat faster than the interval given here."""
    soak = spec.gates.soak_s
    if not 0 < soak < heartbeat_s:
        return None
    return (f"{source}: gates.soak_s = {soak:g} is shorter than the {devices}' heartbeat interval ({heartbeat_s:g} s):"
            " the soak can end before a device's next heartbeat, and the device then counts as failed;"
            f" make soak_s at least {heartbeat_s:g}")


def load_spec(path: str | Path) -> RolloutSpec:
    """Read and check a spec file; `rollout.artifact` (and `rollback_artifact`) come back as
    absolute paths resolved against the spec's directory."""
    path = Path(path)
    spec = check_spec(decode_toml(path, RolloutSpec), source=str(path))
    base = path.resolve().parent
    section = spec.rollout
    artifact = str((base / section.artifact).resolve())
    rollback = str((base / section.rollback_artifact).resolve()) if section.rollback_artifact else ""
    targets = spec.targets
    if targets.devices_file:
        listed = base / targets.devices_file
        ids = list(dict.fromkeys([*targets.devices, *read_device_list(listed, key="targets.devices_file")]))
        if len(ids) > MAX_LISTED_DEVICES:
            raise ConfigError(str(path), "targets.devices", f"{len(ids)} devices, over {MAX_LISTED_DEVICES}")
        targets = msgspec.structs.replace(targets, devices=ids, devices_file=str(listed.resolve()))
    return msgspec.structs.replace(
        spec, rollout=msgspec.structs.replace(section, artifact=artifact, rollback_artifact=rollback),
        targets=targets,
    )


_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def read_device_list(path: Path, *, key: str) -> list[str]:
    """Device ids, one a line (blank lines and `#` comments skipped); a `ConfigError` naming the
    file and the line of one that is not an id."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), key, f"cannot read the device list: {getattr(exc, 'strerror', None) or exc}"
                          ) from None
    ids = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if not _ID.match(entry):
            raise ConfigError(f"{path}:{number}", key, f"{entry[:60]!r} is not a device id")
        ids.append(entry)
    return ids


def spec_from_dict(data: dict[str, object], *, source: str = "spec") -> RolloutSpec:
    """Build and check a spec from plain data (tests, the simulator, the database)."""
    return check_spec(convert(data, RolloutSpec, source=source), source=source)


def spec_from_json(data: bytes, *, source: str = "stored spec") -> RolloutSpec:
    """A spec stored as JSON (`RolloutSpec.to_json`), decoded straight into the struct."""
    try:
        spec = msgspec.json.decode(data, type=RolloutSpec)
    except msgspec.ValidationError:  # name the key, as a spec file's mistake is named
        return spec_from_dict(msgspec.json.decode(data), source=source)
    except msgspec.DecodeError as exc:
        raise ConfigError(source, None, f"not JSON: {exc}") from None
    return check_spec(spec, source=source)


class StartControl(msgspec.Struct, kw_only=True, frozen=True):
    """What `rollout start` asks of the running leader: the spec, and the waves planned from the
    devices the leader's registry held then (planned once, by the command that checked them)."""

    spec: RolloutSpec
    waves: list[list[str]]

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)


def start_control_from_json(data: bytes, *, source: str = "start control") -> StartControl:
    """A start control as the command wrote it; one written by an earlier version holds the spec
    alone (its waves are planned by the leader)."""
    try:
        control = msgspec.json.decode(data, type=StartControl)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return StartControl(spec=spec_from_json(data, source=source), waves=[])
    return StartControl(spec=check_spec(control.spec, source=source), waves=control.waves)


__all__ = [
    "DeviceSection",
    "DownloadSection",
    "GatesSection",
    "Ramp",
    "DEFAULT_KIND",
    "KindName",
    "RolloutSection",
    "RolloutSpec",
    "StartControl",
    "TargetsSection",
    "WavesSection",
    "check_spec",
    "load_spec",
    "soak_warning",
    "spec_from_dict",
    "spec_from_json",
    "start_control_from_json",
]
