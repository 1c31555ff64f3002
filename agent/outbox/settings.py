"""The outbox and relay settings an agent's config asks for, as the outbox's own value objects,
and what each kind's acknowledgement promises (`durability`).

Both agents build their outbox and relay from the same `[outbox]` and `[relay]` sections; this
is the one translation from config to `ClassPolicy`, `RetryPolicy` and `AimdSettings`.
"""

from __future__ import annotations

from agent.core.config import AgentConfig
from agent.outbox.engine import ClassPolicy
from agent.outbox.limiter import AimdSettings
from agent.outbox.policy import Durability
from agent.outbox.retry import RetryPolicy
from agent.protocol import KIND_HEARTBEAT, app_kind

# The agent's own kinds whose acknowledgement needs no fsync unless the config says so: a device
# sends its heartbeat again every interval, and the outbox keeps only the newest one anyway.
CRASH_BY_DEFAULT = frozenset({KIND_HEARTBEAT})


def outbox_classes(config: AgentConfig) -> dict[str, ClassPolicy]:
    """`[outbox.classes.NAME]` (the agent's own kinds) and `[classes.NAME]` (the applications'
    classes, kind "app.NAME") as the store's per-class policies."""
    policies = {kind: ClassPolicy(durability="crash") for kind in CRASH_BY_DEFAULT}
    policies.update({
        name: ClassPolicy(
            max_messages=c.max_messages, max_bytes=c.max_bytes, full_policy=c.full_policy,
            ttl_ms=int(c.ttl_s * 1000), fifo=c.fifo,
            durability=c.durability or ("crash" if name in CRASH_BY_DEFAULT else None),
        )
        for name, c in config.outbox.classes.items()
    })
    for name, a in config.classes.items():
        policies[app_kind(name)] = ClassPolicy(
            max_messages=a.max_messages, max_bytes=a.max_bytes, full_policy=a.full_policy,
            ttl_ms=int(a.ttl_s * 1000), fifo=a.fifo, durability=a.durability,
        )
    return policies


def durability(config: AgentConfig, kind: str) -> Durability:
    """What an acknowledgement of `kind` promises under this config: its class's durability
    (`outbox_classes`), else `[outbox] durability`."""
    return _durability(config, outbox_classes(config), kind)


def crash_classes(config: AgentConfig) -> frozenset[str]:
    """The application classes (`[classes.NAME]`) of durability "crash"."""
    policies = outbox_classes(config)
    return frozenset(name for name in config.classes if _durability(config, policies, app_kind(name)) == "crash")


def _durability(config: AgentConfig, policies: dict[str, ClassPolicy], kind: str) -> Durability:
    policy = policies.get(kind)
    chosen = policy.durability if policy is not None else None
    return chosen if chosen is not None else config.outbox.durability


def retry_policy(config: AgentConfig) -> RetryPolicy:
    """`[outbox]` backoff settings as the relay's retry policy."""
    o = config.outbox
    return RetryPolicy(base_s=o.backoff_base_s, cap_s=o.backoff_cap_s, transient_floor_s=o.transient_floor_s)


def aimd_settings(config: AgentConfig) -> AimdSettings:
    """`[relay]` AIMD bounds as the relay's limiter settings."""
    r = config.relay
    return AimdSettings(initial=r.aimd_initial, min=r.aimd_min, max=r.aimd_max)


__all__ = ["CRASH_BY_DEFAULT", "aimd_settings", "crash_classes", "durability", "outbox_classes", "retry_policy"]
