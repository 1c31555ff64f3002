"""Each import contract of `pyproject.toml` holds on the checkout and breaks on an import that
crosses it, planted in a copy: a contract that cannot fail checks nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("agent", "firmware_rollout", "config_rollout", "app_rollout", "release_rollout", "rollout_engine")


def contract_names() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [c["name"] for c in config["tool"]["importlinter"]["contracts"]]


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache", "--no-logo"], cwd=root, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(root)})


def broken(output: str) -> set[str]:
    """The names of the contracts lint-imports reports BROKEN (a long name wraps onto lines)."""
    flat = " ".join(output.split())
    return {name for name in contract_names() if f"{' '.join(name.split())} BROKEN" in flat}


# (the contract it breaks, where the import is planted, what it imports)
PLANTS = [
    ("the agent's layers: every import points down", "agent/core/_planted.py", "agent.worker.agent"),
    ("firmware_rollout: device and orchestration are peers over the artifact format",
     "firmware_rollout/device/_planted.py", "firmware_rollout.orchestration.kind"),
    ("rollout kinds are peers over the engine: the engine imports no kind, kinds never import each other",
     "rollout_engine/_planted.py", "config_rollout.release"),
    ("rollout kinds are peers over the engine: the engine imports no kind, kinds never import each other",
     "config_rollout/_planted.py", "firmware_rollout.messages"),
    ("rollout kinds are peers over the engine: the engine imports no kind, kinds never import each other",
     "app_rollout/_planted.py", "config_rollout.release"),
    ("rollout kinds are peers over the engine: the engine imports no kind, kinds never import each other",
     "release_rollout/_planted.py", "app_rollout.kind"),
    ("app_rollout: the device's side and the leader's kind are peers over the bundle",
     "app_rollout/device/_planted.py", "app_rollout.kind"),
    ("the commands and the simulator build agents through agent.app, never from the features",
     "agent/commands/_planted.py", "agent.worker.updater_actor"),
]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checkout")
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    for name in PACKAGES:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_every_contract_holds_on_the_checkout_and_each_is_planted_below(checkout: Path) -> None:
    done = lint(checkout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {name for name, _, _ in PLANTS} == set(contract_names())


@pytest.mark.parametrize(("contract", "where", "imported"), PLANTS, ids=[p[1] for p in PLANTS])
def test_a_planted_import_breaks_its_contract(checkout: Path, contract: str, where: str, imported: str) -> None:
    plant = checkout / where
    plant.write_text(f'"""A planted import."""\n\nimport {imported}  # noqa: F401\n')
    try:
        done = lint(checkout)
    finally:
        plant.unlink()
    assert done.returncode != 0, done.stdout
    assert contract in broken(done.stdout), done.stdout
