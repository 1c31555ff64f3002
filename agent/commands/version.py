"""`edge-agent version [--verbose] [--sbom]`.

`--sbom` prints a CycloneDX 1.6 JSON SBOM of what is installed with this agent: every package of
its Python environment, with versions, package URLs, licenses and their dependencies, made by
the CycloneDX project's own generator for Python environments (`cyclonedx-py environment`,
the `sbom` extra), edge-agent itself as the SBOM's main component. Reproducible: no timestamp
or random serial (SOURCE_DATE_EPOCH, when set, is the timestamp).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from agent import __version__
from agent.core.errors import ConfigError

SBOM_TIMEOUT_S = 300


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="also print Python and platform")
    parser.add_argument("--sbom", action="store_true",
                        help="print a CycloneDX 1.6 JSON SBOM of what is installed with this agent (the sbom extra)")


def main(args: argparse.Namespace) -> int:
    if args.sbom:
        sys.stdout.write(sbom())
        return 0
    print(f"edge-agent {__version__}")
    if args.verbose:
        print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    return 0


def sbom() -> str:
    """The SBOM's JSON text; a `ConfigError` says in one line why there is none."""
    if importlib.util.find_spec("cyclonedx_py") is None:
        raise ConfigError("--sbom", None, "needs the CycloneDX generator: pip install 'edge-agent[sbom]'")
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        own = metadata("edge-agent")
        summary = own["Summary"] or ""
        requires = [r for r in own.get_all("Requires-Dist") or [] if "extra ==" not in r]  # what a device runs
    except PackageNotFoundError:
        summary, requires = "", []
    with tempfile.TemporaryDirectory(prefix="edge-agent-sbom-") as tmp:
        main_component = Path(tmp) / "pyproject.toml"  # what names the main component (PEP 621)
        main_component.write_text(f'[project]\nname = "edge-agent"\nversion = "{__version__}"\n'
                                  f"description = {json.dumps(summary)}\ndependencies = {json.dumps(requires)}\n")
        done = subprocess.run([sys.executable, "-m", "cyclonedx_py", "environment", "--of", "JSON", "--sv", "1.6",
                               "--output-reproducible", "--mc-type", "application", "--pyproject",
                               str(main_component), sys.executable],
                              capture_output=True, text=True, timeout=SBOM_TIMEOUT_S)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise ConfigError("--sbom", None, f"the CycloneDX generator failed: {last[:300]}")
    return done.stdout
