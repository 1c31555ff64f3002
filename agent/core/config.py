"""Agent configuration: TOML files decoded into frozen msgspec Structs with defaults.

A mistake in a file becomes one `ConfigError` that names the file and the dotted key:

    configs/worker.toml: mailbox.capacity: expected int >= 1

Durations carry their unit in the name (`interval_s`, `retry_after_ms`).
"""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from agent.core.errors import ConfigError

T = TypeVar("T")

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
DeviceName = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
MailboxPolicy = Literal["reject", "drop_oldest", "drop_newest"]
FullPolicy = Literal["reject", "drop_oldest"]
Synchronous = Literal["NORMAL", "FULL"]
# What an acknowledgement promises: "power" (the message survives a power cut: its commit is
# synced to the disk), "crash" (it survives the agent's crash, not a power cut: the last
# seconds may be lost; for high-rate telemetry that can spare them).
Durability = Literal["power", "crash"]


class _Section(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class AgentSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    device_id: DeviceName
    role: Literal["worker", "leader"] = "worker"
    fleet: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")] = "default"
    data_dir: str = "/var/lib/edge-agent"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # a config release of the built-in target "agent" (signed with [firmware] public_key) may
    # change this worker's own settings (`REMOTE_SETTINGS`)
    remote_settings: bool = True
    use_uvloop: bool | None = None  # unset: uvloop for the leader, asyncio for a worker (~2 MB less RSS)
    tags: list[str] = msgspec.field(default_factory=list)
    firmware_version: str = "0.0.0"

    def wants_uvloop(self) -> bool:
        """`use_uvloop`, or by role when unset: uvloop pays for itself in the leader's intake;
        a worker idles, and asyncio's own loop keeps it about 2 MB smaller."""
        return self.use_uvloop if self.use_uvloop is not None else self.role == "leader"


class MqttSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    url: str = "mqtt://127.0.0.1:1883"
    username: str = ""
    password_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # MQTT carries it in 16 bits. The broker ends a silent connection after 1.5 of it and then
    # publishes the last will: 50 s + `will_delay_s` tells the leader within 90 s that a device is
    # gone, for ~1,700 PINGREQ/PINGRESP pairs (~350 KB over TLS) a day.
    keepalive_s: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 50
    reconnect_min_s: PositiveFloat = 1.0
    reconnect_max_s: PositiveFloat = 60.0
    max_payload_bytes: Positive = 256 * 1024
    reply_timeout_s: PositiveFloat = 10.0
    # "auto": the lean paths through paho's internals when they are the expected ones, else
    # aiomqtt's own path with one WARNING; "off": always aiomqtt's own path.
    fast_path: Literal["auto", "off"] = "auto"
    # Seconds the broker waits before it publishes our last will (`offline`): a device back
    # within them was never offline to the leader. Needs a persistent session (a worker's).
    will_delay_s: Annotated[int, msgspec.Meta(ge=0, le=3600)] = 5


class MailboxSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    capacity: Positive = 256
    policy: MailboxPolicy = "reject"
    # An actor still on one message after this long is stuck: /healthz fails and the watchdog
    # pings stop, so systemd restarts the agent (actors that may wait hours, as the updater, are exempt).
    stall_s: PositiveFloat = 300.0


class OutboxClassSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Size cap of one message class in the outbox."""

    max_messages: Positive = 100_000
    max_bytes: Positive = 64 * 1024 * 1024
    full_policy: FullPolicy = "drop_oldest"
    ttl_s: NonNegativeFloat = 0.0
    fifo: bool = False
    durability: Durability | None = None  # unset: the outbox's


class OutboxSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    path: str = "outbox.db"
    # The durability of every class that does not name its own (see `Durability`).
    durability: Durability = "power"
    # Before `durability`: NORMAL or FULL. Still read (FULL is "power", NORMAL "crash") when
    # `durability` is not given, with a warning; see `deprecated_keys`.
    synchronous: Synchronous | None = None
    max_attempts: Positive = 20
    backoff_base_s: PositiveFloat = 1.0
    backoff_cap_s: PositiveFloat = 300.0
    transient_floor_s: NonNegativeFloat = 0.5
    classes: dict[str, OutboxClassSection] = msgspec.field(default_factory=dict)


class RelaySection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    partitions: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    aimd_initial: Positive = 10
    aimd_min: Positive = 1
    aimd_max: Positive = 50
    reconnect_jitter_s: NonNegativeFloat = 5.0


class HeartbeatSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """When a worker heartbeats. Offline is seen from the connection (`[mqtt] keepalive_s` and
    the last will), so an idle device heartbeats rarely and says only what changed; it goes fast
    while it matters (an update downloading, installing, on trial, and `fast_hold_s` after its
    last report; or when the leader asks, as a rollout's soak does). docs/service.md, "What an
    idle device costs"."""

    interval_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 300.0
    fast_interval_s: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 5.0
    fast_hold_s: NonNegativeFloat = 900.0  # fast this long after the updater's last report
    system_interval_s: PositiveFloat = 900.0  # the full system sample at least this often
    sample_change_pct: Annotated[float, msgspec.Meta(gt=0, le=100)] = 10.0  # or when cpu/mem/disk moved this much


class LeaderSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    heartbeat_deadline_s: PositiveFloat = 30.0
    # How long the heartbeat intake rests after each write, gathering the next batch: None: 0 on
    # leader.db (a batch costs little more than its rows), 0.1 s with `database` on PostgreSQL
    # (a statement costs more than its rows there: fewer, larger batches, also with two leaders).
    process_interval_s: NonNegativeFloat | None = None
    job_window_max: Positive = 64
    # The identities (device ids of their credentials) that may submit jobs over MQTT. A device
    # is not one of them: the jobs it would submit go to every other worker.
    operators: list[DeviceName] = msgspec.field(default_factory=list)
    # Each device's share of the intake: beyond this many messages a second (bursts of
    # `device_burst`) its messages are answered busy, and its relay backs off. 0: no limit.
    device_rate_per_s: NonNegativeFloat = 1000.0
    device_burst: Positive = 2000
    # What the leader keeps per device: the last value of at most this many telemetry names (a
    # record of a further name is refused; the device's outbox dead-letters it).
    telemetry_names_max: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 256
    # Empty: this leader subscribes to every device's uplink itself. A group name: it joins the
    # MQTT shared subscription `$share/{group}/...` with the other leaders of the fleet, which is
    # safe only on a broker that checks subscriptions (see docs/service.md, "Several leaders").
    shared_group: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")] = ""
    # Where the fleet's device registry, application messages and rejects live. Empty: leader.db
    # in the data dir. "postgresql://USER@HOST[:PORT]/DB[?sslmode=verify-full&sslrootcert=...]":
    # that database, shared by every leader of the fleet given the same URL (docs/service.md,
    # "Several leaders on PostgreSQL"). Its password: `database_password_file` (mode 0600), else
    # libpq's own (PGPASSWORD, PGPASSFILE, ~/.pgpass).
    database: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    database_password_file: str = ""
    # Several leaders on one PostgreSQL database: one runs the rollouts, by a lease it renews every
    # third of this time; a standby takes over at most this long after the holder's last renewal.
    rollout_lease_s: Annotated[float, msgspec.Meta(ge=1.0, le=15.0)] = 10.0
    # ... and one runs the job queue, by a lease of its own (`agent.leader.jobs`): a standby
    # takes the queue over at most this long after the holder's last renewal.
    job_lease_s: Annotated[float, msgspec.Meta(ge=1.0, le=15.0)] = 10.0


class JobsSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    demand_window: Positive = 4


class MetricsSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    listen: str = ""  # "127.0.0.1:9100"; empty means off


class FirmwareSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Firmware updates on a worker; off while neither `public_key` nor `trust_root` is set. The
    leader's names the key (or the trust) it checks artifacts and config releases with."""

    public_key: str = ""  # the fleet's pinned ed25519 public key (PEM)
    # instead of one pinned key: the fleet's root key (PEM), which signs the trust document that
    # lists the signing keys (docs/rollout.md, "Rotating the fleet's keys")
    trust_root: str = ""
    trust_document: str = ""  # a leader: the document it hands devices with every offer
    state_dir: str = "firmware"  # updater state and A/B slot directories, relative to data_dir
    hardware: str = ""  # this device's hardware name, checked against the manifest
    image: str = ""  # the image this device runs (the manifest's name, e.g. "camera"); empty: any
    health_timeout_s: PositiveFloat = 120.0
    # on a trial boot, a leader that announced itself offline (its last will) is waited for this
    # long instead of reverting the image: the leader's outage is not the image's fault
    leader_wait_s: PositiveFloat = 3600.0
    health_command: list[str] = msgspec.field(default_factory=list)  # must exit 0 after a trial boot
    reboot_command: list[str] = msgspec.field(default_factory=list)  # empty: restart the agent in place
    # a reboot command that returned and the device still up this long later failed (trial disarmed)
    reboot_timeout_s: PositiveFloat = 120.0
    # a file applications flock(2) while they must not be interrupted: no reboot into a new slot while held
    update_lock: str = ""
    # what an update changes: the name of an installer backend (firmware_rollout.device.backends);
    # its settings are the table [firmware.NAME], which the backend decodes and checks
    installer: Annotated[str, msgspec.Meta(min_length=1, max_length=32, pattern=r"^[a-z][a-z0-9_-]*$")] = "directory"
    installer_settings: dict[str, Any] | None = None  # that table, as the file gives it (None: absent)
    # The root install helper (`edge-agent install-helper`, edge-agent-installer.socket): when
    # set, the agent asks it for every slot write, boot switch and reboot instead of doing them
    # itself, and the helper runs the backend `installer` names with its own state directory.
    helper_socket: str = ""
    helper_state_dir: str = "/var/lib/edge-agent-installer"
    # the socket's group: holds only the agent's user (not `edge-agent`, which applications join
    # for the local API); the helper itself answers only root and the uid of `helper_user`
    helper_group: str = "edge-agent-installer"
    helper_user: str = "edge-agent"
    # Downloads. A cap on the average rate (kilobits per second; 0: none), how many permanent
    # errors (a 404, a bad chunk, a file that is not the artifact) a download may meet before the
    # device gives up and reports `failed`, how long a mirror may take to answer, and the CA
    # bundle for https mirrors (empty: the system's).
    max_download_kbps: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 0
    retry_budget: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 5
    mirror_timeout_s: PositiveFloat = 10.0
    mirror_ca: str = ""

    @property
    def keyed(self) -> bool:
        """Whether artifacts and releases can be checked: a pinned key or a trust root."""
        return bool(self.public_key or self.trust_root)


class AppsSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Applications (`app_rollout`): on a worker, on while `helper_socket` is set (and
    `[firmware]` names the fleet's key); in the application helper's own config, where it keeps
    them."""

    # the root application helper (`edge-agent app-helper`, edge-agent-apps.socket): it installs,
    # starts, checks and takes back every application for the unprivileged agent
    helper_socket: str = ""
    state_dir: str = "apps"  # downloads and the apply's journal, relative to data_dir
    # the helper's: where it keeps each application's versions, and paths no application may see
    root: str = "/var/lib/edge-agent-apps"
    hidden: list[Annotated[str, msgspec.Meta(pattern=r"^/[^\s]{0,255}$")]] = msgspec.field(
        default_factory=lambda: ["/var/lib/edge-agent", "/etc/edge-agent", "/var/lib/edge-agent-installer"])
    # the root of the systemd units it writes (edge-app-NAME.service)
    unit_dir: str = "/etc/systemd/system"


DAY_S = 86_400.0


class HousekeepingSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Pruning of the tables that only grow; why these retentions: `agent.housekeeping`."""

    interval_s: PositiveFloat = 600.0
    batch_rows: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1_000
    processed_retention_s: PositiveFloat = 14 * DAY_S  # leader: processed message and report ids
    jobs_retention_s: PositiveFloat = 14 * DAY_S  # leader: confirmed jobs
    ledger_retention_s: PositiveFloat = 14 * DAY_S  # worker: the job ledger
    rollouts_retention_s: PositiveFloat = 90 * DAY_S  # leader: per-device rows of finished rollouts


ClassMode = Literal["append", "overwrite"]
ClassKey = Annotated[str, msgspec.Meta(min_length=1, max_length=48, pattern=r"^[a-z0-9][a-z0-9_-]*$")]


class MessageClassSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One class of application messages (`[classes.NAME]`): how the outbox keeps it."""

    mode: ClassMode = "append"  # overwrite: only the newest message per key is kept and sent
    ttl_s: NonNegativeFloat = 0.0  # 0: kept until delivered
    max_messages: Positive = 100_000
    max_bytes: Positive = 64 * 1024 * 1024
    full_policy: FullPolicy = "reject"  # reject: the application is told 429; drop_oldest: oldest go
    max_payload_bytes: Annotated[int, msgspec.Meta(ge=1, le=1024 * 1024)] = 64 * 1024
    fifo: bool = False
    durability: Durability | None = None  # unset: the outbox's (`[outbox] durability`)


def default_classes() -> dict[str, MessageClassSection]:
    """The classes a worker offers when its config names none."""
    return {
        "telemetry": MessageClassSection(mode="append", ttl_s=7 * DAY_S, full_policy="drop_oldest"),
        "events": MessageClassSection(mode="append", ttl_s=7 * DAY_S),
        "state": MessageClassSection(mode="overwrite"),
    }


class LocalApiSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The worker's local API for device applications (`agent.worker.local_api`)."""

    enabled: bool = True
    # "": $RUNTIME_DIRECTORY/api.sock under systemd, else api.sock in the data dir
    socket: str = ""
    group: str = "edge-agent"  # the socket is mode 0660, this group: who may hand us messages
    listen: str = ""  # a loopback "127.0.0.1:8731" as well (off by default)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=64 * 1024 * 1024)] = 4 * 1024 * 1024
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 500
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 32
    direct_timeout_s: PositiveFloat = 5.0  # a direct send not answered by then goes to the outbox


class SystemSourceSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    interval_s: PositiveFloat = 60.0
    cls: ClassKey = msgspec.field(default="telemetry", name="class")


class CommandSourceSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    command: list[str]
    interval_s: PositiveFloat = 60.0
    timeout_s: PositiveFloat = 30.0
    cls: ClassKey = msgspec.field(default="telemetry", name="class")
    max_lines: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1000


class FileSourceSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    path: str
    cls: ClassKey = msgspec.field(default="events", name="class")
    poll_s: PositiveFloat = 1.0
    max_line_bytes: Annotated[int, msgspec.Meta(ge=16, le=1024 * 1024)] = 64 * 1024


class SourcesSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Built-in sources of application messages (each off unless configured)."""

    system: SystemSourceSection | None = None
    command: dict[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")], CommandSourceSection] = (
        msgspec.field(default_factory=dict))
    file: dict[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")], FileSourceSection] = (
        msgspec.field(default_factory=dict))


class MessagesSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The leader's store of application messages (`agent.leader.messages`)."""

    retention_s: PositiveFloat = 14 * DAY_S
    max_bytes_per_device: Positive = 64 * 1024 * 1024


class NorthboundSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The leader forwards application messages to another broker (the cloud's), through its
    own outbox (`agent.leader.northbound`). Off while `url` is empty."""

    url: str = ""
    client_id: str = ""  # default: ea-{fleet}-northbound-{device_id}
    username: str = ""
    password_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    topic: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] = "edge-agent/{fleet}/{device}/{class}"
    topics: dict[ClassKey, Annotated[str, msgspec.Meta(min_length=1, max_length=256)]] = (
        msgspec.field(default_factory=dict))
    format: Literal["envelope", "raw"] = "envelope"
    outbox: str = "northbound.db"
    max_messages: Positive = 1_000_000
    max_bytes: Positive = 1024 * 1024 * 1024


class ArtifactsSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`[artifacts]`: the leader's artifact HTTP server, from which devices fetch the chunks of
    the images it rolls out with range requests (MQTT chunks stay the fallback)."""

    listen: str = "127.0.0.1:8093"  # the address devices reach; empty: off (devices download over mirrors or MQTT)
    # what the leader tells devices to fetch from (empty: http(s)://{this host's name}:{port})
    url: Annotated[str, msgspec.Meta(max_length=400)] = ""
    max_downloads: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 32  # answered at once; beyond: 503
    retry_after_s: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 2
    tls_cert: str = ""  # both set: https, as the broker's listener
    tls_key: str = ""
    # set (with tls_cert): only clients with a certificate this CA signed are served (the
    # broker's CA, which signed the devices' own certificates: mutual TLS)
    client_ca: str = ""
    # one address's downloads at once (0: a quarter of max_downloads); a download slower than
    # min_rate_kbps is ended (keep it below the slowest device's [firmware] max_download_kbps)
    max_downloads_per_address: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    min_rate_kbps: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 64


TARGET_NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"  # a configuration target's name (`[config_targets.NAME]`)
TargetName = Annotated[str, msgspec.Meta(pattern=TARGET_NAME)]
Command = Annotated[tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=4096)], ...],
                    msgspec.Meta(max_length=64)]


class ConfigTargetSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A configuration target of the device (`[config_targets.NAME]`): where a config release
    named NAME is written and how it is checked, applied and confirmed (`config_rollout.device`)."""

    directory: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]  # each document lands here, by name
    documents: Annotated[tuple[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")], ...],
                         msgspec.Meta(max_length=64)] = ()  # the names it takes (empty: any)
    mode: Annotated[str, msgspec.Meta(pattern=r"^0?[0-7]{3}$")] = "0644"
    # who owns each document written (a user and a group name, or numbers; "": the agent's own);
    # another owner than the agent's needs the agent to run with the right to give files away
    owner: Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z_][A-Za-z0-9_.-]{0,31}|\d{1,10})?$")] = ""
    group: Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z_][A-Za-z0-9_.-]{0,31}|\d{1,10})?$")] = ""
    validate_command: Command = ()  # run on the staged documents: "{staged}" is their folder
    apply_command: Command = ()  # run once the documents are in place (e.g. systemctl reload app)
    health_command: Command = ()  # must pass within confirm_s, or the old documents come back
    confirm_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 60.0
    # the confirm looks first this long after the apply: a change that cuts the device off a
    # moment later (a network reload) is caught, not confirmed before it bites
    settle_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 5.0
    # > 0: a staged release waits this long for an application's verdict through the local API
    # (GET /v1/config/NAME/staged, POST /v1/config/NAME/verdict); none by then refuses it
    app_validate_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.0
    command_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    max_document_kib: Annotated[int, msgspec.Meta(ge=1, le=16 * 1024)] = 64
    # the systemd units this configuration drives: their journal around a failed or reverted
    # apply goes with its report (secrets redacted), beside the agent's own log
    units: Annotated[tuple[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9:_.@-]{1,255}$")], ...],
                     msgspec.Meta(max_length=8)] = ()


class IdentitySection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Device identities (docs/service.md, "Device identity"). A worker makes its own key, enrols
    over the broker's enrolment listener with the fleet's claim credential, then connects with its
    own certificate (mutual TLS) and renews it; a leader holds the fleet's CA, the pending
    enrolments, the revocations and the broker's revocation list."""

    dir: str = "identity"  # under agent.data_dir: a worker's key and certificate; a leader's CA
    # a worker
    claim_url: str = ""  # the broker's enrolment listener, e.g. mqtts://gateway:8884
    claim_username: str = ""  # the fleet's claim credential
    claim_password_file: str = ""
    claim_ca: str = ""  # the CA the enrolment listener's certificate is checked with (default: mqtt.tls_ca)
    token_file: str = ""  # a batch's enrolment token (`edge-agent devices token`): approved at once
    ask_interval_s: PositiveFloat = 60.0  # while pending, the request is sent again this often
    # a leader
    claims: list[DeviceName] = msgspec.field(default_factory=list)  # claim usernames heard
    cert_days: Annotated[float, msgspec.Meta(gt=0, le=3650)] = 365.0
    # a certificate is valid from this long before it is issued: a device clock that lags takes it
    clock_skew_s: Annotated[int, msgspec.Meta(ge=0, le=86_400)] = 300
    max_pending: Positive = 1000
    # a pending record whose device has not asked for this long is forgotten (it asks again: a new one)
    pending_expiry_s: PositiveFloat = 86_400.0
    # enrolment requests heard per enrolling connection (its client id, which the broker's ACL puts
    # in the topic), then per claim credential, then in all: one holder flooding cannot starve another
    connection_rate_per_min: Positive = 6
    claim_rate_per_min: Positive = 60
    total_rate_per_min: Positive = 600
    # names no device may take besides the fleet's leaders, operators and claim credentials and the
    # broker's client ids (`ea-...`): the broker's admin, any further `user` of the broker's ACL
    reserved: list[DeviceName] = msgspec.field(default_factory=lambda: ["admin"])
    crl_file: str = ""  # the broker's crlfile (default: DIR/crl.pem)
    broker_reload: list[str] = msgspec.field(default_factory=list)  # run after the CRL changed


UserName = Annotated[str, msgspec.Meta(max_length=32, pattern=r"^([A-Za-z_][A-Za-z0-9_.-]{0,31})?$")]
ForwardTarget = Annotated[str, msgspec.Meta(max_length=300, pattern=r"^[A-Za-z0-9.:_\[\]-]+:(\*|[0-9]{1,5})$")]


class RemoteSection(_Section, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Remote sessions (`edge-agent devices shell`, `devices forward`; docs/remote.md). On a
    device: what it takes, all off unless said here (a config release cannot turn them on). On a
    leader: who may open them, by the operator's user name on the gateway (the kernel's word for
    who is on the operator socket)."""

    # -- a device --
    shell: bool = False  # take `devices shell`
    shell_user: UserName = ""  # whose shell ("": the agent's own user); another needs an agent run as root
    allow_root: bool = False  # shell_user "root" (or an agent run as root with shell_user "") only with this
    forward: Annotated[tuple[ForwardTarget, ...], msgspec.Meta(max_length=64)] = ()  # "HOST:PORT" or "HOST:*"
    logs: bool = False  # take `devices logs`: a bundle of its journal and its own log, secrets redacted
    logs_rate_kib_s: Annotated[int, msgspec.Meta(ge=1, le=1024 * 1024)] = 256  # a bundle's pace on the link
    logs_max_mib: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8  # a bundle's size at most, compressed
    max_sessions: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4  # at once on this device (a leader: per operator)
    idle_s: Annotated[float, msgspec.Meta(ge=10, le=86_400)] = 900.0  # no data either way this long: it ends
    max_s: Annotated[float, msgspec.Meta(ge=10, le=7 * 86_400)] = 8 * 3600.0  # a session ends after this, whatever
    audit_file: str = "remote-audit.jsonl"  # the device's record of its sessions, under the data dir
    # -- a leader --
    socket: str = "operator.sock"  # the operator socket, under the data dir (mode 0660, the agent's group)
    shell_operators: Annotated[tuple[UserName, ...], msgspec.Meta(max_length=256)] = ()  # may open a shell
    forward_operators: Annotated[tuple[UserName, ...], msgspec.Meta(max_length=256)] = ()  # may forward
    logs_operators: Annotated[tuple[UserName, ...], msgspec.Meta(max_length=256)] = ()  # may fetch log bundles
    record_input: bool = False  # keep what operators type into shells in the leader's audit (1 MiB a session)
    open_timeout_s: Annotated[float, msgspec.Meta(ge=1, le=120)] = 15.0  # the device's answer to an open


class AgentConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    agent: AgentSection
    mqtt: MqttSection = msgspec.field(default_factory=MqttSection)
    mailbox: MailboxSection = msgspec.field(default_factory=MailboxSection)
    outbox: OutboxSection = msgspec.field(default_factory=OutboxSection)
    relay: RelaySection = msgspec.field(default_factory=RelaySection)
    heartbeat: HeartbeatSection = msgspec.field(default_factory=HeartbeatSection)
    leader: LeaderSection = msgspec.field(default_factory=LeaderSection)
    jobs: JobsSection = msgspec.field(default_factory=JobsSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)
    firmware: FirmwareSection = msgspec.field(default_factory=FirmwareSection)
    apps: AppsSection = msgspec.field(default_factory=AppsSection)
    housekeeping: HousekeepingSection = msgspec.field(default_factory=HousekeepingSection)
    classes: dict[ClassKey, MessageClassSection] = msgspec.field(default_factory=default_classes)
    local_api: LocalApiSection = msgspec.field(default_factory=LocalApiSection)
    sources: SourcesSection = msgspec.field(default_factory=SourcesSection)
    messages: MessagesSection = msgspec.field(default_factory=MessagesSection)
    northbound: NorthboundSection = msgspec.field(default_factory=NorthboundSection)
    artifacts: ArtifactsSection = msgspec.field(default_factory=ArtifactsSection)
    config_targets: dict[TargetName, ConfigTargetSection] = msgspec.field(default_factory=dict)
    identity: IdentitySection | None = None
    remote: RemoteSection = msgspec.field(default_factory=RemoteSection)


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


def _describe(exc: msgspec.ValidationError) -> tuple[str | None, str]:
    """Turn msgspec's message into (dotted key, reason)."""
    match = _AT.match(str(exc))
    assert match is not None
    message = match["msg"]
    path = (match["path"] or "").lstrip(".")
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path).lstrip(".")
    for pattern, reason in ((_UNKNOWN, "unknown key"), (_MISSING, "required key is missing")):
        found = pattern.match(message)
        if found:
            key = f"{path}.{found['field']}" if path else found["field"]
            return key, reason
    reason = message[0].lower() + message[1:] if message else "invalid value"
    reason = reason.replace("`", "")
    return (path or None), reason


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; every failure is a `ConfigError` naming the file."""
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(name, None, "file not found") from None
    except OSError as exc:
        raise ConfigError(name, None, f"cannot read: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(name, None, "not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(name, None, f"not valid TOML: {exc}") from None


def decode_toml(path: str | Path, type_: type[T]) -> T:
    """Read a TOML file into `type_`; every failure is a `ConfigError` naming file and key."""
    return convert(read_toml(path), type_, source=str(path))


def _installer_table(data: dict[str, Any]) -> dict[str, Any]:
    """The table `[firmware.NAME]` of the installer `[firmware] installer` names, moved to
    `installer_settings`: the backend decodes it, the config does not know its keys."""
    fw = data.get("firmware")
    if not isinstance(fw, dict):
        return data
    name = fw.get("installer", FirmwareSection().installer)
    if not isinstance(name, str) or name in FirmwareSection.__struct_fields__ or not isinstance(fw.get(name), dict):
        return data
    table = {k: v for k, v in fw.items() if k != name}
    table["installer_settings"] = fw[name]
    return {**data, "firmware": table}


def convert(data: Any, type_: type[T], *, source: str) -> T:
    """Validate already-parsed data into `type_`, reporting errors against `source`."""
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        key, reason = _describe(exc)
        if key is not None and "[...]" in key:
            key = _name_the_entry(data, type_, key)
        raise ConfigError(source, key, reason) from None


def _name_the_entry(data: Any, type_: type[Any], key: str) -> str:
    """msgspec says `classes[...].mode` for a value of a table of tables: find which entry it
    is (`classes.telemetry.mode`) by validating the config with that table cut to one entry."""
    head, _, rest = key.partition("[...]")
    parts = head.split(".")
    table: Any = data
    for part in parts:
        table = table.get(part) if isinstance(table, dict) else None
    if not isinstance(table, dict):
        return key
    for name in table:
        trial = _with_table(data, parts, {name: table[name]})
        try:
            msgspec.convert(trial, type_)
        except msgspec.ValidationError:
            found = f"{head}.{name}{rest}"
            return _name_the_entry(trial, type_, found) if "[...]" in found else found
    return key


def _with_table(data: dict[str, Any], parts: list[str], table: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` with the table at `parts` replaced."""
    if len(parts) == 1:
        return {**data, parts[0]: table}
    return {**data, parts[0]: _with_table(data.get(parts[0], {}), parts[1:], table)}


