"""Application bundles: built from a directory, verified whole, and every bad one refused in one
line that names the file and the key, the line or the field."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from apps_support import UNIT, app_dir, fleet_key

from app_rollout.bundle import build_bundle, read_bundle, read_head, verify_head
from app_rollout.errors import AppBundleError, BundleSignature, MalformedBundle, UnitRefused
from app_rollout.unit import check_unit, render_unit
from rollout_engine.keys import SigningKey

REPO = Path(__file__).resolve().parents[2]


def edge_agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_a_bundle_built_from_a_directory_verifies_and_holds_every_file(tmp_path: Path) -> None:
    key, private, public = fleet_key(tmp_path / "keys")
    built = edge_agent("app", "build", str(app_dir(tmp_path / "hello")), "--key", str(private),
                       "--out", str(tmp_path / "hello.eaapp"))
    assert built.returncode == 0, built.stderr
    assert "application hello 1.0.0, 2 files" in built.stdout
    app = read_bundle(tmp_path / "hello.eaapp", key.public)
    assert {(f.path, f.mode) for f in app.manifest.files} == {("bin/server", 0o755), ("share/greeting.txt", 0o644)}
    assert app.manifest.health.check == "active"
    checked = edge_agent("app", "verify", str(tmp_path / "hello.eaapp"), "--key", str(public))
    assert checked.returncode == 0 and "ok: application hello 1.0.0" in checked.stdout


def test_a_changed_byte_another_key_or_no_signature_is_refused(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    app = build_bundle(app_dir(tmp_path / "hello"), key, tmp_path / "hello.eaapp")
    data = bytearray((tmp_path / "hello.eaapp").read_bytes())
    data[-3] ^= 1  # a byte of the last file
    (tmp_path / "changed.eaapp").write_bytes(bytes(data))
    with pytest.raises(MalformedBundle, match=r"changed.eaapp: share/greeting.txt: its sha256 differs"):
        read_bundle(tmp_path / "changed.eaapp", key.public)
    with pytest.raises(BundleSignature, match="not the fleet's key"):
        read_bundle(tmp_path / "hello.eaapp", SigningKey.generate().public)
    head = bytearray(app.head)
    head[-72:] = bytes(72)  # key id and signature zeroed: unsigned
    with pytest.raises(BundleSignature, match="unsigned"):
        verify_head(bytes(head), key.public, source="offer")
    head = bytearray(app.head)
    head[20] ^= 1  # a byte of the signed manifest
    with pytest.raises(BundleSignature, match="does not verify"):
        verify_head(bytes(head), key.public, source="offer")


def test_chunks_that_do_not_add_up_to_their_file_are_refused_and_the_manifest_keeps_its_cap(tmp_path: Path) -> None:
    """A signed manifest whose chunk list disagrees with its file's size is refused naming the
    file; a build whose chunk lists would pass the manifest's cap lists the largest files whole."""
    import msgspec

    from app_rollout.bundle import MANIFEST_MAX, AppFile, AppManifest, _fitting, sign_manifest

    key, _, _ = fleet_key(tmp_path / "keys")
    app = build_bundle(app_dir(tmp_path / "hello"), key, tmp_path / "hello.eaapp")
    files = tuple(msgspec.structs.replace(f, chunks=((5, "0" * 64),)) if f.path == "share/greeting.txt" else f
                  for f in app.manifest.files)
    bad = sign_manifest(msgspec.structs.replace(app.manifest, files=files), key)
    with pytest.raises(MalformedBundle, match=r"offer: share/greeting.txt: its chunks add up to 5 bytes, not its 3"):
        verify_head(bad, key.public, source="offer")
    chunk = [65536, "a" * 64]
    big = [{"path": f"f{i}", "size": 65536 * n, "mode": 0o644, "sha256": "b" * 64, "chunks": [chunk] * n}
           for i, n in enumerate((3000, 1500, 10))]
    fitted = _fitting(big)
    assert "chunks" not in fitted[0] and len(fitted[1]["chunks"]) == 1500 and len(fitted[2]["chunks"]) == 10
    manifest = msgspec.convert({"name": "hello", "version": "1.0.0", "unit": app.manifest.unit, "files": fitted},
                               type=AppManifest)
    assert len(sign_manifest(manifest, key)) < MANIFEST_MAX
    assert isinstance(manifest.files[1], AppFile)


