"""Forwarding application messages to a northbound broker (the cloud's), through an outbox.

    MessageSinks ──forward()──► OutboxStore (northbound.db, one class per app class)
                                   └── Relay ──► MQTT publish, QoS 1, to `[northbound] topic`
                                                 (PUBACK = delivered; offline = kept, retried)

`forward` returns once the messages are durably queued, so a gateway cut off from the cloud
keeps everything (up to `[northbound] max_messages` / `max_bytes`; beyond, the devices are told
busy and keep theirs) until the link is back. Delivery is at-least-once: in the `envelope`
format every message carries its id, so the consumer can drop a repeat.

    envelope (default): JSON {"id", "device", "class", "key", "seq", "ts_ms", "content_type",
                        "payload" (the JSON value, for JSON payloads) or "payload_base64"}
    raw:                the payload bytes as the device application gave them
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path

from agent.core.clock import Clock
from agent.core.config import AgentConfig, NorthboundSection, resolve
from agent.core.errors import CodecError, ConfigError, NotConnected, Permanent, Transient, TransportError
from agent.leader.agent import LeaderAgent
from agent.leader.env import GatewayEnv
from agent.leader.messages import payload_fields
from agent.outbox.policy import ClassPolicy
from agent.outbox.relay import Relay
from agent.outbox.settings import aimd_settings, retry_policy
from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxMessage, OutboxRow
from agent.protocol import AppMessage, app_kind, decode_as, encode_message
from agent.service.parts import Collectors, PartBase
from agent.transport.base import Transport

log = logging.getLogger(__name__)

RECEIVER = "northbound"


def topic_of(settings: NorthboundSection, *, fleet: str, message: AppMessage) -> str:
    template = settings.topics.get(message.cls, settings.topic)
    return template.format(fleet=fleet, device=message.device_id, **{"class": message.cls})


def northbound_payload(settings: NorthboundSection, msg_id: str, message: AppMessage) -> bytes:
    if settings.format == "raw":
        return message.payload
    doc: dict[str, object] = {"id": msg_id, "device": message.device_id, "class": message.cls, "key": message.key,
                              "seq": message.seq, "ts_ms": message.ts_ms, "content_type": message.content_type,
                              **payload_fields(message.content_type, message.payload)}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


class Northbound(PartBase):
    """A `Forwarder` for `MessageSinks` with its own outbox, relay and transport; a part of the
    leader (`agent.service.parts`) that stops after it, so what the leader took is queued first."""

    name = "northbound"

    def __init__(self, config: AgentConfig, *, outbox: OutboxStore, transport: Transport, clock: Clock,
                 rng: random.Random | None = None) -> None:
        self.settings = config.northbound
        self._fleet = config.agent.fleet
        self.outbox = outbox
        self.transport = transport
        self.relay = Relay(outbox, self._publish, clock=clock, ready=transport.connected, partitions=1,
                           retry=retry_policy(config), limits=aimd_settings(config), rng=rng,
                           reconnect_jitter_s=config.relay.reconnect_jitter_s, name="relay:northbound")
        self.published = 0

    @classmethod
    async def open(cls, config: AgentConfig, base: Path, *, transport: Transport, clock: Clock,
                   rng: random.Random | None = None) -> Northbound:
        nb = config.northbound
        policy = ClassPolicy(max_messages=nb.max_messages, max_bytes=nb.max_bytes, full_policy="reject")
        outbox = await OutboxStore.open(
            resolve(base, nb.outbox), clock=clock, durability=config.outbox.durability,
            max_attempts=1_000_000,  # the cloud may be away for days: never dead-letter for that
            classes={app_kind(name): policy for name in config.classes}, default_class=policy)
        return cls(config, outbox=outbox, transport=transport, clock=clock, rng=rng)

    async def forward(self, batch: Sequence[tuple[str, AppMessage]]) -> None:
        msgs = [OutboxMessage(msg_id=msg_id, owner=m.device_id, receiver=RECEIVER, kind=app_kind(m.cls),
                              payload=encode_message(m), key=msg_id) for msg_id, m in batch]
        if msgs:
            await self.outbox.enqueue_many(msgs)  # OutboxFull (a StoreError): the devices are told busy

    async def _publish(self, row: OutboxRow) -> None:
        try:
            message = decode_as(row.payload, AppMessage)
        except CodecError as exc:
            raise Permanent(f"queued message {row.msg_id} is unreadable: {exc}") from None
        assert isinstance(message, AppMessage)
        topic = topic_of(self.settings, fleet=self._fleet, message=message)
        try:
            await self.transport.publish(topic, northbound_payload(self.settings, row.msg_id, message), qos=1)
        except NotConnected as exc:
            raise Transient(str(exc)) from None
        except TransportError as exc:
            raise Transient(f"not published to {topic}: {exc}") from None
        self.published += 1

    async def start(self) -> None:
        await self.transport.start()
        await self.relay.start()
        log.info("forwarding application messages northbound", extra={"kv": {"url": self.settings.url or "(given)"}})

    async def stop(self) -> None:
        await self.relay.stop_within()
        await self.transport.stop()
        await self.outbox.close()

    def collectors(self) -> Collectors:
        from agent.service.collectors import snapshot_collector

        return {"northbound": snapshot_collector(
            "ea_northbound", self.stats, counters=("delivered", "published"),
            help_={"connected": "1 while connected to the northbound broker.",
                   "pending": "Application messages queued for the northbound broker.",
                   "delivered": "Application messages the northbound broker acknowledged (persisted).",
                   "published": "Publishes the northbound broker acknowledged since start."})}

    async def stats(self) -> dict[str, object]:
        s = await self.outbox.stats()
        return {"connected": self.transport.connected.is_open, "pending": s.pending, "delivered": s.delivered,
                "published": self.published}


def northbound_transport(config: AgentConfig, *, clock: Clock, rng: random.Random | None = None) -> Transport:
    """The MQTT connection to the northbound broker `[northbound]` names."""
    from agent.transport.mqtt import MqttTransport, credentials

    nb = config.northbound
    if not nb.url.startswith(("mqtt://", "mqtts://")):
        raise ConfigError("config", "northbound.url", f"must start with mqtt:// or mqtts://, got {nb.url!r}")
    client_id = nb.client_id or f"ea-{config.agent.fleet}-northbound-{config.agent.device_id}"
    return MqttTransport.from_url(
        nb.url, client_id=client_id, clock=clock,
        **credentials(nb.url, username=nb.username, password_file=nb.password_file, tls_ca=nb.tls_ca,
                      tls_cert=nb.tls_cert, tls_key=nb.tls_key, source="northbound"),
        keepalive_s=config.mqtt.keepalive_s, reconnect_min_s=config.mqtt.reconnect_min_s,
        reconnect_max_s=config.mqtt.reconnect_max_s, max_payload_bytes=config.mqtt.max_payload_bytes * 2, rng=rng)


async def northbound_part(leader: LeaderAgent, env: GatewayEnv) -> Northbound | None:
    """The leader's feature that forwards application messages northbound when `[northbound] url`
    is set (or the environment hands a transport); None when off. Its forwarder is in the sinks
    from here on, so nothing the leader takes escapes it; `start` connects."""
    config = leader.config
    if (not config.northbound.url and env.northbound_transport is None) or leader.sinks is None:
        return None
    link = env.northbound_transport or northbound_transport(config, clock=leader.clock)
    northbound = await Northbound.open(config, leader.data_dir, transport=link, clock=leader.clock)
    leader.sinks.add_forwarder(northbound)
    return northbound


__all__ = ["Northbound", "northbound_part", "northbound_payload", "northbound_transport", "topic_of"]
