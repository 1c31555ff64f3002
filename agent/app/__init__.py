"""Layer 7: one agent assembled from its parts (`assemble`), and its broker connection.

    config = await prepare(config, clock=clock, base=base, starting=Starting(stopping=stop))
    transport = make_transport(config, clock=clock, broker_url="mqtt://127.0.0.1:1883")
    app = await assemble(config, transport=transport, clock=clock, base=Path("/var/lib/edge-agent"))
    await app.start()
    ...
    await app.stop()   # stop taking work, flush the outboxes, close the databases

Names load on first use: a worker that only builds its transport loads no agent code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.core.lazy import lazy_attributes

if TYPE_CHECKING:
    from agent.app.app import AgentPart, App
    from agent.app.roles import AGENT, AppEnv, Starting, assemble, prepare
    from agent.app.transport import client_id_of, make_transport, presence_wills

_LAZY = {
    "AGENT": "roles",
    "AgentPart": "app",
    "App": "app",
    "AppEnv": "roles",
    "assemble": "roles",
    "client_id_of": "transport",
    "make_transport": "transport",
    "presence_wills": "transport",
    "prepare": "roles",
    "Starting": "roles",
}

__getattr__ = lazy_attributes(__name__, {name: f"agent.app.{module}" for name, module in _LAZY.items()})

__all__ = ["AGENT", "AgentPart", "App", "AppEnv", "Starting", "assemble", "client_id_of", "make_transport",
           "prepare", "presence_wills"]