@pytest.mark.parametrize(("line", "says"), [
    ("User=root", r"line 7: \[Service\] User= is not taken: an application runs as its own dynamic user"),
    ("ExecStartPre=+/bin/chmod 777 /etc", r"\[Service\] ExecStartPre= is not taken"),
    ("AmbientCapabilities=CAP_SYS_ADMIN", "an application has no capabilities"),
    ("ReadWritePaths=/", "an application writes only its data directory"),
    ("ExecReload=+bin/server", r"a command prefix \(\+\) is not taken"),
    ("ExecReload=/sbin/reboot", "a program under /usr/bin or /bin"),
    ("ExecReload=bin/missing", "bin/missing: not an executable file of the bundle"),
    ("ExecReload=share/greeting.txt", "not an executable file of the bundle"),
    ("Type=forking", r"Type=forking: not a value this key takes here"),
    ("Environment=LD_PRELOAD=/x \\", r"a line continued with \\ is not taken"),
])
def test_a_unit_that_asks_for_more_than_an_application_may_is_refused_naming_the_line(
        tmp_path: Path, line: str, says: str) -> None:
    key, private, _ = fleet_key(tmp_path / "keys")
    unit = UNIT.replace("Type=exec\n", f"Type=exec\n{line}\n") if not line.startswith("Type=") else \
        UNIT.replace("Type=exec", line)
    built = edge_agent("app", "build", str(app_dir(tmp_path / "hello", unit=unit)), "--key", str(private),
                       "--out", str(tmp_path / "hello.eaapp"))
    assert built.returncode == 2
    assert built.stderr.count("\n") == 1 and "Traceback" not in built.stderr
    assert "app.toml: unit: line" in built.stderr or "app.toml: unit:" in built.stderr
    assert re.search(says, built.stderr), built.stderr
    assert not (tmp_path / "hello.eaapp").exists()


def test_other_sections_units_and_health_checks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UnitRefused, match=r"section \[Socket\]"):
        check_unit(UNIT + "[Socket]\nListenStream=80\n", executables=frozenset({"bin/server"}), source="u")
    with pytest.raises(UnitRefused, match="After=sshd.service: an application orders itself after targets only"):
        check_unit(UNIT.replace("After=network-online.target", "After=sshd.service"),
                   executables=frozenset({"bin/server"}), source="u")
    with pytest.raises(UnitRefused, match="exactly one ExecStart"):
        check_unit(UNIT.replace("ExecStart=bin/server --port 8080\n", ""), executables=frozenset(), source="u")
    key, _, _ = fleet_key(tmp_path / "keys")
    with pytest.raises(MalformedBundle, match="health.url 'http://example.com/': an http check asks a loopback URL"):
        build_bundle(app_dir(tmp_path / "a", health='check = "http"\nurl = "http://example.com/"'), key,
                     tmp_path / "a.eaapp")
    with pytest.raises(AppBundleError, match=r"app.toml: .*name"):
        build_bundle(app_dir(tmp_path / "b", name="Bad_Name"), key, tmp_path / "b.eaapp")
    link = app_dir(tmp_path / "c") / "files" / "etc-link"
    link.symlink_to("/etc/shadow")
    with pytest.raises(AppBundleError, match="only regular files go into a bundle"):
        build_bundle(tmp_path / "c", key, tmp_path / "c.eaapp")


def test_the_unit_the_device_runs_is_the_checked_lines_and_the_sandbox() -> None:
    app = check_unit(UNIT, executables=frozenset({"bin/server"}), source="u")
    text = render_unit(app, name="hello", version="1.0.0", files_dir="/var/lib/edge-agent-apps/hello/1.0.0/files",
                       hidden=("/var/lib/edge-agent", "/etc/edge-agent"))
    assert "ExecStart=/var/lib/edge-agent-apps/hello/1.0.0/files/bin/server --port 8080" in text
    for line in ("DynamicUser=yes", "StateDirectory=edge-apps/hello", "ProtectSystem=strict", "NoNewPrivileges=yes",
                 "CapabilityBoundingSet=", "InaccessiblePaths=-/var/lib/edge-agent",
                 "InaccessiblePaths=-/etc/edge-agent", "WantedBy=multi-user.target"):
        assert line in text.splitlines()
    assert "User=" not in text.replace("DynamicUser=", "")


def test_the_head_is_read_alone_and_names_the_bundle(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    app = build_bundle(app_dir(tmp_path / "hello", version="2.1.0"), key, tmp_path / "hello.eaapp")
    assert read_head(tmp_path / "hello.eaapp") == app.head
    assert verify_head(app.head, key.public, source="x").version == "2.1.0"


def test_a_removal_is_built_signed_and_verified_and_holds_nothing(tmp_path: Path) -> None:
    import msgspec

    from app_rollout.bundle import sign_manifest
    from app_rollout.kind import describe_bundle

    key, private, public = fleet_key(tmp_path / "keys")
    out = tmp_path / "hello-removed-2.0.0.eaapp"
    made = edge_agent("app", "removal", "hello", "--version", "2.0.0", "--key", str(private), "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"{out}: removal of application hello at 2.0.0, signed by key ")
    checked = edge_agent("app", "verify", str(out), "--key", str(public))
    assert checked.returncode == 0 and "ok: removal of application hello at 2.0.0" in checked.stdout
    assert describe_bundle(out).installs == "the removal of application hello at 2.0.0"
    bad = edge_agent("app", "removal", "Hello!", "--version", "2.0.0", "--key", str(private), "--out",
                     str(tmp_path / "x.eaapp"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "application 'Hello!'" in bad.stderr
    app = build_bundle(app_dir(tmp_path / "hello"), key, tmp_path / "hello.eaapp")
    stuffed = msgspec.structs.replace(app.manifest, runtime="removed")
    with pytest.raises(MalformedBundle, match="offer: a removal of hello holds no unit and no file"):
        verify_head(sign_manifest(stuffed, key), key.public, source="offer")