def _check_retentions(config: AgentConfig, source: str) -> None:
    """A dedup window shorter than a message can still be resent re-applies a redelivery: each
    retention must cover this config's retry horizon (max_attempts x backoff_cap_s) and the
    longest outbox TTL it sets."""
    outbox = config.outbox
    horizon_s = outbox.max_attempts * outbox.backoff_cap_s
    ttl_s = max((c.ttl_s for c in outbox.classes.values()), default=0.0)
    floor_s = max(horizon_s, ttl_s)
    h = config.housekeeping
    for key in ("processed_retention_s", "jobs_retention_s", "ledger_retention_s", "rollouts_retention_s"):
        if getattr(h, key) < floor_s:
            raise ConfigError(source, f"housekeeping.{key}",
                              f"must be at least {floor_s:g} s (the outbox retry horizon and longest ttl_s)")
    # the leader's message store deduplicates application messages: it must outlive their TTLs
    app_floor_s = max(horizon_s, max((c.ttl_s for c in config.classes.values()), default=0.0))
    if config.messages.retention_s < app_floor_s:
        raise ConfigError(source, "messages.retention_s",
                          f"must be at least {app_floor_s:g} s (the outbox retry horizon and longest classes ttl_s)")


def _check_classes(config: AgentConfig, source: str) -> None:
    """Every class a source feeds must exist; a class's payload cap must fit its caps."""
    names = config.classes
    feeds = [("sources.system.class", config.sources.system.cls)] if config.sources.system else []
    feeds += [(f"sources.command.{n}.class", c.cls) for n, c in config.sources.command.items()]
    feeds += [(f"sources.file.{n}.class", c.cls) for n, c in config.sources.file.items()]
    for key, cls in feeds:
        if cls not in names:
            raise ConfigError(source, key, f"no class {cls!r} (the classes are {', '.join(sorted(names)) or 'none'})")
    for name, c in names.items():
        if c.max_payload_bytes > c.max_bytes:
            raise ConfigError(source, f"classes.{name}.max_payload_bytes", "must not exceed max_bytes")
    for name in config.northbound.topics:
        if name not in names:
            raise ConfigError(source, f"northbound.topics.{name}", f"no class {name!r}")
    for key, template in (("northbound.topic", config.northbound.topic),
                          *((f"northbound.topics.{n}", t) for n, t in config.northbound.topics.items())):
        try:
            template.format(fleet="f", device="d", **{"class": "c"})
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(source, key, f"{template!r}: only {{fleet}}, {{device}} and {{class}} may be"
                                           f" filled in ({exc})") from None


