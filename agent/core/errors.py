"""The one error tree of edge-agent.

    EdgeAgentError
    ├── ConfigError(path, key, reason)       a config file is malformed
    ├── CodecError                           bytes on the wire do not decode
    ├── MailboxFull(retry_after_ms)          an actor's bounded mailbox refused a message
    ├── ActorStopped                         the actor is not running
    ├── AskTimeout                           no reply to an ask within its timeout
    ├── TransportError
    │   ├── NotConnected                     we are offline (closed by us or not yet up)
    │   └── ConnectionLost                   the peer or network broke the connection
    ├── DeliveryError                        the outcome of one delivery attempt
    │   ├── Capacity(retry_after_ms)         receiver is full: AIMD halves, back off
    │   ├── Transient                        timeout or network: back off, limit unchanged
    │   └── Permanent                        malformed or refused: dead letter at once
    ├── StoreError                           the outbox database failed (disk full, I/O)
    │   ├── OutboxFull                       a message class is at its size cap (policy reject)
    │   ├── StoreClosed                      the store was closed by us
    │   ├── StoreUnavailable                 the database server cannot be reached (busy, retry)
    │   └── UnstorableValue                  one message holds a value SQLite cannot store
    │       └── DeviceLimitReached           one device reached a cap on its kept state
    ├── FileWriteError                       a private file or folder could not be written
    ├── RolloutError                         a rollout spec or control is invalid
    └── ArtifactError                        a firmware artifact is refused
        ├── BadSignature
        └── Downgrade

Third-party exceptions (sqlite3, aiomqtt, paho) never cross out of the module that uses them;
they are translated here with ``raise ... from exc``.
"""

from __future__ import annotations


class EdgeAgentError(Exception):
    """Base of every error edge-agent raises on purpose."""


class ConfigError(EdgeAgentError):
    """A config file is missing, unreadable or malformed. Names the file and the key."""

    def __init__(self, path: str, key: str | None, reason: str) -> None:
        self.path = path
        self.key = key
        self.reason = reason
        where = f"{path}: {key}: " if key else f"{path}: "
        super().__init__(where + reason)


class CodecError(EdgeAgentError):
    """Bytes that do not decode into the expected message. The text says what was wrong."""


class MailboxFull(EdgeAgentError):
    """The mailbox is at capacity under the `reject` policy."""

    def __init__(self, actor: str, retry_after_ms: int) -> None:
        self.actor = actor
        self.retry_after_ms = retry_after_ms
        super().__init__(f"mailbox of {actor!r} is full (retry_after_ms={retry_after_ms})")


class ActorStopped(EdgeAgentError):
    """The actor has stopped (or was never started) and takes no messages."""


class AskTimeout(EdgeAgentError):
    """No reply to an `ask` within its timeout."""


class TransportError(EdgeAgentError):
    """Base of transport failures."""


class NotConnected(TransportError):
    """The transport is not connected: not yet, or closed by us."""


class ConnectionLost(TransportError):
    """The broker or the network broke the connection."""


class DeliveryError(EdgeAgentError):
    """The typed outcome of a failed delivery attempt. Never matched by its text."""


class Capacity(DeliveryError):
    """The receiver is at capacity: AIMD halves its limit and the message backs off."""

    def __init__(self, reason: str, retry_after_ms: int) -> None:
        self.retry_after_ms = retry_after_ms
        super().__init__(f"{reason} (retry_after_ms={retry_after_ms})")


class Transient(DeliveryError):
    """Timeout or network trouble: back off, the AIMD limit is unchanged."""


class Permanent(DeliveryError):
    """The message can never be delivered (malformed, refused): dead letter at once."""


class StoreError(EdgeAgentError):
    """The outbox database failed: disk full, I/O error, unreadable file."""


class OutboxFull(StoreError):
    """A message class reached its size cap and its policy is `reject`."""


class StoreClosed(StoreError):
    """The store was closed by us."""


class StoreUnavailable(StoreError):
    """The database server (PostgreSQL) cannot be reached or dropped the connection: nothing of
    the failed call was committed; the next call connects again."""


class UnstorableValue(StoreError):
    """A value of one message cannot be stored (an integer beyond SQLite's 64 bits): that
    message is refused; the database itself is fine and every other message goes on."""


class DeviceLimitReached(UnstorableValue):
    """One device reached a cap on what the leader keeps for it (its telemetry names): the
    message that would go beyond is refused, and what is already kept stays."""


class FileWriteError(EdgeAgentError):
    """A private file or directory could not be created or written."""


class IdentityError(EdgeAgentError):
    """A device identity refused: a certificate request, a certificate, an enrolment, a trust document."""


class RolloutError(EdgeAgentError):
    """A rollout spec or a rollout control is invalid."""


class ArtifactError(EdgeAgentError):
    """A firmware artifact is refused; the text gives the reason."""


class BadSignature(ArtifactError):
    """The manifest signature does not verify against the pinned key."""


class Downgrade(ArtifactError):
    """The artifact's version is lower than the installed one."""


def store_log_level(exc: BaseException, level: int) -> int:
    """The level a loop logs its store's failure at: DEBUG when the database server is lost (that
    outage is one line of its own, said when it goes and when it is back), else `level`."""
    import logging

    return logging.DEBUG if isinstance(exc, StoreUnavailable) else level


__all__ = [
    "ActorStopped",
    "ArtifactError",
    "AskTimeout",
    "BadSignature",
    "Capacity",
    "CodecError",
    "ConfigError",
    "ConnectionLost",
    "DeliveryError",
    "DeviceLimitReached",
    "Downgrade",
    "EdgeAgentError",
    "FileWriteError",
    "IdentityError",
    "MailboxFull",
    "NotConnected",
    "OutboxFull",
    "Permanent",
    "RolloutError",
    "StoreClosed",
    "UnstorableValue",
    "StoreError",
    "StoreUnavailable",
    "Transient",
    "TransportError",
    "store_log_level",
]
