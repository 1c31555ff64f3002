"""A signed config release: built from files, verified whole before anything of it is used; any
change of a byte, a cut, another key, a document over the cap is refused with one line saying
why, naming the file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cli import main as cli
from config_rollout.errors import ConfigReleaseError, MalformedRelease, ReleaseSignature
from config_rollout.release import build_release, parse_release, read_release, write_release
from rollout_engine.keys import SigningKey

KEY = SigningKey.generate()
OTHER = SigningKey.generate()


def _files(tmp_path: Path) -> list[Path]:
    (tmp_path / "app.toml").write_text('[server]\nport = 8080\n')
    (tmp_path / "limits.conf").write_bytes(b"max=3\n")
    return [tmp_path / "app.toml", tmp_path / "limits.conf"]


def test_a_release_holds_its_documents_and_is_named_by_its_hash(tmp_path: Path) -> None:
    data = build_release("app", "1.2.0", _files(tmp_path), KEY, created_ms=1)
    release = parse_release(data, KEY.public)
    assert (release.name, release.version) == ("app", "1.2.0")
    assert release.documents == {"app.toml": b'[server]\nport = 8080\n', "limits.conf": b"max=3\n"}
    assert release.release_id == hashlib.sha256(data).hexdigest() and release.key_id == KEY.key_id.hex()
    assert build_release("app", "1.2.0", _files(tmp_path), KEY, created_ms=1) == data  # the same bytes: the same id


RELEASE = build_release("app", "1.2.0", [Path(__file__)], KEY, created_ms=7, max_document_bytes=1 << 20)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(RELEASE) - 1), st.integers(1, 255))
def test_any_changed_byte_is_refused(at: int, flip: int) -> None:
    changed = bytearray(RELEASE)
    changed[at] ^= flip
    with pytest.raises(ConfigReleaseError):
        parse_release(bytes(changed), KEY.public, max_document_bytes=1 << 20)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(RELEASE) - 1))
def test_a_cut_release_is_refused(length: int) -> None:
    with pytest.raises(MalformedRelease):
        parse_release(RELEASE[:length], KEY.public, max_document_bytes=1 << 20)


def test_what_is_refused_says_why(tmp_path: Path) -> None:
    files = _files(tmp_path)
    data = build_release("app", "1.2.0", files, KEY, created_ms=1)
    with pytest.raises(ReleaseSignature, match="not the fleet's key"):
        parse_release(data, OTHER.public, source="app.eacfg")
    with pytest.raises(MalformedRelease, match="bytes after the last document"):
        parse_release(data + b"x", KEY.public)
    with pytest.raises(MalformedRelease, match="document app.toml: 21 bytes, over the cap of 16"):
        parse_release(data, KEY.public, max_document_bytes=16)  # a device with a smaller cap
    big = tmp_path / "big.conf"
    big.write_bytes(b"x" * (64 * 1024 + 1))
    with pytest.raises(ConfigReleaseError, match=r"big.conf: 65537 bytes, over the cap of 65536 per document"):
        build_release("app", "1.2.0", [big], KEY, created_ms=1)
    with pytest.raises(ConfigReleaseError, match="invalid version '1.2'"):
        build_release("app", "1.2", files, KEY, created_ms=1)
    with pytest.raises(ConfigReleaseError, match="the name is 1-64"):
        build_release("App/../x", "1.2.0", files, KEY, created_ms=1)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "app.toml").write_text("b")
    with pytest.raises(ConfigReleaseError, match=r"two files share a name \(app.toml\)"):
        build_release("app", "1.2.0", [files[0], tmp_path / "sub" / "app.toml"], KEY, created_ms=1)
    with pytest.raises(ConfigReleaseError, match="missing.conf: No such file"):
        build_release("app", "1.2.0", [tmp_path / "missing.conf"], KEY, created_ms=1)
    out = write_release(data, tmp_path / "app.eacfg")
    with pytest.raises(ConfigReleaseError, match="exists already"):
        write_release(data, out)
    huge = tmp_path / "huge.eacfg"
    with huge.open("wb") as f:
        f.truncate(8 * 1024 * 1024)
    with pytest.raises(MalformedRelease, match="more than a release can hold"):
        read_release(huge, KEY.public)  # refused unread


def test_build_and_show_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_engine.keys import generate_keypair

    keys = generate_keypair(tmp_path / "keys")
    files = [str(f) for f in _files(tmp_path)]
    out = tmp_path / "app-1.2.0.eacfg"
    assert cli(["config", "release", "build", "app", *files, "--version", "1.2.0", "--key", str(keys.private),
                "--out", str(out)]) == 0
    assert f"wrote {out}: config release app 1.2.0, 2 documents" in capsys.readouterr().out
    assert cli(["config", "release", "show", str(out), "--key", str(keys.public), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["name"] == "app" and [d["name"] for d in shown["documents"]] == ["app.toml", "limits.conf"]
    assert cli(["config", "release", "build", "app", *files, "--version", "1.3", "--key", str(keys.private),
                "--out", str(tmp_path / "x.eacfg")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid version '1.3'" in err
    other = generate_keypair(tmp_path / "other")
    assert cli(["config", "release", "show", str(out), "--key", str(other.public)]) == 2
    assert "not the fleet's key" in capsys.readouterr().err
