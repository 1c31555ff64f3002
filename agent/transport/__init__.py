"""Layer 3: the transport protocol, its MQTT and in-memory implementations, remote messaging.

`MqttTransport` lives in `agent.transport.mqtt` and is imported from there, so that code that
only needs the in-memory broker (the simulator, the fast tests) does not load aiomqtt. The
in-memory broker is loaded on first use of its names (`from agent.transport import
MemoryBroker` works as before), so an agent on a real broker never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.core.lazy import lazy_attributes
from agent.transport.base import Handler, InboundMessage, PayloadTooLarge, Transport, Will
from agent.transport.endpoint import EnvelopeInbox, EnvelopeSender, envelope_from_row

if TYPE_CHECKING:
    from agent.transport._mqtt_settings import TlsSettings
    from agent.transport.memory import BrokerStats, MemoryBroker, MemoryTransport

_LAZY = {
    "BrokerStats": "agent.transport.memory",
    "MemoryBroker": "agent.transport.memory",
    "MemoryTransport": "agent.transport.memory",
    "TlsSettings": "agent.transport._mqtt_settings",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "BrokerStats",
    "EnvelopeInbox",
    "EnvelopeSender",
    "Handler",
    "InboundMessage",
    "MemoryBroker",
    "MemoryTransport",
    "PayloadTooLarge",
    "TlsSettings",
    "Transport",
    "Will",
    "envelope_from_row",
]
