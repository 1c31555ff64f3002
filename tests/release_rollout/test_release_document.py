"""The release document: signed over every field, bounded, its order checked; built from a
release folder's `release.toml` with each part's name and version read from its own file, and
checked again by `edge-agent release verify`. Every refusal is one line naming the file and the
key or the part."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from apps_support import app_dir, fleet_key

from agent.core.errors import ConfigError
from agent.leader.rollout_kinds import ROLLOUT_KINDS
from app_rollout.bundle import build_bundle
from config_rollout.release import build_release
from firmware_rollout.artifact.fixture import make_artifact
from release_rollout.build import build_from_toml, file_digest
from release_rollout.document import (
    MAGIC,
    PARTS_MAX,
    Part,
    build_document,
    parse_release,
    peek_release,
)
from release_rollout.errors import MalformedRelease, ReleaseSignature
from rollout_engine.keys import SigningKey

ROOT = Path(__file__).resolve().parents[2]
DESCRIBE = {kind: ROLLOUT_KINDS[kind].traits.describe for kind in ("firmware", "config", "app")}


def part(kind: str, name: str, version: str = "1.0.0") -> Part:
    return Part(kind=kind, name=name, version=version, file=f"{name}.bin", sha256="0" * 64, size=1)  # type: ignore[arg-type]


def test_a_signed_document_verifies_and_any_changed_byte_is_refused() -> None:
    key = SigningKey.generate()
    parts = [part("firmware", "fw"), part("config", "app"), part("app", "hello")]
    data = build_document("gateway", "2.0.0", parts, key, created_ms=5)
    signed = parse_release(data, key.public)
    assert signed.document.order == (("firmware",), ("config:app",), ("app:hello",))  # the default order
    assert signed.document.says() == "firmware 1.0.0, config app 1.0.0, app hello 1.0.0"
    assert peek_release(data).version == "2.0.0"
    body = bytearray(data)
    body[body.index(b"hello")] = ord("j")
    with pytest.raises(ReleaseSignature, match="does not verify"):
        parse_release(bytes(body), key.public)
    with pytest.raises(ReleaseSignature, match="not the fleet's key"):
        parse_release(data, SigningKey.generate().public)
    with pytest.raises(MalformedRelease, match="bad magic"):
        parse_release(b"EACFG\x01" + data[len(MAGIC):], key.public)
    with pytest.raises(MalformedRelease, match="bytes, a document of"):
        parse_release(data + b"x", key.public)


@pytest.mark.parametrize(("parts", "order", "says"), [
    ([part("firmware", "fw"), part("app", "hello")], [["app:hello"], ["firmware"]],
     "the firmware goes alone in the first stage"),
    ([part("firmware", "fw"), part("app", "hello")], [["firmware", "app:hello"]], "alone in the first stage"),
    ([part("app", "hello")], [["app:hello"], ["app:web"]], "app:web is no part of the release"),
    ([part("app", "hello"), part("app", "web")], [["app:hello"]], r"each part once \(app:web missing\)"),
    ([part("app", "hello"), part("app", "hello", "2.0.0")], None, "app:hello named twice"),
    ([part("app", "hello", "one")], None, "version"),
    ([part("app", "hello")] * (PARTS_MAX + 1), None, r"length <= 32 - at `\$.parts`"),
])
def test_a_document_that_does_not_fit_is_refused_naming_why(parts: list[Part], order: list[list[str]] | None,
                                                            says: str) -> None:
    with pytest.raises(MalformedRelease, match=says):
        build_document("gateway", "2.0.0", parts, SigningKey.generate(), created_ms=0, order=order,
                       source="release.toml")


def test_a_hostile_document_signed_by_the_fleet_is_still_bounded() -> None:
    """Fields no builder writes are refused by the reader (a path as a file name, a part kind it
    does not know), even under a good signature."""
    key = SigningKey.generate()
    good = msgspec.json.decode(peek_release_bytes(build_document("g", "1.0.0", [part("app", "hello")], key,
                                                                 created_ms=0)))
    for field, value, says in (("file", "../../etc/shadow", "file"), ("kind", "shell", "kind")):
        doc = {**good, "parts": [{**good["parts"][0], field: value}]}
        body = msgspec.json.encode(doc)
        data = MAGIC + len(body).to_bytes(4, "big") + body + key.key_id + key.sign(MAGIC + body)
        with pytest.raises(MalformedRelease, match=says):
            parse_release(data, key.public)


def peek_release_bytes(data: bytes) -> bytes:
    length = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "big")
    return data[len(MAGIC) + 4:len(MAGIC) + 4 + length]


def release_folder(tmp_path: Path) -> tuple[Path, SigningKey, Path, Path]:
    """A release folder with a firmware, a config release and a bundle; (release.toml, the key,
    its private and public PEM)."""
    key, private, public = fleet_key(tmp_path / "keys")
    folder = tmp_path / "r2"
    folder.mkdir()
    (tmp_path / "fw" / "keys").mkdir(parents=True)
    (tmp_path / "fw" / "keys" / "private.pem").write_bytes(private.read_bytes())
    fw, _ = make_artifact(tmp_path / "fw", version="1.1.0")
    fw.replace(folder / fw.name)
    (tmp_path / "app.toml").write_text("mode = 'tuned'\n")
    (folder / "app-1.1.0.eacfg").write_bytes(build_release("app", "1.1.0", [tmp_path / "app.toml"], key,
                                                           created_ms=0))
    build_bundle(app_dir(tmp_path / "hello", version="2.0.0"), key, folder / "hello-2.0.0.eaapp")
    spec = folder / "release.toml"
    spec.write_text('name = "gateway"\nversion = "2.0.0"\nfirmware = "fw-1.1.0.eafw"\n'
                    'config = ["app-1.1.0.eacfg"]\napps = ["hello-2.0.0.eaapp"]\n')
    return spec, key, private, public


def test_a_release_folder_builds_a_document_naming_each_part_as_its_file_says(tmp_path: Path) -> None:
    spec, key, _, _ = release_folder(tmp_path)
    signed = parse_release(build_from_toml(spec, key, DESCRIBE, created_ms=0), key.public)
    got = {p.id: (p.name, p.version, p.file, p.sha256) for p in signed.document.parts}
    folder = spec.parent
    assert got == {
        "firmware": ("fw", "1.1.0", "fw-1.1.0.eafw", file_digest(folder / "fw-1.1.0.eafw")),
        "config:app": ("app", "1.1.0", "app-1.1.0.eacfg", file_digest(folder / "app-1.1.0.eacfg")),
        "app:hello": ("hello", "2.0.0", "hello-2.0.0.eaapp", file_digest(folder / "hello-2.0.0.eaapp")),
    }


@pytest.mark.parametrize(("text", "says"), [
    ('name = "g"\nversion = "1.0.0"\nscript = "x"\n', "release.toml: script: not a key of a release"),
    ('name = "g"\nversion = "1.0.0"\napps = ["../hello.eaapp"]\n', r"apps\[0\]: '../hello.eaapp': a file name"),
    ('name = "g"\nversion = "1.0.0"\napps = ["nothing.eaapp"]\n', r"apps\[0\]: .*nothing.eaapp"),
    ('name = "g"\nversion = "1.0.0"\nfirmware = "app-1.1.0.eacfg"\n', "firmware: artifact .*bad magic"),
    ('name = "g"\nversion = "1.0.0"\n', "firmware: a release names at least one part"),
    ('version = "1.0.0"\nconfig = ["app-1.1.0.eacfg"]\n', "name: missing"),
    ('name = "g"\nversion = "1.0.0"\nconfig = "app-1.1.0.eacfg"\n', "config: a list of file names"),
    ('name = "g"\nversion = "1.0.0"\nconfig = ["app-1.1.0.eacfg"]\norder = "config"\n', "order: stages"),
    ('name = "g" version', "not TOML"),
])
def test_a_release_toml_mistake_is_one_line_naming_the_key(tmp_path: Path, text: str, says: str) -> None:
    spec, key, _, _ = release_folder(tmp_path)
    spec.write_text(text)
    with pytest.raises(ConfigError, match=says):
        build_from_toml(spec, key, DESCRIBE, created_ms=0)


def test_the_release_commands_build_and_verify_a_folder(tmp_path: Path) -> None:
    spec, _, private, public = release_folder(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cli = [sys.executable, "-m", "agent.cli", "release"]
    built = subprocess.run([*cli, "build", str(spec), "--key", str(private)], capture_output=True, text=True,
                           env=env, timeout=60)
    assert built.returncode == 0, built.stderr
    assert "release gateway 2.0.0: firmware 1.1.0, config app 1.1.0, app hello 2.0.0; converges firmware then" \
           " config:app then app:hello" in built.stdout
    document = spec.parent / "gateway-2.0.0.earel"
    ok = subprocess.run([*cli, "verify", str(document), "--key", str(public)], capture_output=True, text=True,
                        env=env, timeout=60)
    assert ok.returncode == 0 and "every part beside it matches" in ok.stdout, ok.stderr
    again = subprocess.run([*cli, "build", str(spec), "--key", str(private)], capture_output=True, text=True,
                           env=env, timeout=60)
    assert again.returncode == 2 and "exists already" in again.stderr and "Traceback" not in again.stderr
    (spec.parent / "app-1.1.0.eacfg").write_bytes((spec.parent / "app-1.1.0.eacfg").read_bytes() + b" ")
    changed = subprocess.run([*cli, "verify", str(document), "--key", str(public)], capture_output=True, text=True,
                             env=env, timeout=60)
    assert changed.returncode == 2 and "part config:app" in changed.stderr and "sha256 differs" in changed.stderr
    assert len(changed.stderr.strip().splitlines()) == 1
