"""`edge-agent doctor --config FILE`: is this agent set up to work? One line per check, ✓ or ✗
with the fix, exit 1 on any ✗. It never changes state: nothing is created, migrated or sent
that the agent would have to undo.

    ✓ config        worker pi-0001 in fleet default (/etc/edge-agent/agent.toml)
    ✓ data dir      /var/lib/edge-agent: writable, 27,340 MiB free
    ✓ clock         synchronised (the kernel's NTP state)
    ✓ broker        127.0.0.1:8883 reached in 1 ms
    ✓ tls           TLSv1.3, the server certificate is valid until 2027-11-30 (364 days)
    ✓ credentials   accepted by the broker as pi-0001
    ✓ mqtt v5       the broker speaks MQTT v5 (connected in 12 ms)
    ✓ acl           may publish on ea/v1/default/pi-0001/up
    ✓ leader        answered in 4 ms
    ✓ local api     /run/edge-agent/api.sock answers (group edge-agent: myapp)
    ✓ dead letters  none in outbox.db

The MQTT checks connect with the agent's identity, so they run only while the agent does not
(the data directory's lock says); a running agent's own connection is read from its `/healthz`
when `[metrics] listen` is set.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.commands.arguments import positive_seconds
from agent.core.config import AgentConfig
from agent.core.errors import EdgeAgentError

if TYPE_CHECKING:
    from agent.transport import TlsSettings
    from agent.transport.probe import BrokerAddress

CHECKS = ("config", "data dir", "agent", "clock", "identity", "broker", "tls", "credentials", "mqtt v5", "acl",
          "leader", "firmware key", "installer", "apps", "commands", "local api", "leader db", "dead letters",
          "kept state", "housekeeping")
MIN_FREE_BYTES = 64 * 1024 * 1024  # as the agent's own disk check
CERT_WARN_DAYS = 30
_TIME_ERROR = 5  # adjtimex(2): the clock is not synchronised


@dataclass(frozen=True, slots=True)
class Outcome:
    name: str
    ok: bool | None  # None: not checked (skipped, or nothing to check)
    text: str
    fix: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="the agent's config file")
    parser.add_argument("--data-dir", metavar="DIR", help="as given to `run` (default: agent.data_dir)")
    parser.add_argument("--broker", metavar="URL", help="as given to `run` (default: mqtt.url)")
    parser.add_argument("--timeout", type=positive_seconds, default=5.0, metavar="SECONDS",
                        help="for each network step (default 5)")
    parser.add_argument("--skip", action="append", default=[], choices=CHECKS, metavar="CHECK",
                        help=f"leave a check out (repeatable): {', '.join(CHECKS)}")
    parser.add_argument("--json", action="store_true", help="print JSON")


def main(args: argparse.Namespace) -> int:
    outcomes = list(run_checks(args, skip=set(args.skip)))
    if args.json:
        print(json.dumps([{"check": o.name, "ok": o.ok, "text": o.text, "fix": o.fix} for o in outcomes]))
    else:
        width = max(len(o.name) for o in outcomes)
        for o in outcomes:
            mark = "✓" if o.ok else "✗" if o.ok is False else "-"
            print(f"{mark} {o.name:<{width}}  {o.text}")
            if o.ok is False and o.fix:
                print(f"  {'':<{width}}  fix: {o.fix}")
    return 1 if any(o.ok is False for o in outcomes) else 0


def run_checks(args: argparse.Namespace, *, skip: set[str]) -> Iterator[Outcome]:
    from agent.commands.preflight import preflight

    try:
        config = preflight(args.config, broker=args.broker)
    except EdgeAgentError as exc:
        yield Outcome("config", False, str(exc), "correct the file and run `edge-agent config check` again")
        return
    yield Outcome("config", True, f"{config.agent.role} {config.agent.device_id} in fleet {config.agent.fleet}"
                                  f" ({args.config})")
    data_dir = Path(args.data_dir or config.agent.data_dir)
    steps: list[tuple[str, Callable[[], Outcome]]] = [
        ("data dir", lambda: _data_dir(data_dir)),
        ("clock", _clock),
    ]
    for name, step in steps:
        if name not in skip:
            yield step()
    from agent.service.instance import running_pid

    pid = running_pid(data_dir)
    if "agent" not in skip:
        yield Outcome("agent", None, f"an agent runs on {data_dir} (pid {pid or '?'})" if pid is not None
                      else f"no agent runs on {data_dir}")
    identity: Outcome | None = None
    if config.identity is not None and config.agent.role == "worker":
        identity, config = _identity(config, data_dir)
    network = list(_network(config, args, skip, running=pid is not None))
    if identity is not None and "identity" not in skip:
        from agent.transport.probe import REVOKED_MARK

        if any(REVOKED_MARK in o.text for o in network if o.ok is False):  # valid dates, but revoked
            identity = Outcome("identity", False, f"this device is revoked: the broker refuses its certificate"
                                                  f" ({identity.text})",
                               "an operator revoked it (`edge-agent devices list --state revoked` on the gateway"
                               " says why); a revoked device id cannot enrol again")
        yield identity
    if config.identity is not None and config.agent.role == "leader" and "identity" not in skip:
        yield from _leader_identity(config, data_dir)
    yield from network
    yield from _local(config, data_dir, skip, timeout_s=args.timeout)


def _identity(config: AgentConfig, data_dir: Path) -> tuple[Outcome, AgentConfig]:
    """The device's own certificate: whether it has one, until when, when it renews; with one,
    the broker checks below connect with it, as the agent does."""
    from agent.core.errors import IdentityError
    from agent.identity.certificates import read_certificate
    from agent.identity.files import IdentityFiles, with_identity

    files = IdentityFiles.of(config, data_dir)
    ident = config.identity
    assert ident is not None
    try:
        info = read_certificate(files.cert.read_bytes())
    except FileNotFoundError:
        from agent.identity.device_key import device_key_fingerprint

        try:
            key = f", key {device_key_fingerprint(files.key.read_bytes())[:16]}"
        except (OSError, IdentityError):
            key = ""
        return Outcome("identity", False, f"not enrolled yet: no certificate in {files.dir} (the agent asks at"
                                          f" {ident.claim_url} as {config.agent.device_id}{key})",
                       f"approve it on the gateway: edge-agent devices approve {config.agent.device_id}"), config
    except (OSError, IdentityError) as exc:
        return Outcome("identity", False, f"{files.cert}: {exc}", "move it aside: the agent enrols again"), config
    now = time.time() * 1000
    until = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.not_after_ms / 1000))
    if info.expired(int(now)):
        return Outcome("identity", False, f"the device certificate expired {until} UTC",
                       "the agent enrols again at its next start: approve it on the gateway"), config
    renews = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.renew_at_ms / 1000))
    late = now >= info.renew_at_ms
    return (Outcome("identity", not late, f"certificate of {info.subject} (serial {info.serial:x}) valid until"
                                          f" {until} UTC, renewed from {renews} UTC",
                    "the agent renews it once connected to the leader: check the broker and leader below"
                    if late else ""),
            with_identity(config, files))


def _leader_identity(config: AgentConfig, data_dir: Path) -> Iterator[Outcome]:
    """A leader's identities: no certificate on record for a name no device may hold, and a CRL
    the broker's user can read (mosquitto reads it after dropping to its `mosquitto` user)."""
    from agent.identity.files import authority_files
    from agent.leader.database import shared_database
    from agent.leader.identities import IdentityStore, reserved_reason
    from agent.leader.readonly import open_leader_db
    from agent.service.files import unreadable_by

    ident = config.identity
    assert ident is not None
    try:
        target = shared_database(config, data_dir)
        with open_leader_db(target) as db:
            leaders = db.registry.leader_names() | {config.agent.device_id}
        with IdentityStore.open_readonly(target) as store:
            held = [(r.device, why) for r in store.listed("approved")
                    if (why := reserved_reason(r.device, leaders=leaders, operators=config.leader.operators,
                                               claims=ident.claims, reserved=ident.reserved))]
    except EdgeAgentError as exc:
        yield Outcome("identity", None, f"not checked: {exc}")
        return
    if held:
        yield Outcome("identity", False, "a device certificate of a reserved name is on record: "
                      + "; ".join(f"{device} ({why})" for device, why in held),
                      "revoke it at once: edge-agent devices revoke " + " ".join(d for d, _ in held))
    else:
        yield Outcome("identity", True, "no device certificate of a reserved name on record")
    _, _, crl = authority_files(ident, data_dir)
    why = unreadable_by(crl, "mosquitto")
    yield Outcome("crl", not why, why or f"{crl}: the broker's user can read it",
                  "" if not why else "set [identity] crl_file to a file in a folder the broker's user may read"
                                     " (docs/service.md: /var/lib/edge-agent-crl/crl.pem)")


