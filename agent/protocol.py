"""The messages workers and leaders exchange, and the registry that names them on the wire.

Each message is a small frozen msgspec Struct carried as the payload of an `Envelope` whose
`kind` is one of the `KIND_*` constants below; `REGISTRY` maps the kind back to the Struct, so
a receiver decodes with `REGISTRY.decode_payload(envelope)` and gets a `CodecError` for
anything it does not know or that does not validate.

Direction and purpose:

    worker -> leader   Heartbeat   (OVERWRITE by device: only the newest seq matters; a short
                                    one carries only what changed)
    leader -> worker   HeartbeatPace (heartbeat fast for a while: a rollout's soak, an operator)
                       Telemetry   (APPEND, deduplicated by envelope id on the leader)
                       JobDemand   (register / re-register a demand window for jobs)
                       JobResult   (confirms one job, stamped with the epoch of its offer)
    leader -> worker   JobOffer    (one job, stamped with the leader queue's epoch)
    anyone -> leader   JobSubmit   (a new job; idempotent by job id)
    transport->leader  Presence    (online / offline, from the retained presence topic or LWT)
    worker -> leader   AppMessage  (a device application's message, kind "app.CLASS": APPEND
                                    deduplicated by envelope id, or OVERWRITE per key, newest seq)
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from agent.core.codec import INT64_MAX, Count, Envelope, MessageRegistry, decode, encode
from agent.core.errors import CodecError

# Every field is bounded where it is declared: integers within SQLite's int64, strings and
# collections by length, floats finite and within a sane range, so one device's message can
# neither fail a leader's batch nor grow its state without bound.
DeviceId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
JobId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Epoch = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
TimestampMs = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Window = Annotated[int, msgspec.Meta(ge=1, le=10_000)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0, le=1e15)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Percent = Annotated[float, msgspec.Meta(ge=0, le=100)]
Reading = Annotated[float, msgspec.Meta(ge=-1e300, le=1e300)]  # finite
Version = Annotated[str, msgspec.Meta(max_length=64)]
Tag = Annotated[str, msgspec.Meta(max_length=64)]
Text = Annotated[str, msgspec.Meta(max_length=1024)]

KIND_HEARTBEAT = "heartbeat"
KIND_TELEMETRY = "telemetry"
KIND_PRESENCE = "presence"
KIND_JOB_SUBMIT = "job.submit"
KIND_JOB_OFFER = "job.offer"
KIND_JOB_DEMAND = "job.demand"
KIND_JOB_RESULT = "job.result"
KIND_PING = "ping"
KIND_HEARTBEAT_PACE = "heartbeat.pace"
# A device application's message travels as kind "app." + its class, so each class is its own
# class in the outbox (caps, TTL, counters) and can never be taken for one of the agent's own.
APP_KIND_PREFIX = "app."
# The reason of an `accepted` reply to a durable message the leader held already (a redelivery,
# an application's retry under the same app_id): nothing was stored twice.
ALREADY_STORED = "already stored"
# The reason of an `accepted` reply to a short heartbeat from a device the leader holds no full
# heartbeat of (since the leader started): the worker sends its next heartbeat whole, at once.
FULL_HEARTBEAT_WANTED = "full heartbeat wanted"
ClassName = Annotated[str, msgspec.Meta(min_length=1, max_length=48, pattern=r"^[a-z0-9][a-z0-9_-]*$")]
MessageKey = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ContentType = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[!-~]+$")]
APP_PAYLOAD_MAX = 1024 * 1024  # the transport's max_payload_bytes bounds it further


class _Message(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """Base: keyword-only, immutable. Unknown fields are ignored so a newer peer can add some; a
    field at its default is left off the wire (the decoder puts it back)."""


class SystemSample(_Message, kw_only=True, frozen=True):
    """One psutil reading of the device. A field is None where the platform cannot say."""

    cpu_percent: Percent | None = None
    mem_total_bytes: Bytes | None = None
    mem_available_bytes: Bytes | None = None
    mem_percent: Percent | None = None
    disk_total_bytes: Bytes | None = None
    disk_free_bytes: Bytes | None = None
    disk_percent: Percent | None = None
    load_1m: NonNegFloat | None = None
    load_5m: NonNegFloat | None = None
    load_15m: NonNegFloat | None = None
    temperature_c: Reading | None = None
    uptime_s: NonNegFloat | None = None  # of the host, since boot


SlotName = Annotated[str, msgspec.Meta(max_length=16)]


class SlotState(_Message, kw_only=True, frozen=True):
    """A device's A/B slots as its installer sees them, sent in a full heartbeat (a change makes
    one): which slot booted, which boots next by default, which is on trial, the boot attempts
    a bootloader has left for each (where it counts them) and the version each slot holds
    ("partial": a download left it half written)."""

    backend: Annotated[str, msgspec.Meta(max_length=32)] = ""
    booted: SlotName = ""
    default: SlotName = ""
    trial: SlotName = ""  # "": no trial armed
    attempts: Annotated[dict[SlotName, Annotated[int, msgspec.Meta(ge=0, le=1000)]],
                        msgspec.Meta(max_length=4)] = {}
    versions: Annotated[dict[SlotName, Version], msgspec.Meta(max_length=4)] = {}


TargetKey = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class ConfigState(_Message, kw_only=True, frozen=True):
    """What one configuration target of the device holds (sent in a full heartbeat when it
    changes): the version applied, the applier's state ("committed", "rolled_back", "failed")
    and the documents changed on the device since (drift)."""

    version: Version = ""
    state: Annotated[str, msgspec.Meta(max_length=16)] = ""
    drifted: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=128)], ...], msgspec.Meta(max_length=64)] = ()
    layers: Annotated[str, msgspec.Meta(max_length=16)] = ""  # the digest of the leader's layer values applied
    # the number of the newest apply begun on the target, counted on the device (0: an agent that
    # does not count): an operator's acknowledgement of a failed attempt names the one it saw
    attempt: Annotated[int, msgspec.Meta(ge=0, lt=2**31)] = 0

    @property
    def compliance(self) -> str:
        """What the device holds of the target, the one word every view uses: "drifted" (edited
        on the device), "damaged" (its record cannot be read), "in_sync" (it holds `version`
        unchanged: after a revert, the version it went back to), or "not_applied". How its last
        attempt ended is another fact, `last_attempt`, shown beside."""
        if self.drifted:
            return "drifted"
        if self.state == "damaged":
            return "damaged"
        return "in_sync" if self.version else "not_applied"

    @property
    def last_attempt(self) -> str:
        """How the newest apply ended when it did not commit: "rolled_back" (reverted, by itself
        or as the confirmation ran out), "failed" (refused before its swap); "" otherwise."""
        return self.state if self.state in ("failed", "rolled_back") else ""

    def compliance_with(self, pending: bool) -> str:
        """`compliance`, where "pending" stands for in sync or not applied when the leader has
        more for the target (a config rollout not finished with it, a layer set since)."""
        said = self.compliance
        return "pending" if pending and said in ("in_sync", "not_applied") else said


AppKey = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")]
FactKey = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
FactValue = Annotated[str, msgspec.Meta(max_length=128)]


class AppState(_Message, kw_only=True, frozen=True):
    """What one application of the device runs (sent in a full heartbeat when it changes): the
    committed version, the one kept to go back to, the one on trial, and the outcome of the last
    health check this agent ran of it ("healthy"; "failed": a trial taken back; "": none yet)."""

    version: Version = ""
    previous: Version = ""
    trial: Version = ""
    health: Annotated[str, msgspec.Meta(max_length=16)] = ""


class DeviceHealth(_Message, kw_only=True, frozen=True):
    """How the agent has run on the firmware it runs, counted on the device since it first ran it:
    the seconds it ran, and its unexpected restarts there (a start that found the run before it
    not stopped: a crash, a kill, a power cut, a watchdog). The fleet's healthy hours per release
    are made of these (`DeviceRegistry.release_health`)."""

    firmware: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    operating_s: Annotated[float, msgspec.Meta(ge=0, le=100 * 365 * 86_400)]
    unexpected_restarts: Annotated[int, msgspec.Meta(ge=0, le=1_000_000_000)]


class Heartbeat(_Message, kw_only=True, frozen=True):
    """Sent every `heartbeat.interval_s` (`fast_interval_s` while an update runs or the leader
    asks). The leader keeps the one with the highest `seq`, so `seq` must keep growing across
    agent restarts too: a persisted counter, or the sender's `clock.now_ms()` at sending time.

    A full heartbeat (`full`, the default) states everything. A short one (`full=False`) carries
    only what changed since the last full one the worker made; a field it leaves at its default
    (None, "", ()) is unchanged, and the leader keeps what it has. Offline is seen from the
    connection (keep-alive, last will), so an idle device's heartbeat is rare and small."""

    device_id: DeviceId
    seq: Seq
    uptime_s: NonNegFloat  # of the agent process
    firmware_version: Version = ""
    tags: Annotated[tuple[Tag, ...], msgspec.Meta(max_length=32)] = ()
    sample: SystemSample | None = None
    # A random id of this start of the agent. A device whose local state was wiped (a new SD
    # card) counts seqs from the start again: its new boot id tells the leader to take them.
    boot: Annotated[str, msgspec.Meta(max_length=32)] = ""
    # Messages waiting in the device's outbox when the heartbeat was made (None: not reported).
    outbox_pending: Count | None = None
    # The heartbeat's wire version: 1 (absent) from workers that register their job demand in a
    # message of its own; 2: the demand rides here, one uplink message per interval instead of two;
    # 3: `interval_s` and short heartbeats (`full`).
    wire: Annotated[int, msgspec.Meta(ge=1, le=65_535)] = 1
    demand: JobDemand | None = None  # wire 2: the worker's job demand window (its own device id)
    # wire 3: seconds until this device's next heartbeat; the leader's deadline for it follows
    interval_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] | None = None
    full: bool = True
    slots: SlotState | None = None  # a device with [firmware]: its slots (a full heartbeat only)
    # a device with [config_targets]: what each holds (a full heartbeat only)
    configs: Annotated[dict[TargetKey, ConfigState], msgspec.Meta(max_length=32)] | None = None
    # a device with [apps]: what each application runs (a full heartbeat only; None: not known yet, as after
    # a boot before its application helper answered: the leader keeps what the device said before)
    apps: Annotated[dict[AppKey, AppState], msgspec.Meta(max_length=64)] | None = None
    # what the device is, as it reads itself: arch, board, os (a full heartbeat only; rollouts
    # target by them: `targets.match`)
    facts: Annotated[dict[FactKey, FactValue], msgspec.Meta(max_length=16)] | None = None
    # how the agent has run on its firmware (every full heartbeat, and a short one each operating
    # hour; None: not known yet, as before the updater read the slots: the leader keeps what it has)
    health: DeviceHealth | None = None


