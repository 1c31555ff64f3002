"""Layer 4: the transport protocol, its MQTT and in-memory implementations, remote messaging.

`MqttTransport` lives in `agent.transport.mqtt` and is imported from there, so that code that
only needs the in-memory broker (the simulator, the fast tests) does not load aiomqtt.
"""

from agent.transport.base import Handler, InboundMessage, PayloadTooLarge, Transport, Will
from agent.transport.endpoint import EnvelopeInbox, EnvelopeSender, envelope_from_row
from agent.transport.memory import BrokerStats, MemoryBroker, MemoryTransport

__all__ = [
    "BrokerStats",
    "EnvelopeInbox",
    "EnvelopeSender",
    "Handler",
    "InboundMessage",
    "MemoryBroker",
    "MemoryTransport",
    "PayloadTooLarge",
    "Transport",
    "Will",
    "envelope_from_row",
]