def _data_dir(path: Path) -> Outcome:
    if path.is_dir():
        usage = shutil.disk_usage(path)
        if not os.access(path, os.W_OK | os.X_OK):
            return Outcome("data dir", False, f"{path}: not writable by this user",
                           "run doctor as the agent's user, or fix the directory's owner and mode")
        free = f"{usage.free // (1024 * 1024):,} MiB free"
        from agent.core.reserve import DiskReserve

        reserve = DiskReserve(path)
        if reserve.full(usage.free):
            return Outcome("data dir", False, reserve.disk_state(min_free_bytes=MIN_FREE_BYTES)[1],
                           "free space on that file system: the agent answers 503 for what it cannot store until then")
        if usage.free < MIN_FREE_BYTES:
            return Outcome("data dir", False, f"{path}: only {free}", "free space on that file system")
        return Outcome("data dir", True, f"{path}: writable, {free}")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and os.access(parent, os.W_OK | os.X_OK):
        return Outcome("data dir", None, f"{path}: not there yet (`run` creates it under {parent})")
    return Outcome("data dir", False, f"{path}: does not exist and cannot be created here",
                   "create it for the agent's user (install.sh does), or set agent.data_dir")


def _clock() -> Outcome:
    """The kernel's NTP state (what timedatectl's NTPSynchronized reads), also in a container."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        state = int(libc.adjtimex(ctypes.create_string_buffer(512)))  # modes 0: read only
    except (OSError, AttributeError):
        return Outcome("clock", None, "cannot tell on this system")
    if state < 0:
        return Outcome("clock", None, "cannot tell on this system")
    if state == _TIME_ERROR:
        return Outcome("clock", False, f"not synchronised (the time here is {time.strftime('%Y-%m-%d %H:%M:%S')})",
                       "enable time sync (systemd-timesyncd or chrony): TLS certificates, rollout"
                       " windows and the leader's clock checks need the right time")
    return Outcome("clock", True, "synchronised (the kernel's NTP state)")


def _network(config: AgentConfig, args: argparse.Namespace, skip: set[str], *, running: bool) -> Iterator[Outcome]:
    from agent.transport import TlsSettings
    from agent.transport.probe import broker_address, probe_tcp, probe_tls

    url = args.broker or config.mqtt.url
    if url.startswith("memory://"):
        yield Outcome("broker", None, "memory:// (simulation only): nothing to reach")
        return
    address = broker_address(url)
    where = f"{address.host}:{address.port}"
    if "broker" not in skip:
        try:
            rtt = probe_tcp(address, args.timeout)
        except OSError as exc:
            yield Outcome("broker", False, f"cannot reach {where}: {exc.strerror or exc}",
                          "check mqtt.url, that the broker runs, and the network and firewall between")
            if running:  # what else the running agent reports failing (a full disk, ...)
                yield from _running_agent(config, skip)
            return
        yield Outcome("broker", True, f"{where} reached in {rtt * 1000:.0f} ms")
    m = config.mqtt
    tls = None
    if address.tls or m.tls_ca or m.tls_cert:
        tls = TlsSettings(ca_file=m.tls_ca, cert_file=m.tls_cert, key_file=m.tls_key)
        if "tls" not in skip:
            import ssl

            try:
                shake = probe_tls(address, tls.context(), args.timeout)
            except (ssl.SSLError, OSError, EdgeAgentError) as exc:
                yield Outcome("tls", False, f"handshake with {where} failed: {exc}",
                              "check mqtt.tls_ca (the CA that signed the broker's certificate), the name in"
                              " mqtt.url against the certificate, and mqtt.tls_cert/tls_key")
                return
            days = (shake.not_after - time.time()) / 86400
            until = time.strftime("%Y-%m-%d", time.gmtime(shake.not_after))
            if days < CERT_WARN_DAYS:
                yield Outcome("tls", False, f"{shake.version}, the server certificate expires {until}"
                                            f" ({days:.0f} days)", "renew the broker's certificate")
            else:
                yield Outcome("tls", True, f"{shake.version}, the server certificate is valid until {until}"
                                           f" ({days:.0f} days)")
    if running:
        yield from _running_agent(config, skip)
        return
    yield from _session(config, address, tls, args.timeout, skip)


def _running_agent(config: AgentConfig, skip: set[str]) -> Iterator[Outcome]:
    if "credentials" in skip:
        return
    listen = config.metrics.listen
    if not listen:
        yield Outcome("credentials", None, "not checked: the running agent holds the connection (set [metrics]"
                                           " listen to read it from /healthz, or stop the agent)")
        return
    try:
        with urllib.request.urlopen(f"http://{listen}/healthz", timeout=5) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read() or b"{}")
    except (OSError, ValueError) as exc:
        yield Outcome("credentials", False, f"the running agent's /healthz at {listen} does not answer: {exc}",
                      "see `journalctl -u edge-agent`")
        return
    checks = body.get("checks", {})
    transport = checks.get("transport", {})
    ok = bool(transport.get("ok"))
    yield Outcome("credentials", ok, f"the running agent reports its broker connection: {transport.get('detail', '?')}",
                  "" if ok else "see `journalctl -u edge-agent -p warning` for why it cannot connect")
    for name, check in sorted(checks.items()):  # what else it reports failing (an artifact port taken, ...)
        if name != "transport" and isinstance(check, dict) and check.get("ok") is False:
            yield Outcome(name, False, f"the running agent reports: {check.get('detail', '?')}",
                          "see `journalctl -u edge-agent -p warning`")


def _session(config: AgentConfig, address: BrokerAddress, tls: TlsSettings | None, timeout_s: float,
             skip: set[str]) -> Iterator[Outcome]:
    import secrets

    from agent.app import client_id_of
    from agent.core.codec import Envelope, decode_reply, encode
    from agent.protocol import KIND_PING, Ping, encode_message
    from agent.transport import topics
    from agent.transport.mqtt import DEFAULT_SESSION_EXPIRY_S, read_password
    from agent.transport.probe import SessionRequest, probe_session

    if {"credentials", "mqtt v5", "acl", "leader"} <= skip:
        return
    a = config.agent
    worker = a.role == "worker"
    token = secrets.token_hex(8)
    request = encode(Envelope(id=f"doctor-{token}", kind=KIND_PING, sender=a.device_id, receiver="leader",
                              payload=encode_message(Ping(sent_ms=int(time.time() * 1000))))) if worker else None
    m = config.mqtt
    probe = probe_session(address, SessionRequest(
        client_id=client_id_of(config), username=m.username or None,
        password=read_password(m.password_file) if m.password_file else None, tls=tls,
        clean_start=not worker, session_expiry_s=DEFAULT_SESSION_EXPIRY_S,
        up_topic=topics.up(a.fleet, a.device_id), reply_topic=topics.reply(a.fleet, a.device_id, "doctor"),
        request=request, correlation=token.encode()), timeout_s)
    failure = probe.failure
    if failure is not None:
        text = failure.text
        if "credentials" in text:
            yield Outcome("credentials", False, text, "set mqtt.username and mqtt.password_file to what the broker"
                                                      " has for this device")
        elif "MQTT v5" in text:
            yield Outcome("credentials", None, "not checked")
            yield Outcome("mqtt v5", False, text, "use a broker that speaks MQTT v5 (mosquitto 2, EMQX, HiveMQ)")
        else:
            yield Outcome("credentials", False, f"cannot open an MQTT session: {text}",
                          "see the broker's log for why it ended the connection")
        return
    user = m.username or "(anonymous)"
    yield Outcome("credentials", True, f"accepted by the broker as {user}")
    yield Outcome("mqtt v5", True, f"the broker speaks MQTT v5 (connected in {probe.connect_s * 1000:.0f} ms)")
    if not worker:
        return
    up = topics.up(a.fleet, a.device_id)
    if probe.publish_reason is None or probe.publish_reason >= 0x80:
        why = "no PUBACK" if probe.publish_reason is None else f"PUBACK reason {probe.publish_reason:#x}"
        mismatch = m.username and m.username != a.device_id
        yield Outcome("acl", False, f"may not publish on {up} ({why})",
                      f"mqtt.username {m.username!r} and agent.device_id {a.device_id!r} must be the same"
                      if mismatch else "the broker's ACL must let this device write ea/v1/+/<its username>/up")
        return
    yield Outcome("acl", True, f"may publish on {up}")
    if "leader" in skip:
        return
    if probe.reply is None:
        yield Outcome("leader", False, f"no answer within {timeout_s:g}s",
                      f"is the leader running on the same broker and fleet {a.fleet!r}, and may this device"
                      f" read ea/v1/{a.fleet}/{a.device_id}/reply/#?")
        return
    try:
        status: str = decode_reply(probe.reply).status
    except EdgeAgentError:
        status = "unreadable"
    rtt = f"in {probe.reply_s * 1000:.0f} ms" if probe.reply_s is not None else ""
    yield Outcome("leader", status in ("accepted", "busy"), f"answered {status} {rtt}".rstrip(),
                  "" if status in ("accepted", "busy") else "the leader refused the request: see `edge-agent"
                                                            " rejects list` on the leader")


def _local(config: AgentConfig, data_dir: Path, skip: set[str], *, timeout_s: float) -> Iterator[Outcome]:
    fw = config.firmware
    if fw.trust_root and "firmware key" not in skip:
        yield _trust(config, data_dir)
    if fw.public_key and "firmware key" not in skip:
        try:
            from rollout_engine.keys import load_verify_key

            load_verify_key(fw.public_key)
            yield Outcome("firmware key", True, f"{fw.public_key}: an ed25519 public key")
        except (EdgeAgentError, OSError, ValueError) as exc:
            yield Outcome("firmware key", False, f"{fw.public_key}: {exc}",
                          "point firmware.public_key at the fleet's public.pem")
    if fw.keyed and config.agent.role == "worker" and "installer" not in skip:
        yield _installer(config, data_dir)
    if config.apps.helper_socket and config.agent.role == "worker" and "apps" not in skip:
        yield _apps(config, timeout_s=timeout_s)
    commands = [(n, c) for n, c in (("firmware.reboot_command", fw.reboot_command),
                                    ("firmware.health_command", fw.health_command)) if c]
    if commands and "commands" not in skip:
        missing = [f"{n} ({c[0]})" for n, c in commands if shutil.which(c[0]) is None]
        yield (Outcome("commands", False, "not found or not executable: " + ", ".join(missing),
                       "install them or give their full path") if missing
               else Outcome("commands", True, ", ".join(f"{n}: {shutil.which(c[0])}" for n, c in commands)))
    if config.agent.role == "worker" and config.local_api.enabled and "local api" not in skip:
        yield _local_api(config, data_dir)
    if config.agent.role == "leader" and "leader db" not in skip:
        if config.leader.database:
            yield _fleet_database(config, data_dir)
        else:
            yield _leader_db(data_dir / "leader.db")
    if "dead letters" not in skip:
        yield _dead_letters(data_dir / "outbox.db")
    if "kept state" not in skip:
        yield _kept_state(data_dir)
    if "housekeeping" not in skip:
        h = config.housekeeping
        yield Outcome("housekeeping", True, f"every {h.interval_s:g}s; message ids kept"
                                            f" {h.processed_retention_s / 86400:g} days")


def _trust(config: AgentConfig, data_dir: Path) -> Outcome:
    """The trust root and the trust document held (what signing keys this agent accepts)."""
    from rollout_engine.trust import TrustedKeys, load_fleet_keys

    fw = config.firmware
    state = data_dir / "trust"
    try:
        keys = load_fleet_keys(public_key="", trust_root=fw.trust_root, trust_document=fw.trust_document,
                               state_dir=None, now_ms=lambda: int(time.time() * 1000))
        assert isinstance(keys, TrustedKeys)
        keys.state_dir = state
        keys.restore()
    except EdgeAgentError as exc:
        return Outcome("firmware key", False, str(exc), "check firmware.trust_root and the trust document")
    if keys.document is None:
        return Outcome("firmware key", None, f"trust root {fw.trust_root}: no trust document held yet (one comes"
                                             " with the next offer)")
    now = time.time() * 1000
    live = sum(1 for _, expires in keys.document.keys.values() if expires > now)
    return Outcome("firmware key", live > 0, f"trust document v{keys.version}: {live} signing key(s) in force",
                   "" if live else "every signing key of the document expired: the leader needs a newer document")


def _without_sides(name: str) -> str:
    """A database's name without the suffix of its -wal, -shm, -journal or .mark beside it."""
    for side in ("-wal", "-shm", "-journal", ".mark"):
        name = name.removesuffix(side)
    return name


