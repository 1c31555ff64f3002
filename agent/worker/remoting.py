"""The factory of the worker's remote sessions (`agent.worker.remote`): a device whose `[remote]`
turns nothing on, the default, never loads the sessions' code."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent.core.config import RemoteSection

if TYPE_CHECKING:
    from agent.worker.remote import RemoteSessions


def operations(settings: RemoteSection) -> tuple[str, ...]:
    """The operations a device's `[remote]` turns on."""
    return tuple(op for op, on in (("shell", settings.shell), ("forward", bool(settings.forward)),
                                   ("logs", settings.logs)) if on)


async def remote_part(agent: Any, env: Any) -> RemoteSessions | None:
    """The worker's remote sessions; None when `[remote]` turns none on (then nothing is subscribed
    and the leader, told by the device's facts, refuses for it)."""
    config = agent.config
    ops = operations(config.remote)
    if not ops:
        return None
    from agent.worker.failure_logs import secret_literals
    from agent.worker.remote import RemoteSessions

    facts = agent.device_facts

    def with_remote() -> dict[str, str] | None:  # (its full heartbeats say what it takes)
        return {**(facts() or {}), "remote": ",".join(ops)}

    agent.device_facts = with_remote
    return RemoteSessions(config.remote, transport=agent.transport, fleet=agent.fleet, device_id=agent.device_id,
                          data_dir=agent.data_dir, secrets=lambda: secret_literals(config))


__all__ = ["operations", "remote_part"]
