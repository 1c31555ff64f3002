"""The Debian package as an operator meets it: built by scripts/build-deb.sh, lintian without an
error, `apt install ./edge-agent_VERSION_ARCH.deb` into a Debian bookworm root (made by mmdebstrap
from Debian's packages, cached outside the checkout by its inputs), an upgrade that keeps the
state and the operator's configuration, and a purge that removes them."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", "/var/cache/edge-agent-bench"))
BASE = ["mmdebstrap", "--quiet", "--variant=apt", "--include=python3.11,systemd,procps", "bookworm"]

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="installs into a root with chroot"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("mmdebstrap", "lintian", "fakeroot", "dpkg-deb")),
                       reason="needs Debian's mmdebstrap, lintian and fakeroot (scripts/test.sh installs them)"),
]


def run(*argv: str | Path, root: Path | None = None) -> str:
    """A command (inside `root` with chroot), its output; a failure shows what it said."""
    cmd = [str(a) for a in argv]
    if root is not None:
        cmd = ["chroot", str(root), "env", "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C.UTF-8", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def bookworm_root() -> Path:
    """A tarball of a bookworm root with Python 3.11 and systemd, made once per input."""
    key = hashlib.sha256(" ".join(BASE).encode()).hexdigest()[:16]
    tar = CACHE / f"bookworm-apt-{key}.tar"
    if not tar.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        part = tar.with_name(f"{tar.stem}.part.tar")  # (mmdebstrap picks the format by the suffix)
        run(*BASE, part)
        part.rename(tar)
    return tar


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """The package, and the same package as a newer version (an upgrade)."""
    out = tmp_path_factory.mktemp("debs")
    built = subprocess.run(["bash", "-c", 'umask 027 && exec bash "$0" --out "$1"', REPO / "scripts" / "build-deb.sh",
                            out], capture_output=True, text=True, timeout=600)  # (the agent's own umask: built alike)
    assert built.returncode == 0, built.stderr
    deb = Path(built.stdout.strip().splitlines()[-1])
    unpacked = out / "unpacked"
    run("dpkg-deb", "-R", deb, unpacked)
    control = unpacked / "DEBIAN" / "control"
    version = next(line.split(": ")[1] for line in control.read_text().splitlines() if line.startswith("Version: "))
    control.write_text(control.read_text().replace(f"Version: {version}", f"Version: {version}+1"))
    newer = out / f"newer-{deb.name}"
    run("fakeroot", "dpkg-deb", "--root-owner-group", "-b", unpacked, newer)
    yield deb, newer


def test_lintian_finds_no_error(debs: tuple[Path, Path]) -> None:
    said = run("lintian", "--tag-display-limit", "0", debs[0])
    assert not [line for line in said.splitlines() if line.startswith("E:")], said


def test_apt_installs_upgrades_keeping_state_and_purges(debs: tuple[Path, Path], tmp_path: Path) -> None:
    deb, newer = debs
    root = tmp_path / "root"
    root.mkdir()
    run("tar", "-C", root, "-xf", bookworm_root())
    for d in (deb, newer):
        shutil.copy(d, root / "tmp" / d.name)
    said = run("apt-get", "install", "-y", "-q", f"/tmp/{deb.name}", root=root)
    assert "set device_id and [mqtt] in /etc/edge-agent/agent.toml" in said
    assert run("edge-agent", "--version", root=root).startswith("edge-agent ")
    assert "edge-agent-installer" in run("id", "edge-agent", root=root)

    def owner(path: str) -> tuple[str, str, str]:
        return tuple(run("stat", "-c", "%a %U %G", path, root=root).split())  # type: ignore[return-value]

    assert owner("/etc/edge-agent/agent.toml") == ("640", "root", "edge-agent")
    assert owner("/etc/edge-agent/installer.toml") == ("600", "root", "root")
    assert owner("/var/lib/edge-agent") == ("750", "edge-agent", "edge-agent")
    assert (root / "etc/systemd/system/multi-user.target.wants/edge-agent.service").is_symlink()
    assert (root / "etc/systemd/system/sockets.target.wants/edge-agent-installer.socket").is_symlink()
    assert "ExecStart=/usr/lib/edge-agent/bin/edge-agent run" in (root / "lib/systemd/system/edge-agent.service"
                                                                   ).read_text()
    assert list((root / "usr/lib/edge-agent/lib").rglob("agent/__pycache__/cli.*.pyc"))  # compiled at install
    run("systemd-analyze", "verify", "/lib/systemd/system/edge-agent.service", root=root)

    # the operator's configuration and the agent's state survive an upgrade
    conf = root / "etc/edge-agent/agent.toml"
    conf.write_text(conf.read_text().replace('device_id = "pi-0001"', 'device_id = "pi-0042"'))
    (root / "var/lib/edge-agent/outbox.db").write_bytes(b"the device's messages")
    run("apt-get", "install", "-y", "-q", "-o", "Dpkg::Options::=--force-confold", f"/tmp/{newer.name}", root=root)
    assert 'device_id = "pi-0042"' in conf.read_text()
    assert (root / "var/lib/edge-agent/outbox.db").read_bytes() == b"the device's messages"
    assert owner("/etc/edge-agent/agent.toml") == ("640", "root", "edge-agent")
    assert "+1" in run("dpkg-query", "-W", "-f", "${Version}", "edge-agent", root=root)

    run("apt-get", "purge", "-y", "-q", "edge-agent", root=root)
    for gone in ("usr/lib/edge-agent", "usr/bin/edge-agent", "etc/edge-agent", "var/lib/edge-agent",
                 "var/lib/edge-agent-crl", "etc/systemd/system/multi-user.target.wants/edge-agent.service"):
        assert not (root / gone).exists() and not (root / gone).is_symlink(), gone
    assert "/etc/edge-agent" not in (root / "var/lib/dpkg/statoverride").read_text()