LOCAL_API_SOCKET = "api.sock"


def local_api_socket(config: AgentConfig, *, data_dir: Path | None = None,
                     env: Mapping[str, str] | None = None) -> Path:
    """Where the worker's local API listens: `[local_api] socket` as given (relative: under the
    data dir); empty: api.sock in systemd's RUNTIME_DIRECTORY, else in the data dir."""
    base = data_dir if data_dir is not None else Path(config.agent.data_dir)
    setting = config.local_api.socket
    if setting:
        return resolve(base, setting)
    runtime = (env if env is not None else os.environ).get("RUNTIME_DIRECTORY", "")
    if runtime:
        return Path(runtime.split(":")[0]) / LOCAL_API_SOCKET
    return base / LOCAL_API_SOCKET


def resolve(data_dir: Path, name: str) -> Path:
    """A path from the config: as given when absolute, else under the agent's data dir."""
    path = Path(name)
    return path if path.is_absolute() else data_dir / path


def _check_artifacts(config: AgentConfig, source: str) -> None:
    a = config.artifacts
    if a.listen:
        host, sep, port = a.listen.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(source, "artifacts.listen", f"{a.listen!r} is not HOST:PORT (e.g. 0.0.0.0:8093)")
    if a.url and not a.url.startswith(("http://", "https://")):
        raise ConfigError(source, "artifacts.url", f"{a.url!r} is not an http:// or https:// URL")
    if bool(a.tls_cert) != bool(a.tls_key):
        raise ConfigError(source, "artifacts.tls_key" if a.tls_cert else "artifacts.tls_cert",
                          "tls_cert and tls_key go together")
    if a.client_ca and not a.tls_cert:
        raise ConfigError(source, "artifacts.client_ca", "needs tls_cert and tls_key: client certificates are a TLS "
                                                         "matter")
    if config.firmware.mirror_ca and not Path(config.firmware.mirror_ca).is_absolute():
        raise ConfigError(source, "firmware.mirror_ca", "must be an absolute path")