class HeartbeatPace(_Message, kw_only=True, frozen=True):
    """Leader -> worker: heartbeat every `interval_s` (at most the worker's `fast_interval_s`
    rate) for the next `for_s` seconds, starting with one heartbeat now. A rollout's soak asks
    this of its wave's devices."""

    interval_s: Annotated[float, msgspec.Meta(ge=1, le=3600)]
    for_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)]


class Telemetry(_Message, kw_only=True, frozen=True):
    """One telemetry record: a single `value` or a map of `values` (or both)."""

    device_id: DeviceId
    seq: Seq
    name: Name
    ts_ms: TimestampMs
    value: Reading | None = None
    values: Annotated[dict[Name, Reading], msgspec.Meta(max_length=256)] | None = None


class AppMessage(_Message, kw_only=True, frozen=True):
    """A message a device application handed to the agent through the local API: opaque bytes
    of a content type. `overwrite`: only the newest `seq` per (device, class, key) matters."""

    device_id: DeviceId
    cls: ClassName
    payload: Annotated[bytes, msgspec.Meta(max_length=APP_PAYLOAD_MAX)]
    content_type: ContentType = "application/octet-stream"
    key: MessageKey | None = None
    overwrite: bool = False
    seq: Seq = 0
    ts_ms: TimestampMs = 0


