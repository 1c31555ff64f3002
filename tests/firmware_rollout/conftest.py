from __future__ import annotations

from pathlib import Path

import pytest
from fwhelpers import Keys, make_keys


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return make_keys(tmp_path)


@pytest.fixture
def db(leader_store: Path | str) -> Path | str:
    """Where the rollout tables are: `leader.db`, then the fleet's PostgreSQL database."""
    return leader_store
