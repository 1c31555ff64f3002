"""scripts/install.sh into a temporary root: layout, modes, idempotence, uninstall, errors."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install.sh"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def snapshot_checkout(dest: Path) -> Path:
    """A frozen copy of the checkout, so the sources cannot change between two runs."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".venv", "build", "*.egg-info", "*.db")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, dest / name)
    for name in ("agent", "firmware_rollout", "config_rollout", "app_rollout", "release_rollout", "rollout_engine",
                 "configs", "systemd", "scripts"):
        if (REPO / name).exists():
            shutil.copytree(REPO / name, dest / name, ignore=ignore)
    return dest / "scripts" / "install.sh"


def run(script: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def manifest(root: Path) -> dict[str, tuple]:
    """Every path under root with its type, mode and content hash (or link target)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                out[rel] = ("file", stat.S_IMODE(st.st_mode), digest)
    return out


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("checkout")
    return snapshot_checkout(src)


@pytest.mark.slow
def test_install_into_a_temporary_root_is_complete_and_idempotent(
    checkout: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    first = run(checkout, "--role", "worker", "--prefix", str(root), "--systemd-version", "252")
    assert "not creating user edge-agent" in first.stdout

    agent = root / "opt/edge-agent/bin/edge-agent"
    assert os.access(agent, os.X_OK)
    version = subprocess.run([str(agent), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("edge-agent ")
    # every package pyproject.toml ships is installed (a worker's start imports each of them)
    shipped = tomllib.loads((checkout.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packages = [p.rstrip("*") for p in shipped["find"]["include"]]
    imported = subprocess.run([str(root / "opt/edge-agent/bin/python"), "-c", "import " + ", ".join(packages)],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert imported.returncode == 0, imported.stderr

    config = root / "etc/edge-agent/agent.toml"
    assert mode(config) == 0o600 and mode(config.parent) == 0o750
    assert 'role = "worker"' in config.read_text()
    units = root / "etc/systemd/system"
    for name in ("edge-agent.service", "edge-agent@.service"):
        assert (units / name).read_bytes() == (checkout.parents[1] / "systemd" / name).read_bytes()
        assert mode(units / name) == 0o644
    wants = units / "multi-user.target.wants/edge-agent.service"
    assert os.readlink(wants) == "/etc/systemd/system/edge-agent.service"
    # a worker gets the root install helper: its units, its socket enabled, its own config
    for name in ("edge-agent-installer.socket", "edge-agent-installer.service"):
        assert (units / name).read_bytes() == (checkout.parents[1] / "systemd" / name).read_bytes()
    assert os.readlink(units / "sockets.target.wants/edge-agent-installer.socket") == (
        "/etc/systemd/system/edge-agent-installer.socket")
    assert mode(root / "etc/edge-agent/installer.toml") == 0o600
    sysusers = (root / "etc/sysusers.d/edge-agent.conf").read_text()
    assert "u edge-agent -" in sysusers
    assert "g edge-agent-installer -" in sysusers and "m edge-agent edge-agent-installer" in sysusers
    assert not (units / "edge-agent.service.d").exists()  # no back-off drop-in for systemd 252

    before = manifest(root)
    second = run(checkout, "--role", "worker", "--prefix", str(root), "--systemd-version", "252")
    assert manifest(root) == before
    for word in ("wrote", "installed", "created", "linked"):
        assert f"install.sh: {word} " not in second.stdout, second.stdout

    # an existing config is never overwritten, whatever the role asked for
    config.write_text("# edited by the operator\n")
    run(checkout, "--role", "leader", "--prefix", str(root), "--systemd-version", "252")
    assert config.read_text() == "# edited by the operator\n"

    if SYSTEMD_ANALYZE:
        verify = subprocess.run(
            [SYSTEMD_ANALYZE, "verify", str(units / "edge-agent.service")],
            capture_output=True, text=True, timeout=120,
        )
        assert "edge-agent" not in verify.stdout + verify.stderr

    # a second agent on the same host: a template instance with its own config and state
    run(checkout, "--role", "leader", "--instance", "leader", "--prefix", str(root),
        "--systemd-version", "256")
    leader_config = root / "etc/edge-agent/leader.toml"
    assert mode(leader_config) == 0o600
    assert 'data_dir = "/var/lib/edge-agent/leader"' in leader_config.read_text()
    assert os.readlink(units / "multi-user.target.wants/edge-agent@leader.service") == (
        "/etc/systemd/system/edge-agent@.service"
    )
    backoff = (units / "edge-agent@.service.d/restart-backoff.conf").read_text()
    assert "RestartSteps=" in backoff and "RestartMaxDelaySec=" in backoff

    # uninstall keeps config and state, removes the rest
    (root / "var/lib/edge-agent").mkdir(parents=True)
    run(checkout, "--uninstall", "--prefix", str(root))
    assert not (units / "edge-agent.service").exists()
    assert not (units / "edge-agent@.service").exists()
    assert not (units / "edge-agent@.service.d").exists()
    assert not (units / "multi-user.target.wants").exists()
    assert not (units / "edge-agent-installer.socket").exists()
    assert not (units / "sockets.target.wants").exists()
    assert not (root / "opt/edge-agent").exists()
    assert config.exists() and leader_config.exists()
    assert (root / "var/lib/edge-agent").is_dir()

    run(checkout, "--uninstall", "--purge", "--prefix", str(root))
    assert not (root / "etc/edge-agent").exists()
    assert not (root / "var/lib/edge-agent").exists()


def test_destdir_environment_variable_is_a_prefix(tmp_path: Path) -> None:
    fake_python = tmp_path / "python-old"
    fake_python.write_text('#!/bin/sh\ncase "$2" in *print*) echo 3.9.2; exit 0;; esac\nexit 1\n')
    fake_python.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--python", str(fake_python)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "DESTDIR": str(tmp_path / "r")},
    )
    assert proc.returncode == 2
    assert "needs Python >= 3.11" in proc.stderr and "3.9.2" in proc.stderr
    assert not (tmp_path / "r" / "opt").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--role", "gateway"], "--role must be worker or leader"),
        (["--instance", "../evil"], "--instance must be"),
        (["--purge"], "--purge only goes with --uninstall"),
        (["--bogus"], "unknown argument"),
        (["--python", "/nonexistent/python3"], "not found"),
    ],
)
def test_bad_arguments_are_clear_errors(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), "--prefix", str(tmp_path / "r"), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to run the installer as another user")
@pytest.mark.parametrize("use_prefix", [False, True])
def test_not_root_is_a_clear_error(use_prefix: bool) -> None:
    locked = Path(tempfile.mkdtemp(prefix="edge-agent-locked-"))  # root's, 0755: not nobody's
    locked.chmod(0o755)
    args = ["--prefix", str(locked)] if use_prefix else []
    try:
        proc = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             "bash", str(SCRIPT), "--role", "worker", *args],
            capture_output=True, text=True, timeout=60, cwd="/",
        )
    finally:
        shutil.rmtree(locked)
    assert proc.returncode == 2
    expected = "is not writable by you" if use_prefix else "must run as root"
    assert expected in proc.stderr


@pytest.mark.slow
def test_a_device_that_enrols_itself_is_installed_with_its_claim_credential(checkout: Path, tmp_path: Path) -> None:
    from agent.core.config import load_config

    root = tmp_path / "root"
    (tmp_path / "claim-pw").write_text("claim-pw\n")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    run(checkout, "--role", "worker", "--prefix", str(root), "--device-id", "pi-0042", "--broker",
        "mqtts://gw:8883", "--fleet-ca", str(tmp_path / "ca.crt"), "--enrol", "mqtts://gw:8884",
        "--claim-password-file", str(tmp_path / "claim-pw"))
    etc = root / "etc" / "edge-agent"
    config = load_config(etc / "agent.toml")
    assert config.agent.device_id == "pi-0042" and config.mqtt.url == "mqtts://gw:8883"
    assert config.mqtt.tls_ca == str(etc / "fleet-ca.crt")
    assert config.identity is not None and config.identity.claim_url == "mqtts://gw:8884"
    assert config.identity.claim_password_file == str(etc / "claim-password")
    assert mode(etc / "claim-password") == 0o600 and (etc / "claim-password").read_text() == "claim-pw\n"
    refused = run(checkout, "--role", "worker", "--prefix", str(root), "--enrol", "mqtt://gw:8884", check=False)
    assert refused.returncode == 2 and "--enrol must be the broker's mqtts:// enrolment listener" in refused.stderr