def app_kind(cls: str) -> str:
    """The wire (and outbox) kind of an application message class."""
    return APP_KIND_PREFIX + cls


def decode_app_message(envelope: Envelope) -> AppMessage:
    """An `app.CLASS` envelope's payload, whose class must be the one its kind names; raises only
    `CodecError`."""
    message = decode(envelope.payload, AppMessage)
    if app_kind(message.cls) != envelope.kind:
        raise CodecError(f"payload of class {message.cls!r} in an envelope of kind {envelope.kind!r}")
    return message


class Presence(_Message, kw_only=True, frozen=True):
    """Online/offline of a device as the broker reports it (birth message or last will)."""

    device_id: DeviceId
    status: Literal["online", "offline"]
    ts_ms: TimestampMs = 0
    # The session the birth or will belongs to ("" from an agent before sessions): a will of
    # another session than the device's current one is a late one and changes nothing.
    session: Annotated[str, msgspec.Meta(max_length=32)] = ""


class JobSubmit(_Message, kw_only=True, frozen=True):
    """A job for the fleet's workers. Submitting the same `job_id` again changes nothing."""

    job_id: JobId
    kind: Name
    payload: bytes = b""


class JobOffer(_Message, kw_only=True, frozen=True):
    """The leader hands one job to one worker under the queue's current `epoch`."""

    job_id: JobId
    epoch: Epoch
    kind: Name
    payload: bytes = b""