def _kept_state(data_dir: Path) -> Outcome:
    """Databases the agent moved aside as evidence: damaged (`.corrupt-`) or holding less than
    it had committed (`.lost-`, see `agent.core.marks`)."""
    if not data_dir.is_dir():
        return Outcome("kept state", None, f"{data_dir}: not there yet")
    kept = sorted({_without_sides(p.name) for p in data_dir.iterdir() if ".corrupt-" in p.name or ".lost-" in p.name})
    if not kept:
        return Outcome("kept state", True, "no database was moved aside")
    lost = [k for k in kept if ".lost-" in k]
    what = f"{len(lost)} lost state, {len(kept) - len(lost)} damaged" if lost else "damaged"
    return Outcome("kept state", False, f"moved aside as evidence ({what}): {', '.join(kept)}",
                   "what they held was not delivered from there: look into them, then delete them")


def _installer(config: AgentConfig, data_dir: Path) -> Outcome:
    """What an update changes on this device, read from the boot machinery itself."""
    from agent.core.clock import SystemClock
    from agent.worker.installers import firmware_state_dir, installer_from_config
    from firmware_rollout.device.backends import BACKENDS, configured_backend

    fw = config.firmware
    try:
        installer = installer_from_config(fw, firmware_state_dir(fw, data_dir), clock=SystemClock(),
                                          verify_key=None)
    except (EdgeAgentError, OSError) as exc:
        return Outcome("installer", False, f"{fw.installer}: {exc}",
                       "see docs/firmware-devices.md for the installer's setup")
    trial = installer.trial_slot()
    where = f"booted {installer.booted_slot()}, default {installer.default_slot()}, " + (
        f"trial {trial} armed" if trial else "no trial")
    if not fw.helper_socket and not configured_backend(fw).backend.reboots:
        booting = " or ".join(f'"{name}"' for name, _ in sorted(BACKENDS.items()) if name != installer.name)
        return Outcome("installer", True, f"{installer.name} ({where}): updates change nothing this device boots",
                       f"set [firmware] installer = {booting} on a real device")
    if not fw.helper_socket:
        return Outcome("installer", True, f"{installer.name}: {where}")
    door = _helper_door(Path(fw.helper_socket), fw.helper_group, fw.helper_user)
    if door:
        return Outcome("installer", False, f"{installer.name} through the install helper ({where}): {door}",
                       f"the socket's group is {fw.helper_group!r} with the agent's user {fw.helper_user!r} alone "
                       "(install.sh makes it so; edge-agent-installer.socket's SocketGroup=)")
    return Outcome("installer", True, f"{installer.name} through the install helper: {where}")


