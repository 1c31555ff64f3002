"""`edge-agent version --sbom`: a CycloneDX 1.6 SBOM of what is installed with the agent, made by
the CycloneDX generator, valid against the CycloneDX schema, edge-agent its main component with
its runtime dependencies, each a component with a version and a package URL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from agent import __version__

ROOT = Path(__file__).resolve().parents[2]

# The schema's strict validation parses every IRI of the SBOM with an Earley parser: 47 s on an
# idle 2-core machine, past the suite's 120 s hang guard beside `stress-ng --cpu 2` and the board
# scenarios. It waits for nothing: only the CPU it gets.
pytestmark = pytest.mark.timeout(900)


def test_the_sbom_is_valid_cyclonedx_naming_the_agent_and_what_it_runs_on() -> None:
    done = subprocess.run([sys.executable, "-m", "agent.cli", "version", "--sbom"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(done.stdout) is None  # (None: no error)
    bom = json.loads(done.stdout)
    root = bom["metadata"]["component"]
    assert (bom["specVersion"], root["name"], root["version"], root["type"]) == ("1.6", "edge-agent", __version__,
                                                                                   "application")
    needs = {ref.split("==")[0].lower().replace("_", "-") for x in bom["dependencies"] if x["ref"] == root["bom-ref"]
             for ref in x.get("dependsOn", [])}
    assert {"aiomqtt", "paho-mqtt", "msgspec", "psutil", "cryptography", "tomli-w"} <= needs, needs
    by_name = {c["name"].lower().replace("_", "-"): c for c in bom["components"]}
    assert by_name["msgspec"]["purl"].startswith("pkg:pypi/msgspec@") and by_name["msgspec"]["version"]
    assert "timestamp" not in bom["metadata"] and "serialNumber" not in bom  # reproducible


def test_without_the_generator_it_says_what_to_install() -> None:
    code = ("import importlib.util, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name == 'cyclonedx_py' else real(name, *a)\n"
            "from agent.cli import main\nsys.exit(main(['version', '--sbom']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().endswith("--sbom: needs the CycloneDX generator: pip install 'edge-agent[sbom]'")
    assert done.stderr.count("\n") == 1
