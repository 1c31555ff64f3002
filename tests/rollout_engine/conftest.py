from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def db(leader_store: Path | str) -> Path | str:
    """Where the rollout tables are: `leader.db`, then the fleet's PostgreSQL database."""
    return leader_store