def _apps(config: AgentConfig, *, timeout_s: float) -> Outcome:
    """The application helper, asked what it keeps (its socket starts it; describing changes
    nothing), and who may open its socket."""
    from agent.core.clock import SystemClock
    from app_rollout.device.client import AppHelperClient
    from app_rollout.errors import AppInstallError

    sock = config.apps.helper_socket
    door = _helper_door(Path(sock), "edge-agent-apps", config.firmware.helper_user)
    if door:
        return Outcome("apps", False, f"the application helper: {door}",
                       f"the socket's group is 'edge-agent-apps' with the agent's user {config.firmware.helper_user!r}"
                       " alone (install.sh makes it so; edge-agent-apps.socket's SocketGroup=)")
    client = AppHelperClient(sock, clock=SystemClock(), timeout_s=timeout_s)
    try:
        reply = client.call("describe")
    except AppInstallError as exc:
        return Outcome("apps", False, str(exc), "run doctor as root or as the agent's user; see docs/apps.md")
    finally:
        client.close()
    kept = [f"{name} {r.current or '-'}" + (f" (trial {r.trial})" if r.trial else "")
            for name, r in sorted(reply.apps.items()) if r.installed]
    gone = [f"{name} at {r.removed}" for name, r in sorted(reply.apps.items()) if not r.installed and r.removed]
    said = (f"{len(kept)} application(s): {', '.join(kept)}" if kept else "no application") + (
        f" (removed: {', '.join(gone)})" if gone else "")
    return Outcome("apps", True, f"the application helper at {sock} keeps {said} in {reply.root}")