class JobDemand(_Message, kw_only=True, frozen=True):
    """A worker (re-)registers: it will hold at most `window` unconfirmed jobs at once.

    `incarnation` names one run of the worker; a new incarnation replaces the old binding and
    the jobs the old one held go back to the pending pool.
    """

    worker: DeviceId
    incarnation: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    window: Window = 4


class JobResult(_Message, kw_only=True, frozen=True):
    """A worker confirms one job after processing it, echoing the offer's `epoch`."""

    job_id: JobId
    epoch: Epoch
    worker: DeviceId
    ok: bool
    result: bytes = b""
    error: Text = ""


class Ping(_Message, kw_only=True, frozen=True):
    """Answered `accepted` by the leader and nothing else: `edge-agent doctor`'s round trip
    (the device may publish on its up topic and read its replies, and a leader is there)."""

    sent_ms: TimestampMs = 0


CORE_MESSAGES: tuple[tuple[str, type[msgspec.Struct]], ...] = (
    (KIND_HEARTBEAT, Heartbeat),
    (KIND_TELEMETRY, Telemetry),
    (KIND_PRESENCE, Presence),
    (KIND_JOB_SUBMIT, JobSubmit),
    (KIND_JOB_OFFER, JobOffer),
    (KIND_JOB_DEMAND, JobDemand),
    (KIND_JOB_RESULT, JobResult),
    (KIND_PING, Ping),
    (KIND_HEARTBEAT_PACE, HeartbeatPace),
)


def agent_registry() -> MessageRegistry:
    """A registry of the core kinds, for one agent. A layer that adds kinds (firmware) registers
    them in the agent's own registry when it is attached, so what an agent decodes is decided
    where it is built, never by what happens to be imported."""
    registry = MessageRegistry()
    for kind, type_ in CORE_MESSAGES:
        registry.register(kind, type_)
    return registry


REGISTRY = agent_registry()  # the core kinds only: `decode_message`, `kind_of`


def kind_of(message: msgspec.Struct) -> str:
    """The wire kind of a core message; `KeyError` for any other type (a bug)."""
    return REGISTRY.kind_of(message)


def encode_message(message: msgspec.Struct) -> bytes:
    """The payload bytes of `message` (put them in an `Envelope` of kind `kind_of(message)`)."""
    return encode(message)


def decode_message(envelope: Envelope) -> msgspec.Struct:
    """Decode an envelope's payload by its kind; raises only `CodecError`."""
    return REGISTRY.decode_payload(envelope)


def decode_as(data: bytes | bytearray | memoryview, type_: type[msgspec.Struct]) -> msgspec.Struct:
    """Decode bare payload bytes as `type_`; raises only `CodecError`."""
    return decode(data, type_)


__all__ = [
    "ALREADY_STORED",
    "AppState",
    "FULL_HEARTBEAT_WANTED",
    "HeartbeatPace",
    "KIND_HEARTBEAT_PACE",
    "APP_KIND_PREFIX",
    "APP_PAYLOAD_MAX",
    "AppMessage",
    "ClassName",
    "ConfigState",
    "DeviceHealth",
    "SlotState",
    "app_kind",
    "decode_app_message",
    "KIND_HEARTBEAT",
    "KIND_JOB_DEMAND",
    "KIND_JOB_OFFER",
    "KIND_JOB_RESULT",
    "KIND_JOB_SUBMIT",
    "KIND_PRESENCE",
    "KIND_PING",
    "KIND_TELEMETRY",
    "CORE_MESSAGES",
    "REGISTRY",
    "Heartbeat",
    "JobDemand",
    "JobOffer",
    "JobResult",
    "JobSubmit",
    "Presence",
    "Ping",
    "SystemSample",
    "Telemetry",
    "agent_registry",
    "decode_as",
    "decode_message",
    "encode_message",
    "kind_of",
]
