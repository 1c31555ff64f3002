"""Presence payloads: a device's retained birth and last will, numbered by session.

    online 9f2c41d07a3b5e18 1764600000000     the birth, published at each connect
    offline 9f2c41d07a3b5e18 1764600000000    the last will (or the goodbye of a clean stop)

The session id is drawn at each start of the agent and the time is when that start began. As
with Sparkplug B's bdSeq, the birth and the will of one session carry the same id, so the
leader can tell the death of the device's current session from a late will of an earlier one
(a broker that publishes an old connection's will after the device came back, a second agent
process with the same identity, a will redelivered out of order by a clustered broker). Within
one start, the Will Delay Interval and the persistent session keep the broker from publishing
the will of a connection the agent has since replaced (MQTT v5, 3.1.3.2.2).

A bare `online` / `offline` (an agent from before sessions) has the session "" and is always
applied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.core.codec import INT64_MAX
from agent.transport.topics import OFFLINE, ONLINE

MAX_PRESENCE_BYTES = 96
_SESSION = re.compile(r"[0-9a-f]{1,32}")


class PresenceFormatError(ValueError):
    """A presence payload that is not `online|offline [session since_ms]`; the reason says why."""


@dataclass(frozen=True, slots=True)
class PresenceState:
    online: bool
    session: str = ""  # "" for a bare online/offline
    since_ms: int = 0


def encode_presence(online: bool, session: str, since_ms: int) -> bytes:
    state = ONLINE if online else OFFLINE
    return b"%s %s %d" % (state, session.encode("ascii"), since_ms)


def decode_presence(payload: bytes) -> PresenceState:
    """The state a presence payload announces, or `PresenceFormatError` naming what is wrong."""
    if len(payload) > MAX_PRESENCE_BYTES:
        raise PresenceFormatError(f"presence longer than {MAX_PRESENCE_BYTES} bytes")
    parts = payload.split(b" ")
    if parts[0] not in (ONLINE, OFFLINE):
        raise PresenceFormatError("presence must start with online or offline")
    online = parts[0] == ONLINE
    if len(parts) == 1:
        return PresenceState(online)
    if len(parts) != 3:
        raise PresenceFormatError("presence must be 'online|offline SESSION SINCE_MS'")
    session = parts[1].decode("ascii", "replace")
    if not _SESSION.fullmatch(session):
        raise PresenceFormatError("presence session must be 1 to 32 lowercase hex digits")
    since = parts[2]
    if not since.isdigit() or len(since) > 19 or int(since) > INT64_MAX:
        raise PresenceFormatError("presence since_ms must be a non-negative 64-bit integer")
    return PresenceState(online, session, int(since))


__all__ = ["MAX_PRESENCE_BYTES", "PresenceFormatError", "PresenceState", "decode_presence", "encode_presence"]