def _helper_door(sock: Path, group: str, user: str) -> str:
    """What is wrong with who may open the install helper's socket ("" when nothing)."""
    import grp

    try:
        gid = sock.stat().st_gid
    except OSError:
        return ""  # not there yet: the socket unit makes it; `config check` says so
    try:
        found = grp.getgrgid(gid)
    except KeyError:
        return f"{sock} belongs to group {gid}, which has no name"
    if found.gr_name != group:
        return f"{sock} belongs to group {found.gr_name!r}, not {group!r}"
    others = sorted(set(found.gr_mem) - {user})
    if others:
        return f"group {group!r} also holds {', '.join(others)}: they may open the socket (the helper refuses them)"
    return ""


def _local_api(config: AgentConfig, data_dir: Path) -> Outcome:
    """Where the worker's local API listens, whether it answers, and who may use it."""
    import grp

    from agent.client import AgentUnavailable, Client
    from agent.core.config import local_api_socket

    api = config.local_api
    sock = local_api_socket(config, data_dir=data_dir)
    try:
        members = grp.getgrnam(api.group).gr_mem
    except KeyError:
        return Outcome("local api", False, f"{sock}: there is no group {api.group!r}: only the agent's own user"
                                           " could hand it messages",
                       f"create it (`groupadd --system {api.group}`, install.sh does) and add the applications' users")
    who = f"group {api.group}: {', '.join(members) or 'no members yet'}"
    if not sock.exists():
        return Outcome("local api", None, f"{sock}: not there (the agent creates it at start; {who})")
    try:
        with Client(sock, timeout_s=5) as client:
            client.status()
    except AgentUnavailable as exc:
        return Outcome("local api", False, f"{sock} does not answer: {exc}",
                       "is the agent running? A socket left by a dead agent goes at the next start")
    return Outcome("local api", True, f"{sock} answers ({who})")


