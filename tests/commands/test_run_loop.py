"""Which event loop `edge-agent run` picks: the config's choice, else by role."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.commands.run import wants_uvloop
from agent.core.config import AgentSection, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(("role", "setting", "expected"), [
    ("leader", None, True),
    ("worker", None, False),
    ("worker", True, True),
    ("leader", False, False),
])
def test_loop_by_role_unless_configured(role: str, setting: bool | None, expected: bool) -> None:
    assert wants_uvloop(AgentSection(device_id="d1", role=role, use_uvloop=setting)) is expected  # type: ignore[arg-type]


def test_shipped_configs_pick_uvloop_for_the_leader_only() -> None:
    assert wants_uvloop(load_config(CONFIGS / "leader.toml").agent) is True
    assert wants_uvloop(load_config(CONFIGS / "worker.toml").agent) is False