def _check_leader_database(config: AgentConfig, source: str) -> None:
    from agent.core.sql import is_server_url, store_target

    lc = config.leader
    if lc.database:
        if not is_server_url(lc.database):
            raise ConfigError(source, "leader.database", "a postgresql://USER@HOST[:PORT]/DB URL (leave it out for"
                                                         " leader.db in the data dir)")
        store_target(lc.database, source=source, key="leader.database")
    elif lc.database_password_file:
        raise ConfigError(source, "leader.database_password_file", "needs leader.database")


def _check_identity(config: AgentConfig, source: str) -> None:
    ident = config.identity
    if ident is None or config.agent.role != "worker":
        return
    if not ident.claim_url.startswith("mqtts://"):
        raise ConfigError(source, "identity.claim_url", "the broker's enrolment listener, mqtts://host:port, is needed")
    if not ident.claim_username:
        raise ConfigError(source, "identity.claim_username", "the fleet's claim credential is needed")
    if not config.mqtt.url.startswith(("mqtts://", "memory://")):
        raise ConfigError(source, "mqtt.url", "a device with [identity] connects with its certificate: mqtts://")
    if config.mqtt.tls_cert or config.mqtt.tls_key:
        raise ConfigError(source, "mqtt.tls_cert" if config.mqtt.tls_cert else "mqtt.tls_key",
                          "[identity] keeps the device's own key and certificate: leave it out")