def _leader_db(path: Path) -> Outcome:
    """The check `run` makes before it opens leader.db (`damage_report`), then how many devices."""
    from agent.core.sqlite import damage_report
    from agent.leader.readonly import open_leader_db

    if not path.exists():
        return Outcome("leader db", None, f"{path}: not created yet (the leader's first start does)")
    try:
        problem = damage_report(path)
        if problem is None:
            with open_leader_db(path) as db:
                devices = db.registry.count()
    except EdgeAgentError as exc:
        problem = str(exc)
    if problem is not None:
        return Outcome("leader db", False, f"{path}: damaged ({problem})",
                       "stop the leader and start it once with `edge-agent run --recover`")
    return Outcome("leader db", True, f"{path}: ok, {devices} devices")


def _fleet_database(config: AgentConfig, data_dir: Path) -> Outcome:
    """`[leader] database`: PostgreSQL reachable, with this fleet's registry (or none yet)."""
    from agent.leader.database import shared_database
    from agent.leader.readonly import open_leader_db

    try:
        target = shared_database(config, data_dir)
        with open_leader_db(target) as db:
            devices, leaders = db.registry.count(), db.registry.leaders()
    except EdgeAgentError as exc:
        if "no registry tables" in str(exc):
            return Outcome("leader db", None, f"{exc} (the first leader to start makes them)")
        return Outcome("leader db", False, str(exc),
                       "is PostgreSQL up, and the URL, the password (file or ~/.pgpass) and TLS options right?")
    served = ", ".join(f"{name} {n}" for name, n in leaders.items()) or "none yet"
    return Outcome("leader db", True, f"{target}: ok, {devices} devices (served last by: {served})")


def _dead_letters(path: Path) -> Outcome:
    from agent.outbox.commands import read_dead_letters

    if not path.exists():
        return Outcome("dead letters", None, f"{path}: no outbox yet")
    try:
        dead, _ = read_dead_letters(path, limit=0)
    except EdgeAgentError as exc:
        return Outcome("dead letters", False, f"cannot read ({exc})",
                       f"`edge-agent outbox stats --db {path}` says more")
    if dead:
        return Outcome("dead letters", False, f"{dead} in {path}",
                       f"see why with `edge-agent dlq list --db {path}`, then replay or purge them")
    return Outcome("dead letters", True, f"none in {path.name}")
