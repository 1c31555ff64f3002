"""Topic names of edge-agent and MQTT topic-filter matching.

    ea/v1/{fleet}/{device}/up              device -> leader
    ea/v1/{fleet}/{device}/down            leader -> device
    ea/v1/{fleet}/{device}/presence        retained "online|offline SESSION SINCE_MS" (birth, will)
    ea/v1/{fleet}/{device}/reply/{name}    replies (MQTT v5 response topic)
    ea/v1/{fleet}/{device}/session/down    a remote session's frames, leader -> device (`agent.remote`)
    ea/v1/{fleet}/{device}/session/up/{leader}   ... device -> the leader that holds the session
    $share/leaders/ea/v1/{fleet}/+/up      several leaders' shared subscription
    ea/enrol/v1/{fleet}/{claim}/{client}/request|answer
                                           enrolment with the claim credential `claim` over the
                                           connection whose client id is `client`, which is
                                           `ea-enrol-{fleet}-{device}` (the broker's ACL:
                                           `pattern write .../%u/%c/request`: a connection asks
                                           and hears only under its own client id)

Every client id an agent sends begins with `ea-` (`CLIENT_ID_PREFIX`): the broker of a fleet with
device identities takes no other (`clientid_prefixes`), and a certificate for a name beginning
so is never issued, so an enrolling connection can never take a device's or a leader's client id.

Matching follows MQTT: `+` matches one level, `#` the rest (including the parent level), a
`$share/{group}/` prefix is stripped before matching, and topics starting with `$` are never
matched by a filter whose first level is a wildcard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.core.errors import TransportError

PREFIX = "ea/v1"
SHARE_PREFIX = "$share/"
DEFAULT_LEADER_GROUP = "leaders"

Channel = Literal["up", "down", "presence", "reply"]
CHANNELS: tuple[str, ...] = ("up", "down", "presence", "reply")

ONLINE = b"online"
OFFLINE = b"offline"


class TopicError(TransportError, ValueError):
    """A topic or topic filter is malformed."""


def _segment(kind: str, value: str) -> str:
    if not value or any(ch in value for ch in "/+#\x00") or value.startswith("$"):
        raise TopicError(f"invalid {kind} {value!r} for a topic level")
    return value


def up(fleet: str, device: str) -> str:
    return f"{PREFIX}/{_segment('fleet', fleet)}/{_segment('device', device)}/up"


def down(fleet: str, device: str) -> str:
    return f"{PREFIX}/{_segment('fleet', fleet)}/{_segment('device', device)}/down"


def presence(fleet: str, device: str) -> str:
    return f"{PREFIX}/{_segment('fleet', fleet)}/{_segment('device', device)}/presence"


def reply(fleet: str, device: str, name: str = "relay") -> str:
    """The reply topic of one sender (`name`) on `device`."""
    return f"{PREFIX}/{_segment('fleet', fleet)}/{_segment('device', device)}/reply/{_segment('reply name', name)}"


def reply_from(reply_topic: str, receiver: str) -> str:
    """The sub-topic of `reply_topic` on which `receiver` answers (the leader's per-device
    replies: the ACL lets each device write only its own)."""
    return f"{reply_topic}/{_segment('receiver', receiver)}"


def is_own_reply_topic(response_topic: str, up_topic: str) -> bool:
    """Whether `response_topic` is a reply topic of the device (and fleet) whose `up` topic is
    `up_topic`: `ea/v1/{fleet}/{device}/reply/...`. String work only (on the intake's path)."""
    if not up_topic.endswith("/up"):
        return False
    prefix = up_topic[:-2] + "reply/"
    return len(response_topic) > len(prefix) and response_topic.startswith(prefix)


def session_down(fleet: str, device: str) -> str:
    """The remote sessions' frames to `device` (the leader writes, the device reads)."""
    return f"{PREFIX}/{_segment('fleet', fleet)}/{_segment('device', device)}/session/down"


def session_up(fleet: str, device: str, leader: str) -> str:
    """`device`'s remote session frames to the leader `leader` that holds the session."""
    return (f"{PREFIX}/{_segment('fleet', fleet)}/{_segment('device', device)}/session/up/"
            f"{_segment('leader', leader)}")


def sessions_up_filter(fleet: str, leader: str) -> str:
    """Every device's remote session frames to the leader `leader` (its subscription)."""
    return f"{PREFIX}/{_segment('fleet', fleet)}/+/session/up/{_segment('leader', leader)}"


def session_device(topic: str) -> str | None:
    """The device of a `session/up/...` topic (the ACL lets a device write only its own)."""
    levels = topic.split("/")
    if len(levels) != 7 or levels[0] + "/" + levels[1] != PREFIX or levels[4:6] != ["session", "up"]:
        return None
    return levels[3] or None


ENROL_PREFIX = "ea/enrol/v1"
CLIENT_ID_PREFIX = "ea-"


def enrol_client_id(fleet: str, device: str) -> str:
    """The client id a device enrols with: the connection level of its enrolment topics."""
    return f"{CLIENT_ID_PREFIX}enrol-{fleet}-{device}"


def enrol_request(fleet: str, claim: str, client: str) -> str:
    return f"{ENROL_PREFIX}/{_segment('fleet', fleet)}/{_segment('claim', claim)}/{_segment('client', client)}/request"


def enrol_answer(fleet: str, claim: str, client: str) -> str:
    return f"{ENROL_PREFIX}/{_segment('fleet', fleet)}/{_segment('claim', claim)}/{_segment('client', client)}/answer"


def enrol_requests_filter(fleet: str) -> str:
    """Every claim credential's enrolment requests in the fleet (the leader's subscription)."""
    return f"{ENROL_PREFIX}/{_segment('fleet', fleet)}/+/+/request"


def leader_enrol_filter(fleet: str, shared_group: str) -> str:
    """What a leader subscribes to for enrolment requests: all of them, or with other leaders its
    group's share (one leader answers each request, as with the uplinks)."""
    plain = enrol_requests_filter(fleet)
    return f"{SHARE_PREFIX}{_segment('group', shared_group)}/{plain}" if shared_group else plain


def parse_enrol_request(topic: str) -> tuple[str, str] | None:
    """(claim, client id) of an enrolment request topic, None when it is not one."""
    levels = topic.split("/")
    if len(levels) != 7 or "/".join(levels[:3]) != ENROL_PREFIX or levels[6] != "request":
        return None
    claim, client = levels[4], levels[5]
    if not claim or not client or any(ch in claim + client for ch in "+#"):
        return None
    return claim, client


def fleet_filter(fleet: str, channel: Channel) -> str:
    """Every device's `channel` in the fleet, e.g. `ea/v1/f/+/presence`."""
    return f"{PREFIX}/{_segment('fleet', fleet)}/+/{channel}"


def leaders_up(fleet: str, group: str = DEFAULT_LEADER_GROUP) -> str:
    """The shared subscription several leaders split the fleet's `up` traffic with."""
    return f"{SHARE_PREFIX}{_segment('group', group)}/{fleet_filter(fleet, 'up')}"


def leader_up_filter(fleet: str, shared_group: str) -> str:
    """What a leader subscribes to: every device's uplink, or its group's shared subscription.

    A lone leader never uses a shared subscription: on a broker whose ACLs do not check
    subscriptions (mosquitto 2.0's `acl_file`), any device could join the group and be handed a
    share of the uplinks, which the broker then drops for lack of read access."""
    return leaders_up(fleet, shared_group) if shared_group else fleet_filter(fleet, "up")


@dataclass(frozen=True, slots=True)
class ParsedTopic:
    fleet: str
    device: str
    channel: str
    rest: str = ""  # levels after the channel, e.g. the reply name


def parse(topic: str) -> ParsedTopic | None:
    """Split an edge-agent topic into its parts; None when it is not one of ours."""
    levels = topic.split("/")
    if len(levels) < 5 or levels[0] != "ea" or levels[1] != "v1":
        return None
    fleet, device, channel = levels[2], levels[3], levels[4]
    if not fleet or not device or channel not in CHANNELS:
        return None
    if any(ch in fleet + device for ch in "+#"):
        return None
    return ParsedTopic(fleet, device, channel, "/".join(levels[5:]))


def device_of(topic: str) -> str | None:
    """The device id a topic belongs to, or None when the topic names no device."""
    parsed = parse(topic)
    return parsed.device if parsed is not None else None


def split_shared(topic_filter: str) -> tuple[str | None, str]:
    """`$share/g/a/b` -> ("g", "a/b"); a plain filter -> (None, filter)."""
    if not topic_filter.startswith(SHARE_PREFIX):
        return None, topic_filter
    rest = topic_filter[len(SHARE_PREFIX) :]
    group, sep, inner = rest.partition("/")
    if not sep or not group or not inner or "+" in group or "#" in group:
        raise TopicError(f"invalid shared subscription {topic_filter!r}")
    return group, inner


def validate_topic(topic: str) -> str:
    """A topic to publish to: non-empty, no wildcards, no NUL."""
    if not topic or "+" in topic or "#" in topic or "\x00" in topic:
        raise TopicError(f"invalid topic name {topic!r}")
    if len(topic.encode("utf-8")) > 65535:
        raise TopicError("topic name longer than 65535 bytes")
    return topic


def validate_filter(topic_filter: str) -> str:
    """A subscription filter: `#` only as the whole last level, `+` only as a whole level."""
    _, inner = split_shared(topic_filter)
    if not inner or "\x00" in inner:
        raise TopicError(f"invalid topic filter {topic_filter!r}")
    levels = inner.split("/")
    for index, level in enumerate(levels):
        if "#" in level and (level != "#" or index != len(levels) - 1):
            raise TopicError(f"'#' must be the last whole level in {topic_filter!r}")
        if "+" in level and level != "+":
            raise TopicError(f"'+' must be a whole level in {topic_filter!r}")
    return topic_filter


def is_wildcard(topic_filter: str) -> bool:
    return "+" in topic_filter or "#" in topic_filter


def matches(topic_filter: str, topic: str) -> bool:
    """Does `topic` match `topic_filter` (which may carry a `$share/group/` prefix)?"""
    if topic_filter.startswith(SHARE_PREFIX):
        _, topic_filter = split_shared(topic_filter)
    if topic_filter == topic:
        return True
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    if topic.startswith("$") and f_levels[0] in ("+", "#"):
        return False
    for index, f_level in enumerate(f_levels):
        if f_level == "#":
            return True
        if index >= len(t_levels):
            return False
        if f_level != "+" and f_level != t_levels[index]:
            return False
    return len(f_levels) == len(t_levels)


__all__ = [
    "CHANNELS",
    "DEFAULT_LEADER_GROUP",
    "OFFLINE",
    "ONLINE",
    "PREFIX",
    "ParsedTopic",
    "TopicError",
    "device_of",
    "down",
    "CLIENT_ID_PREFIX",
    "enrol_answer",
    "enrol_client_id",
    "enrol_request",
    "enrol_requests_filter",
    "fleet_filter",
    "is_own_reply_topic",
    "is_wildcard",
    "leader_enrol_filter",
    "leader_up_filter",
    "leaders_up",
    "matches",
    "parse",
    "parse_enrol_request",
    "presence",
    "reply",
    "reply_from",
    "session_device",
    "session_down",
    "session_up",
    "sessions_up_filter",
    "split_shared",
    "up",
    "validate_filter",
    "validate_topic",
]
