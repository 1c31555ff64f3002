"""The leader's own presence, as a worker on a trial boot needs it.

The leader is an agent like any other: its transport keeps a retained `online ...` on its
presence topic while it runs and the broker publishes its last will `offline ...` when it goes
away. A trial boot that cannot reach the leader asks this watch whether the leader *announced*
itself down during the check (or came back only since it began): then the new image is not at
fault and the updater waits (`leader_wait_s`) instead of reverting it. Without an announcement
(a leader never heard of, or one that says it is online and does not answer) nothing changes:
the trial fails as before.

The leader's id comes with each command it sends (the envelope's sender) and is kept in the
firmware state directory (`leader`), so the process that starts on the new slot knows whom to
watch before the leader says anything. The shipped ACL lets a device read the leader's presence.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from agent.core.clock import Clock
from agent.service.files import FileWriteError, write_private_file
from agent.transport import topics
from agent.transport.base import InboundMessage, Transport
from agent.transport.presence import PresenceFormatError, decode_presence

log = logging.getLogger(__name__)

LEADER_FILE = "leader"
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class LeaderWatch:
    """Whether the leader announced itself offline (`down_since`), from its retained presence."""

    def __init__(self, state_dir: Path, *, fleet: str, clock: Clock) -> None:
        self._path = state_dir / LEADER_FILE
        self._fleet = fleet
        self._clock = clock
        self.leader = self._read()
        self._transport: Transport | None = None
        self._watched: str | None = None
        self._down = False
        self._back_at: float | None = None  # the clock's monotonic time it announced itself online again

    def _read(self) -> str | None:
        try:
            text = self._path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return text if _ID.match(text) else None

    def down_since(self, since: float) -> bool:
        """The leader is announced offline, or came back online after `since` (the clock's
        monotonic time): either way a health check that began then could not hear from it."""
        return self._down or (self._back_at is not None and self._back_at >= since)

    async def start(self, transport: Transport) -> None:
        self._transport = transport
        if self.leader is not None:
            await self._watch(self.leader)

    async def learn(self, leader: str | None) -> None:
        """The sender of a command just taken: kept (written only when it changed) and watched."""
        if leader is None or leader == self.leader or not _ID.match(leader):
            return
        try:  # synced: the trial boot after the next reboot reads it
            self._path.parent.mkdir(parents=True, exist_ok=True)
            write_private_file(self._path, leader + "\n")
        except (OSError, FileWriteError) as exc:
            log.warning("cannot keep the leader's id: %s", exc)
        self.leader = leader
        if self._transport is not None:
            await self._watch(leader)

    async def _watch(self, leader: str) -> None:
        assert self._transport is not None
        if self._watched is not None:
            await self._transport.unsubscribe(topics.presence(self._fleet, self._watched))
        self._watched, self._down = leader, False
        await self._transport.subscribe(topics.presence(self._fleet, leader), self._on_presence)

    def _on_presence(self, message: InboundMessage) -> None:
        try:
            state = decode_presence(message.payload)
        except PresenceFormatError as exc:
            log.warning("the leader's presence on %s is not one: %s", message.topic, exc)
            return
        if self._down == state.online:  # it changed
            log.info("the leader %s announced itself %s", self._watched, "online" if state.online else "offline")
            if state.online:
                self._back_at = self._clock.monotonic()
        self._down = not state.online


__all__ = ["LEADER_FILE", "LeaderWatch"]