def _deprecated_synchronous(config: AgentConfig, data: dict[str, Any], source: str) -> AgentConfig:
    """`[outbox] synchronous`, the key before `durability`: FULL reads as "power", NORMAL as
    "crash" when `durability` is not given (one WARNING either way)."""
    outbox = config.outbox
    if outbox.synchronous is None:
        return config
    given = isinstance(data.get("outbox"), dict) and "durability" in data["outbox"]
    durability: Durability = outbox.durability if given else ("power" if outbox.synchronous == "FULL" else "crash")
    logging.getLogger("agent.config").warning(
        "%s: outbox.synchronous is deprecated: write durability = %r instead (%s)", source, durability,
        "durability is given and wins" if given else f"read as durability = {durability!r}")
    return msgspec.structs.replace(config, outbox=msgspec.structs.replace(outbox, durability=durability,
                                                                          synchronous=None))


#: What a config release of the built-in target `agent` may change of a worker's own settings
#: (`with_remote_settings`): nothing that names a place, a key, a command or the broker.
REMOTE_SETTINGS: dict[str, frozenset[str]] = {
    "agent": frozenset({"log_level"}),
    "heartbeat": frozenset({"interval_s", "fast_interval_s", "fast_hold_s", "system_interval_s", "sample_change_pct"}),
    "classes": frozenset({"ttl_s", "max_messages", "max_bytes", "full_policy", "max_payload_bytes"}),
    "sources.system": frozenset({"interval_s", "class"}),
}


