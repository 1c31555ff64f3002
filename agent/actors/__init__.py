"""Layer 1: actors with bounded mailboxes, ask/tell, supervision and graceful stop.

    from agent.actors import Actor, ActorSystem, Context

    class Echo(Actor):
        async def receive(self, message, ctx):
            return message

    async with ActorSystem() as system:
        ref = system.spawn(Echo(), name="echo", capacity=64, policy="reject")
        ref.tell("hi")
        assert await ref.ask("ping", timeout_s=1.0) == "ping"
"""

from agent.actors.actor import Actor, ActorFactory, ActorFailure, Context, RestartPolicy
from agent.actors.mailbox import (
    MAX_RETRY_AFTER_MS,
    MIN_RETRY_AFTER_MS,
    DiscardReason,
    Mailbox,
    MailboxPolicy,
    MailboxStatistics,
)
from agent.actors.ref import ActorRef
from agent.actors.runtime import run, uvloop_factory
from agent.actors.system import ActorSystem

__all__ = [
    "MAX_RETRY_AFTER_MS",
    "MIN_RETRY_AFTER_MS",
    "Actor",
    "ActorFactory",
    "ActorFailure",
    "ActorRef",
    "ActorSystem",
    "Context",
    "DiscardReason",
    "Mailbox",
    "MailboxPolicy",
    "MailboxStatistics",
    "RestartPolicy",
    "run",
    "uvloop_factory",
]
