"""The transport boundary: what the relay, the endpoints and the agents see of a message bus.

Two implementations share this protocol: `MqttTransport` (aiomqtt, MQTT v5) and the in-process
`MemoryTransport` the simulator and the fast tests inject. Nothing outside `agent/transport`
depends on either one; neither leaks a third-party type through it.

Semantics both implementations keep:

* `publish` with QoS 1 returns once the broker has the message and raises `NotConnected` while
  offline, `ConnectionLost` when the connection breaks under it, and `PayloadTooLarge` for a
  payload above `max_payload_bytes`.
* `publish_nowait` sends one QoS 0 message (a reply nobody acknowledges) without awaiting: it is
  handed to the connection at once, or raises as `publish` does.
* `subscribe` records the filter and (re)establishes it on every connect; handlers for one client
  run one at a time, in arrival order. A handler may be a plain function: the transport awaits
  only what a handler returns, so a message handled without waiting costs no task step. Subscribe
  before `start` so that messages a persistent session queued while offline find their handler.
* `connected` is a `Gate`: open while connected, closed otherwise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agent.core.errors import TransportError
from agent.core.gate import Gate


class PayloadTooLarge(TransportError):
    """A payload is larger than the transport's `max_payload_bytes`; it will never fit."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"payload of {size} bytes exceeds max_payload_bytes={limit}")


@dataclass(frozen=True, slots=True)
class InboundMessage:
    """One message received on a subscription."""

    topic: str
    payload: bytes
    retain: bool = False
    response_topic: str | None = None
    correlation: bytes | None = None
    qos: int = 1


@dataclass(frozen=True, slots=True)
class Will:
    """A message the broker holds for a client: its last will, or (reused) its birth message."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True
    # MQTT v5 Will Delay Interval: the broker publishes a last will only if the client has not
    # come back within this many seconds, so a network blip does not mark a device offline.
    delay_s: int = 0


# A handler returns None when it is done with the message, or what is left to await (an
# `async def` handler returns its coroutine).
Handler = Callable[[InboundMessage], Awaitable[None] | None]


@runtime_checkable
class Transport(Protocol):
    """A client connection to a publish/subscribe broker."""

    @property
    def client_id(self) -> str: ...

    @property
    def connected(self) -> Gate:
        """Open while connected to the broker."""

    @property
    def max_payload_bytes(self) -> int: ...

    async def start(self) -> None:
        """Begin connecting (and reconnecting). Returns without waiting for the connection."""

    async def stop(self) -> None:
        """Disconnect cleanly. Idempotent.

        The transport publishes its will's message itself first (a goodbye: presence `offline`),
        then disconnects normally, so the broker's last will is left for abrupt ends only.
        """

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        expiry_s: int | None = None,
    ) -> None:
        """Publish one message. `expiry_s`: MQTT v5 Message Expiry Interval, after which the
        broker drops it undelivered (a command queued for an offline device goes stale)."""

    def publish_nowait(self, topic: str, payload: bytes, *, correlation: bytes | None = None) -> None:
        """Publish one QoS 0 message (not retained) without waiting: nothing acknowledges it, so
        it is handed to the connection now. Raises `NotConnected`, `ConnectionLost` or
        `PayloadTooLarge` as `publish` does."""

    async def subscribe(self, topic_filter: str, handler: Handler, *, qos: int = 1) -> None:
        """Deliver messages matching `topic_filter` to `handler`, now and after reconnects."""

    async def unsubscribe(self, topic_filter: str) -> None: ...


__all__ = ["Handler", "InboundMessage", "PayloadTooLarge", "Transport", "Will"]
