"""Layer 4: the transport protocol, its MQTT and in-memory implementations, remote messaging."""

from agent.transport.base import Handler, InboundMessage, PayloadTooLarge, Transport, Will
from agent.transport.memory import BrokerStats, MemoryBroker, MemoryTransport

__all__ = [
    "BrokerStats",
    "Handler",
    "InboundMessage",
    "MemoryBroker",
    "MemoryTransport",
    "PayloadTooLarge",
    "Transport",
    "Will",
]
