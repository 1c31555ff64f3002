"""The series the shipped alerting rules (configs/prometheus) and Grafana dashboard
(configs/grafana) use, read out of their expressions."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "configs" / "prometheus" / "edge-agent.rules.yml"
RULES_TEST = REPO / "configs" / "prometheus" / "edge-agent.rules.test.yml"
DASHBOARD = REPO / "configs" / "grafana" / "edge-agent-fleet.json"

#: Exported only by a device with [identity], by its renewal's collector: tests/leader/test_enrolment.py
#: reads them from it.
WITH_IDENTITY = frozenset({"ea_identity_certificate_expires_in_seconds"})

_SERIES = re.compile(r"\b((?:ea|process)_[a-z0-9_]+)\b")


def rule_expressions() -> list[str]:
    """Each rule's `expr`, as written (one line or a folded block)."""
    exprs: list[str] = []
    lines = RULES.read_text().splitlines()
    for i, line in enumerate(lines):
        key = line.strip()
        if not key.startswith("expr:"):
            continue
        value = key[len("expr:"):].strip()
        if value in (">-", ">", "|", "|-"):
            indent = len(line) - len(line.lstrip())
            block = []
            for follow in lines[i + 1:]:
                if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                    break
                block.append(follow.strip())
            value = " ".join(block)
        exprs.append(value)
    return exprs


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def series_in(exprs: list[str]) -> set[str]:
    return {name for e in exprs for name in _SERIES.findall(e)}


def series_used() -> set[str]:
    """Every series name the rules and the dashboard ask Prometheus for."""
    return series_in(rule_expressions()) | series_in(dashboard_expressions())
