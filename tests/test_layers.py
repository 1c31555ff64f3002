"""The layers of docs/architecture.md, as the packages' own docstrings and the import contracts
state them: a package that says "Layer N" says the doc's number, and the contracts list the
rooms in the doc's order (lint-imports then checks the imports against them)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def doc_layers() -> dict[str, int]:
    """{room: layer number} from the diagram under "## Layers"."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("```", 2)[1]
    found: dict[str, int] = {}
    for line in section.splitlines():
        match = re.match(r"\s*(\d+)\s+(\S.*?)\s{2,}", line + "  ")
        if match:
            for room in match[2].split("|"):
                found[room.strip()] = int(match[1])
    return found


def test_the_doc_names_every_layer_once() -> None:
    layers = doc_layers()
    assert sorted(set(layers.values())) == list(range(11))
    assert layers["agent.core"] == 0 and layers["agent.cli"] == 10


def test_each_package_docstring_says_its_layer_as_the_doc_does() -> None:
    layers = doc_layers()
    checked = 0
    for room, number in layers.items():
        init = REPO / Path(*room.split(".")) / "__init__.py"
        module = init if init.exists() else REPO / (str(Path(*room.split("."))) + ".py")
        docstring = ast.get_docstring(ast.parse(module.read_text())) or ""
        said = re.search(r"\bLayer (\d+)\b", docstring)
        if said is None:
            continue
        checked += 1
        assert int(said[1]) == number, f"{module.relative_to(REPO)} says layer {said[1]}, docs say {number}"
    assert checked >= 8


def test_the_layers_contract_lists_the_doc_rooms_in_order() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contract = config["tool"]["importlinter"]["contracts"][0]
    layers = doc_layers()
    listed = [{room.strip() for room in entry.split("|")} for entry in contract["layers"]]
    numbers = [{layers[room] for room in rooms} for rooms in listed]
    assert all(len(n) == 1 for n in numbers), numbers
    assert [n.pop() for n in numbers] == list(range(10, -1, -1))


def test_the_features_contract_forbids_every_private_transport_module() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "forbidden")
    assert set(contract["source_modules"]) == {"agent.commands", "agent.sim"}
    transport = REPO / "agent" / "transport"
    private = {f"agent.transport.{p.stem}" for p in transport.glob("_*.py") if p.stem != "__init__"}
    assert private and private <= set(contract["forbidden_modules"])
    features = {"agent.leader.rollout", "agent.leader.northbound", "agent.worker.updater_actor"}
    assert features <= set(contract["forbidden_modules"])


# A store's migrations kept in a module of their own: part of the store that owns the tables.
MIGRATIONS_OF = {"rollout_engine/schema.py": "rollout_engine/store.py"}
# Each table of the leader's database, and the one module whose store owns it (reads included).
TABLE_OWNERS = {
    "devices": "agent/leader/registry.py",
    "telemetry_last": "agent/leader/registry.py",
    "registry_meta": "agent/leader/registry.py",
    "rejects": "agent/leader/rejects.py",
    "jobs": "agent/leader/jobs.py",
    "jobqueue_meta": "agent/leader/jobs.py",
    "fleet_online": "agent/leader/registry.py",
    "rollouts": "rollout_engine/store.py",
    "rollout_devices": "rollout_engine/store.py",
    "rollout_controls": "rollout_engine/store.py",
    "rollout_device_events": "rollout_engine/store.py",
    "rollout_device_logs": "rollout_engine/store.py",
    "remote_sessions": "agent/leader/session_log.py",
    "remote_session_input": "agent/leader/session_log.py",
}


def test_sql_on_a_leader_table_is_only_in_the_store_that_owns_it() -> None:
    pattern = re.compile(r"\b(?:FROM|JOIN|INTO|UPDATE)\s+(" + "|".join(TABLE_OWNERS) + r")\b")
    found = []
    packages = ("agent", "firmware_rollout", "config_rollout", "app_rollout", "release_rollout", "rollout_engine")
    for path in [p for package in packages for p in (REPO / package).rglob("*.py")]:
        relative = str(path.relative_to(REPO))
        for table in pattern.findall(path.read_text()):
            if TABLE_OWNERS[table] != MIGRATIONS_OF.get(relative, relative):
                found.append(f"{relative} queries {table} (owned by {TABLE_OWNERS[table]})")
    assert not found, "\n".join(found)