def with_remote_settings(config: AgentConfig, settings: bytes, source: str) -> AgentConfig:
    """`config` with the settings of a release of the built-in target `agent` laid over it (TOML:
    `[agent] log_level`, `[heartbeat]`, `[classes.NAME]` of a class the config has, `[sources.system]`
    of a config that runs it); each value checked as the config file's own. A `ConfigError`
    names `source` and the key it refuses."""
    import tomllib

    try:
        data = tomllib.loads(settings.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(source, None, f"not valid TOML: {exc}") from None

    def merged(section: msgspec.Struct, given: Any, key: str, type_: type[T]) -> T:
        allowed = REMOTE_SETTINGS["classes" if key.startswith("classes.") else key]
        if not isinstance(given, dict):
            raise ConfigError(source, key, "must be a table")
        for name in given:
            if name not in allowed:
                raise ConfigError(source, f"{key}.{name}", "not a setting a release may change (it may change "
                                                          f"{', '.join(sorted(allowed))})")
        return convert({**msgspec.to_builtins(section), **given}, type_, source=f"{source}: [{key}]")

    changes: dict[str, Any] = {}
    for table, given in data.items():
        if table == "agent":
            changes["agent"] = merged(config.agent, given, "agent", AgentSection)
        elif table == "heartbeat":
            changes["heartbeat"] = merged(config.heartbeat, given, "heartbeat", HeartbeatSection)
        elif table == "classes" and isinstance(given, dict):
            classes = dict(config.classes)
            for name, values in given.items():
                if name not in classes:
                    raise ConfigError(source, f"classes.{name}", "no such class in this agent's config")
                classes[name] = merged(classes[name], values, f"classes.{name}", MessageClassSection)
            changes["classes"] = classes
        elif table == "sources" and isinstance(given, dict) and set(given) <= {"system"}:
            if config.sources.system is None:
                raise ConfigError(source, "sources.system", "this agent runs no system source")
            system = merged(config.sources.system, given["system"], "sources.system", SystemSourceSection)
            changes["sources"] = msgspec.structs.replace(config.sources, system=system)
        else:
            raise ConfigError(source, table, "not a setting a release may change (it may change [agent] log_level,"
                                             " [heartbeat], [classes.NAME] and [sources.system])")
    changed = msgspec.structs.replace(config, **changes)
    _check_retentions(changed, source)
    _check_classes(changed, source)
    return changed


def load_config(path: str | Path) -> AgentConfig:
    """Load and check an agent config file. The installer's own table is the backend's to check
    (`firmware_rollout.device.backends`: `preflight` and `config check` do)."""
    data = read_toml(path)
    config = _deprecated_synchronous(convert(_installer_table(data), AgentConfig, source=str(path)), data,
                                     str(path))
    relay = config.relay
    if not relay.aimd_min <= relay.aimd_initial <= relay.aimd_max:
        raise ConfigError(str(path), "relay.aimd_initial", "must lie between aimd_min and aimd_max")
    if config.outbox.backoff_base_s > config.outbox.backoff_cap_s:
        raise ConfigError(str(path), "outbox.backoff_base_s", "must not exceed backoff_cap_s")
    if config.mqtt.reconnect_min_s > config.mqtt.reconnect_max_s:
        raise ConfigError(str(path), "mqtt.reconnect_min_s", "must not exceed reconnect_max_s")
    _check_retentions(config, str(path))
    _check_classes(config, str(path))
    _check_artifacts(config, str(path))
    if "agent" in config.config_targets:
        raise ConfigError(str(path), "config_targets.agent", "the agent's own settings are a built-in target: leave"
                                                             " it out ([agent] remote_settings turns it off)")
    for name, target in config.config_targets.items():
        if target.settle_s >= target.confirm_s:
            raise ConfigError(str(path), f"config_targets.{name}.settle_s", "must be less than confirm_s")
    _check_identity(config, str(path))
    _check_leader_database(config, str(path))
    if config.remote.shell_user == "root" and not config.remote.allow_root:
        raise ConfigError(str(path), "remote.shell_user", "'root' needs remote.allow_root = true")
    scheme = config.mqtt.url.split("://", 1)[0] if "://" in config.mqtt.url else ""
    if scheme not in ("mqtt", "mqtts", "memory"):
        raise ConfigError(str(path), "mqtt.url", "must start with mqtt://, mqtts:// or memory://")
    return config


__all__ = [
    "with_remote_settings",
    "REMOTE_SETTINGS",
    "AgentConfig",
    "AgentSection",
    "ConfigTargetSection",
    "FirmwareSection",
    "AppsSection",
    "HeartbeatSection",
    "HousekeepingSection",
    "IdentitySection",
    "JobsSection",
    "LeaderSection",
    "LocalApiSection",
    "MessageClassSection",
    "MessagesSection",
    "NorthboundSection",
    "SourcesSection",
    "default_classes",
    "local_api_socket",
    "MailboxSection",
    "MetricsSection",
    "MqttSection",
    "OutboxClassSection",
    "OutboxSection",
    "RelaySection",
    "convert",
    "decode_toml",
    "load_config",
    "read_toml",
    "resolve",
]
