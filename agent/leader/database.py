"""Where a leader keeps its state: `leader.db` in its data dir, and the fleet's shared part.

The fleet's shared part (device registry, application messages, rejects, device identities, the
job queue, the rollout tables, the configuration layers) is `leader.db` too unless `[leader]
database` names a PostgreSQL database, which every leader of the fleet given the same URL then
shares. What is still each leader's own lives in its `leader.db` whatever `database` says: the
leader's outbox (docs/service.md, "Several leaders on PostgreSQL", says what that means for
several leaders).
"""

from __future__ import annotations

from pathlib import Path

from agent.core.config import AgentConfig
from agent.core.sql import StoreTarget, store_target
from agent.service.files import read_secret

LEADER_DB = "leader.db"


def shared_database(config: AgentConfig, base: Path) -> StoreTarget:
    """The fleet's shared stores' place: `base/leader.db`, or the PostgreSQL database of
    `[leader] database` with the password of `database_password_file` (a `ConfigError` naming
    the key when the file is unsafe or unreadable)."""
    lc = config.leader
    if not lc.database:
        return base / LEADER_DB
    password = read_secret(lc.database_password_file, what="leader.database_password_file") \
        if lc.database_password_file else None
    return store_target(lc.database, password=password, source="config", key="leader.database")


__all__ = ["LEADER_DB", "shared_database"]
