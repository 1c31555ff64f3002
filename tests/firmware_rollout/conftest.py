from __future__ import annotations

from pathlib import Path

import pytest
from fwhelpers import Keys, make_keys


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return make_keys(tmp_path)
