"""The systemd units: `systemd-analyze verify` is clean and the service contract is in place."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = [REPO / "systemd" / "edge-agent.service", REPO / "systemd" / "edge-agent@.service"]  # the agent's
HELPER_UNITS = [REPO / "systemd" / "edge-agent-installer.socket", REPO / "systemd" / "edge-agent-installer.service",
                REPO / "systemd" / "edge-agent-apps.socket", REPO / "systemd" / "edge-agent-apps.service"]
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")


def directives(path: Path) -> dict[str, list[str]]:
    """`Key=value` lines of a unit (all sections; repeated keys keep every value)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value)
    return out


def verify(*paths: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, paths)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_every_unit_exists() -> None:
    assert sorted(p.name for p in (REPO / "systemd").iterdir()) == sorted(p.name for p in UNITS + HELPER_UNITS)


@needs_analyze
def test_systemd_analyze_verify_says_nothing_about_our_units() -> None:
    proc = verify(*UNITS, *HELPER_UNITS)
    output = proc.stdout + proc.stderr
    assert "edge-agent" not in output, output
    assert proc.returncode == 0, output


@needs_analyze
def test_verify_would_notice_a_broken_unit(tmp_path: Path) -> None:
    for unit in UNITS:
        broken = tmp_path / unit.name
        text = unit.read_text().replace("WatchdogSec=30", "WatchdogSec=30\nWachdogSec=30")
        broken.write_text(text.replace("/usr/bin/env", "/nonexistent/env"))
        proc = verify(broken)
        output = proc.stdout + proc.stderr
        assert "Unknown key" in output and "is not executable" in output


@needs_analyze
def test_security_exposure_is_low() -> None:
    proc = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", str(UNITS[0])],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "offline" in proc.stderr:
        pytest.skip("this systemd-analyze cannot assess units offline")
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    assert float(found[1]) <= 2.0


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_service_contract(unit: Path) -> None:
    d = directives(unit)
    single = {k: v[-1] for k, v in d.items()}
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "WatchdogSec": "30",
        "Restart": "on-failure",
        "User": "edge-agent",
        "Group": "edge-agent",
        "ConfigurationDirectory": "edge-agent",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "MemoryMax": "96M",
        "UMask": "0027",
        "WantedBy": "multi-user.target",
    }
    for key, value in expected.items():
        assert single.get(key) == value, key
    assert single["StateDirectory"].startswith("edge-agent")
    assert "DynamicUser" not in d
    assert int(single["RestartSec"]) > 0
    exec_start = single["ExecStart"].split()
    assert exec_start[:3] == ["/usr/bin/env", "/opt/edge-agent/bin/edge-agent", "run"]
    assert exec_start[3] == "--config" and exec_start[4].startswith("/etc/edge-agent/")
    # keys systemd 252 (Debian 12) does not know must stay out of the shipped units
    assert "RestartSteps" not in d and "RestartMaxDelaySec" not in d


def test_the_install_helper_listens_for_root_and_its_own_group_only() -> None:
    """M4: not `edge-agent`, the group applications join for the local API."""
    socket_unit = {k: v[-1] for k, v in directives(HELPER_UNITS[0]).items()}
    assert (socket_unit["SocketUser"], socket_unit["SocketGroup"], socket_unit["SocketMode"]) == (
        "root", "edge-agent-installer", "0660")
    assert socket_unit["ListenStream"] == "/run/edge-agent-installer.sock"
    service = {k: v[-1] for k, v in directives(HELPER_UNITS[1]).items()}
    assert service["ExecStart"].split()[1:] == ["/opt/edge-agent/bin/edge-agent", "install-helper", "--config",
                                                "/etc/edge-agent/installer.toml"]
    assert "User" not in service  # root: it writes block devices
    assert service["NoNewPrivileges"] == "yes" and service["RestrictAddressFamilies"] == "AF_UNIX"
