"""The agent's connection to its broker, as the config (or `--broker`) names it.

    transport = make_transport(config, clock=clock, broker_url="mqtt://127.0.0.1:1883")

The transport carries the agent's presence: a retained `online` birth message when it connects
and a retained `offline` last will the broker publishes if the agent dies without a goodbye,
both naming this start's session (`agent.transport.presence`).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from agent.core.clock import Clock
from agent.core.config import AgentConfig
from agent.core.errors import ConfigError
from agent.transport import topics
from agent.transport.base import Transport, Will
from agent.transport.presence import encode_presence

if TYPE_CHECKING:
    from agent.transport.memory import MemoryBroker  # (loaded only for memory://)


def presence_wills(config: AgentConfig, *, session: str, since_ms: int) -> tuple[Will, Will]:
    """(last will, birth) of this start of the agent: retained `offline` / `online` of one
    session on its presence topic (`agent.transport.presence`)."""
    topic = topics.presence(config.agent.fleet, config.agent.device_id)
    will = Will(topic, encode_presence(False, session, since_ms), qos=1, retain=True,
                delay_s=config.mqtt.will_delay_s)
    return will, Will(topic, encode_presence(True, session, since_ms), qos=1, retain=True)


def client_id_of(config: AgentConfig) -> str:
    return f"{topics.CLIENT_ID_PREFIX}{config.agent.fleet}-{config.agent.role}-{config.agent.device_id}"


def make_transport(
    config: AgentConfig,
    *,
    clock: Clock,
    broker_url: str | None = None,
    memory_broker: MemoryBroker | None = None,
    rng: random.Random | None = None,
) -> Transport:
    """The transport the config (or `broker_url`) names: `mqtt://`, `mqtts://` or, with a
    `memory_broker`, `memory://`."""
    url = broker_url or config.mqtt.url
    session = f"{(rng or random.SystemRandom()).getrandbits(64):016x}"
    will, birth = presence_wills(config, session=session, since_ms=clock.now_ms())
    if url.startswith("memory://") or memory_broker is not None:
        if memory_broker is None:
            raise ConfigError("--broker", "mqtt.url", "memory:// works only inside one process (simulate)")
        from agent.transport.linkbytes import AirModel
        from agent.transport.memory import MemoryTransport

        # a worker's connection costs what the model says it would over TLS (`simulate` reports it)
        air = AirModel(config.mqtt.keepalive_s) if config.agent.role == "worker" else None
        return MemoryTransport(memory_broker, client_id_of(config), will=will, birth=birth,
                               max_payload_bytes=config.mqtt.max_payload_bytes, rng=rng, air=air)
    if not url.startswith(("mqtt://", "mqtts://")):
        raise ConfigError("--broker", "mqtt.url", f"must start with mqtt:// or mqtts://, got {url!r}")
    from agent.transport.mqtt import MqttTransport, credentials

    if config.agent.role != "leader":
        return MqttTransport.from_config(config.mqtt, client_id=client_id_of(config), will=will, birth=birth,
                                         clock=clock, rng=rng, url=url)
    # A leader keeps no broker session: in a shared subscription a dead member's persistent
    # session would go on taking its share of the fleet's messages until it expired. Senders
    # retry whatever got no answer, so nothing is lost: a live leader gets it instead.
    m = config.mqtt
    return MqttTransport.from_url(
        url, client_id=client_id_of(config), clock=clock, keepalive_s=m.keepalive_s,
        **credentials(url, username=m.username, password_file=m.password_file, tls_ca=m.tls_ca, tls_cert=m.tls_cert,
                      tls_key=m.tls_key),
        will=will, birth=birth, reconnect_min_s=m.reconnect_min_s, reconnect_max_s=m.reconnect_max_s,
        max_payload_bytes=m.max_payload_bytes, rng=rng, clean_start=True, session_expiry_s=0, fast_path=m.fast_path,
    )


__all__ = ["client_id_of", "make_transport", "presence_wills"]
