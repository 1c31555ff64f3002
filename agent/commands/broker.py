"""`edge-agent broker`: the roles of a fleet on mosquitto's dynamic-security plugin, for several
leaders on one shared subscription (docs/service.md, "Several leaders on one broker").

    edge-agent broker fleet  --url mqtt://127.0.0.1:1883 --admin-password-file F [--fleet default]
    edge-agent broker leader NAME --password-file P --url ... --admin-password-file F
    edge-agent broker device ID --password-file P --leader gateway-01 [--leader gateway-02] --url ...

mosquitto 2.0's `acl_file` does not check subscriptions, so any device could join the leaders'
shared subscription (`$share/leaders/...`) and be handed a share of the fleet's uplinks. The
dynamic-security plugin does check them: the fleet's role `ea-leaders-FLEET` alone may subscribe
there. The plugin (2.0.11) does not substitute %u or %c in its topics, so each device and each
leader gets a role of its own naming its own topics, and its client id is pinned to the one the
agent uses (`ea-FLEET-worker-ID`, `ea-FLEET-leader-NAME`): its credentials cannot take over another
session. The commands go to the plugin over MQTT (`$CONTROL/dynamic-security/v1`) with the admin
made by `mosquitto_ctrl dynsec init`; passwords are read from files, never from the command line.
Running a command again changes nothing that is already there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agent.core.errors import ConfigError, EdgeAgentError

CONTROL = "$CONTROL/dynamic-security/v1"
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
ALREADY = ("already exists", "already has", "already in")  # a command run again


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))

    def conn(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--url", default="mqtt://127.0.0.1:1883",
                       help="the broker (mqtt:// or mqtts://; default mqtt://127.0.0.1:1883)")
        p.add_argument("--admin", default="admin",
                       help="the plugin's admin (mosquitto_ctrl dynsec init; default admin)")
        p.add_argument("--admin-password-file", required=True, metavar="FILE",
                       help="the admin's password, one line (readable by you only)")
        p.add_argument("--cafile", metavar="FILE", help="the CA of the broker's certificate (mqtts://)")
        p.add_argument("--fleet", default="default",
                       help="the fleet whose topics the roles grant ([agent] fleet; default default)")
        return p

    conn(sub.add_parser("fleet", help="the fleet's leaders role and the default-deny access"))
    leader = conn(sub.add_parser("leader", help="a leader's client, in the leaders' role"))
    leader.add_argument("name", metavar="NAME", help="the leader's device_id (its client's username)")
    leader.add_argument("--password-file", required=True, metavar="FILE",
                        help="the leader's broker password, one line: the file its [mqtt] password_file names")
    device = conn(sub.add_parser("device", help="a device's client, with a role of its own topics"))
    device.add_argument("name", metavar="ID", help="the device's device_id (its client's username)")
    device.add_argument("--password-file", required=True, metavar="FILE",
                        help="the device's broker password, one line: the file its [mqtt] password_file names")
    device.add_argument("--leader", action="append", required=True, metavar="NAME",
                        help="a leader it answers and watches (repeat for each)")


def _name(value: str, what: str) -> str:
    if not NAME.match(value):
        raise ConfigError(what, None, f"{value!r}: 1-128 of letters, digits, '_', '.', ':' or '-'")
    return value


def _secret(path: str, option: str) -> str:
    from agent.service.files import check_private_file

    try:
        check_private_file(path, what="password file")
        text = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except ConfigError as exc:
        raise ConfigError(option, None, f"{path}: {exc.reason}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(option, None, f"{path}: cannot read: {exc}") from None
    if not text:
        raise ConfigError(option, None, f"{path}: empty")
    return text


def _acl(acltype: str, topic: str) -> dict[str, Any]:
    return {"acltype": acltype, "topic": topic, "allow": True}


def fleet_commands(fleet: str) -> list[dict[str, Any]]:
    """The leaders' role of `fleet` and the plugin's default access (nothing unless a role allows it)."""
    up, role = f"ea/v1/{fleet}/+/up", f"ea-leaders-{fleet}"
    acls = [_acl("subscribePattern", f"$share/leaders/{up}"), _acl("subscribePattern", up),
            _acl("subscribePattern", f"ea/v1/{fleet}/+/presence"),
            _acl("publishClientSend", f"ea/v1/{fleet}/+/down"), _acl("publishClientSend", f"ea/v1/{fleet}/+/reply/#"),
            _acl("publishClientSend", f"ea/v1/{fleet}/+/session/down"),
            _acl("subscribePattern", f"ea/enrol/v1/{fleet}/+/+/request"),
            _acl("subscribePattern", f"$share/leaders/ea/enrol/v1/{fleet}/+/+/request"),
            _acl("publishClientSend", f"ea/enrol/v1/{fleet}/+/+/answer")]
    return [{"command": "setDefaultACLAccess", "acls": [
                {"acltype": "publishClientSend", "allow": False}, {"acltype": "publishClientReceive", "allow": True},
                {"acltype": "subscribe", "allow": False}, {"acltype": "unsubscribe", "allow": True}]},
            {"command": "createRole", "rolename": role, "textdescription": f"edge-agent leaders of fleet {fleet}"},
            *({"command": "addRoleACL", "rolename": role, **acl} for acl in acls)]


def leader_commands(fleet: str, name: str, password: str) -> list[dict[str, Any]]:
    role = f"ea-leader-{fleet}-{name}"
    own = [_acl("publishClientSend", f"ea/v1/{fleet}/{name}/presence"),
           _acl("subscribePattern", f"ea/v1/{fleet}/{name}/reply/#"),
           _acl("subscribePattern", f"ea/v1/{fleet}/+/session/up/{name}")]  # the sessions it holds
    return [{"command": "createRole", "rolename": role},
            *({"command": "addRoleACL", "rolename": role, **acl} for acl in own),
            {"command": "createClient", "username": name, "password": password,
             "clientid": f"ea-{fleet}-leader-{name}", "roles": [{"rolename": f"ea-leaders-{fleet}"},
                                                                 {"rolename": role}]}]


def device_commands(fleet: str, device: str, password: str, leaders: list[str]) -> list[dict[str, Any]]:
    role = f"ea-device-{fleet}-{device}"
    own = [_acl("publishClientSend", f"ea/v1/{fleet}/{device}/up"),
           _acl("publishClientSend", f"ea/v1/{fleet}/{device}/presence"),
           _acl("subscribePattern", f"ea/v1/{fleet}/{device}/down"),
           _acl("subscribePattern", f"ea/v1/{fleet}/{device}/reply/#"),
           _acl("subscribePattern", f"ea/v1/{fleet}/{device}/session/down"),  # remote sessions (docs/remote.md)
           _acl("publishClientSend", f"ea/v1/{fleet}/{device}/session/up/+")]
    for leader in leaders:  # it answers each leader on its own sub-topic, and watches whether it is up
        own += [_acl("publishClientSend", f"ea/v1/{fleet}/{leader}/reply/+/{device}"),
                _acl("subscribePattern", f"ea/v1/{fleet}/{leader}/presence")]
    return [{"command": "createRole", "rolename": role},
            *({"command": "addRoleACL", "rolename": role, **acl} for acl in own),
            {"command": "createClient", "username": device, "password": password,
             "clientid": f"ea-{fleet}-worker-{device}", "roles": [{"rolename": role}]}]


class Plugin:
    """A connection to the plugin's control topic: `run` sends commands, returns their answers."""

    def __init__(self, url: str, admin: str, password: str, cafile: str | None, timeout_s: float = 10.0) -> None:
        import paho.mqtt.client as mqtt

        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            raise ConfigError("--url", None, f"expected mqtt://host[:port] or mqtts://host[:port], got {url!r}")
        self._answers: dict[str, Any] = {}
        self._ready = threading.Condition()
        self._timeout_s = timeout_s
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"ea-broker-{uuid.uuid4().hex[:12]}",
                             protocol=mqtt.MQTTv5)
        client.username_pw_set(admin, password)
        if parts.scheme == "mqtts":
            client.tls_set(ca_certs=cafile)
        client.on_message = self._on_message
        self.client = client
        try:
            code = client.connect(parts.hostname, parts.port or (8883 if parts.scheme == "mqtts" else 1883))
        except OSError as exc:
            raise ConfigError("--url", None, f"cannot reach {url}: {exc.strerror or exc}") from None
        if code:
            raise ConfigError("--url", None, f"cannot connect to {url} (code {code})")
        client.loop_start()
        deadline = time.monotonic() + timeout_s
        while not client.is_connected() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not client.is_connected():
            client.loop_stop()
            raise ConfigError("--admin-password-file", None, f"{url} refused {admin!r} (or did not answer):"
                                                             " check the admin's name and password")
        subscribed = threading.Event()
        client.on_subscribe = lambda *_args: subscribed.set()
        client.subscribe(f"{CONTROL}/response", qos=1)
        if not subscribed.wait(timeout_s):
            raise EdgeAgentError(f"{url} did not take the subscription to {CONTROL}/response")

    def _on_message(self, _client: object, _userdata: object, message: Any) -> None:
        try:
            answer = json.loads(message.payload)
        except ValueError:
            return
        with self._ready:
            for item in answer.get("responses", []):
                self._answers[str(item.get("correlationData", ""))] = item
            self._ready.notify_all()

    def run(self, commands: list[dict[str, Any]]) -> list[str]:
        """Send `commands` one after another; what each did ("" done, or the plugin's error).
        `EdgeAgentError` when the plugin does not answer (is it loaded?)."""
        said = []
        for command in commands:
            tag = uuid.uuid4().hex
            self.client.publish(CONTROL, json.dumps({"commands": [{**command, "correlationData": tag}]}), qos=1)
            with self._ready:
                if not self._ready.wait_for(lambda tag=tag: tag in self._answers, self._timeout_s):  # type: ignore[misc]
                    raise EdgeAgentError(f"no answer on {CONTROL}/response within {self._timeout_s:g}s: is the"
                                         " dynamic-security plugin loaded, and is this user its admin?")
                said.append(str(self._answers.pop(tag).get("error", "")))
        return said

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def main(args: argparse.Namespace) -> int:
    try:
        fleet = _name(args.fleet, "--fleet")
        if args.action == "fleet":
            commands = fleet_commands(fleet)
        elif args.action == "leader":
            commands = leader_commands(fleet, _name(args.name, "NAME"), _secret(args.password_file, "--password-file"))
        else:
            leaders = [_name(leader, "--leader") for leader in args.leader]
            commands = device_commands(fleet, _name(args.name, "ID"), _secret(args.password_file, "--password-file"),
                                       leaders)
        plugin = Plugin(args.url, args.admin, _secret(args.admin_password_file, "--admin-password-file"), args.cafile)
        try:
            said = plugin.run(commands)
        finally:
            plugin.close()
    except EdgeAgentError as exc:
        print(f"edge-agent broker: {exc}", file=sys.stderr)
        return 2
    failed = [(c["command"], e) for c, e in zip(commands, said, strict=True) if e and not any(a in e for a in ALREADY)]
    for command, error in failed:
        print(f"edge-agent broker: {command}: {error}", file=sys.stderr)
    if failed:
        return 1
    kept = sum(1 for e in said if e)
    what = {"fleet": f"fleet {fleet}: the leaders' role ea-leaders-{fleet}, nothing allowed by default",
            "leader": f"leader {getattr(args, 'name', '')} in ea-leaders-{fleet}",
            "device": f"device {getattr(args, 'name', '')} with the role of its own topics"}[args.action]
    print(f"{what} ({len(commands) - kept} changes, {kept} already there)")
    return 0


__all__ = ["add_arguments", "device_commands", "fleet_commands", "leader_commands", "main"]
