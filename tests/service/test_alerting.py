"""The shipped alerting rules and dashboard: promtool checks the rules and runs their unit tests
(configs/prometheus/edge-agent.rules.test.yml), and every series they use is one the real agents
export: a leader on PostgreSQL and a worker, each an `edge-agent run` process on a real
mosquitto, scraped at /metrics. A series that disappears from the agents fails here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alerting import (
    DASHBOARD,
    RULES,
    RULES_TEST,
    WITH_IDENTITY,
    dashboard_expressions,
    rule_expressions,
    series_in,
    series_used,
)
from e2e.agent_support import kill, spawn_agent, wait_for
from mosquitto import Mosquitto, free_port
from postgres import PostgresCluster

pytestmark = [pytest.mark.timeout(300)]

def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is missing (Debian's prometheus package; scripts/test.sh installs it)")
    return found


def test_promtool_checks_the_rules_and_runs_their_tests() -> None:
    tool = promtool()
    checked = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 15 rules found" in checked.stdout
    tested = subprocess.run([tool, "test", "rules", RULES_TEST.name], capture_output=True, text=True, timeout=120,
                            cwd=RULES_TEST.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_rule_has_a_promtool_test() -> None:
    names = re.findall(r"^\s*- alert: (\w+)", RULES.read_text(), re.M)
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    assert len(names) == 15 and not set(names) - tested, set(names) - tested


def test_the_dashboard_is_a_grafana_dashboard_with_a_query_per_panel() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "edge-agent-fleet" and dashboard["schemaVersion"] >= 36
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert series_in(dashboard_expressions()) and series_in(rule_expressions())


def families(port: int) -> set[str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return set()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_every_series_the_rules_and_dashboard_use_is_exported_by_the_agents(
        tmp_path: Path, mosquitto: Mosquitto, postgres: PostgresCluster) -> None:
    leader_port, worker_port = free_port(), free_port()
    leader = spawn_agent(tmp_path, "leader", "gw1", mosquitto.url,
                         leader={"database": postgres.url()}, metrics={"listen": f"127.0.0.1:{leader_port}"})
    worker = spawn_agent(tmp_path, "worker", "pi-1", mosquitto.url, metrics={"listen": f"127.0.0.1:{worker_port}"})
    try:
        from_leader = wait_for(lambda: (found := families(leader_port)) and "ea_fleet_leaders" in found and found,
                               "the leader's fleet families at /metrics", limit_s=120)
        from_worker = wait_for(lambda: (found := families(worker_port)) and "ea_worker_broker_bytes_per_hour" in found
                               and found, "the worker's families at /metrics", limit_s=120)
    finally:
        kill(worker)
        kill(leader)
    used = series_used()
    assert {"ea_fleet_devices", "ea_rollout_info", "ea_config_devices", "ea_outbox_pending"} <= used
    missing = used - from_leader - from_worker - WITH_IDENTITY
    assert not missing, f"the rules or the dashboard use series no agent exports: {sorted(missing)}"
