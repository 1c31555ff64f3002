"""The outbox and relay settings an agent's config asks for, as the outbox's own value objects.

Both agents build their outbox and relay from the same `[outbox]` and `[relay]` sections; this
is the one translation from config to `ClassPolicy`, `RetryPolicy` and `AimdSettings`.
"""

from __future__ import annotations

from agent.core.config import AgentConfig
from agent.outbox.engine import ClassPolicy
from agent.outbox.limiter import AimdSettings
from agent.outbox.retry import RetryPolicy
from agent.protocol import app_kind


def outbox_classes(config: AgentConfig) -> dict[str, ClassPolicy]:
    """`[outbox.classes.NAME]` (the agent's own kinds) and `[classes.NAME]` (the applications'
    classes, kind "app.NAME") as the store's per-class policies."""
    policies = {
        name: ClassPolicy(
            max_messages=c.max_messages, max_bytes=c.max_bytes, full_policy=c.full_policy,
            ttl_ms=int(c.ttl_s * 1000), fifo=c.fifo,
        )
        for name, c in config.outbox.classes.items()
    }
    for name, a in config.classes.items():
        policies[app_kind(name)] = ClassPolicy(
            max_messages=a.max_messages, max_bytes=a.max_bytes, full_policy=a.full_policy,
            ttl_ms=int(a.ttl_s * 1000), fifo=a.fifo,
        )
    return policies


def retry_policy(config: AgentConfig) -> RetryPolicy:
    """`[outbox]` backoff settings as the relay's retry policy."""
    o = config.outbox
    return RetryPolicy(base_s=o.backoff_base_s, cap_s=o.backoff_cap_s, transient_floor_s=o.transient_floor_s)


def aimd_settings(config: AgentConfig) -> AimdSettings:
    """`[relay]` AIMD bounds as the relay's limiter settings."""
    r = config.relay
    return AimdSettings(initial=r.aimd_initial, min=r.aimd_min, max=r.aimd_max)


__all__ = ["aimd_settings", "outbox_classes", "retry_policy"]
