"""`release.toml` -> a signed release document (`edge-agent release build`).

A release is a folder: `release.toml`, the file of each part (a firmware `.eafw`, config
releases `.eacfg`, application bundles `.eaapp`, each built and signed by its own command), and
the document built from them, which names each part by its file and its sha256:

    name = "gateway"                       # the release line
    version = "2.0.0"
    firmware = "gateway-1.1.0.eafw"        # optional: at most one
    config = ["app-1.1.0.eacfg"]           # configuration targets' releases
    apps = ["hello-2.0.0.eaapp"]           # application bundles (or their signed removals)
    order = [["firmware"], ["config:app"], ["app:hello"]]   # optional: this is the default

Each part's name and version are read from its own file (`describe`, the kind's), so the document
cannot say a version its part does not carry.
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent.core.errors import ConfigError, EdgeAgentError
from release_rollout.document import Part, PartKind, build_document
from rollout_engine.keys import SigningKey
from rollout_engine.kinds import Described

KEYS = {"name", "version", "firmware", "config", "apps", "order"}
Describe = Callable[[Path], Described]


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_from_toml(path: Path, key: SigningKey, describe: Mapping[PartKind, Describe], *,
                    created_ms: int) -> bytes:
    """The signed document `path` describes; a `ConfigError` naming the file and the key, or a
    `ReleaseError`, says why not."""
    source = str(path)
    try:
        spec: dict[str, Any] = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, None, f"cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, None, f"not TOML: {exc}") from None
    unknown = sorted(set(spec) - KEYS)
    if unknown:
        raise ConfigError(source, unknown[0], f"not a key of a release (the keys: {', '.join(sorted(KEYS))})")
    for k in ("name", "version"):
        if not isinstance(spec.get(k), str):
            raise ConfigError(source, k, "missing, or not a string")
    files: list[tuple[PartKind, str, str]] = []  # (kind, the key, the file)
    firmware = spec.get("firmware")
    if firmware is not None:
        if not isinstance(firmware, str):
            raise ConfigError(source, "firmware", "one file name (a release has at most one firmware)")
        files.append(("firmware", "firmware", firmware))
    for k, kind in (("config", "config"), ("apps", "app")):
        listed = spec.get(k, [])
        if not isinstance(listed, list) or not all(isinstance(f, str) for f in listed):
            raise ConfigError(source, k, "a list of file names")
        files += [(kind, f"{k}[{i}]", f) for i, f in enumerate(listed)]  # type: ignore[misc]
    if not files:
        raise ConfigError(source, "firmware", "a release names at least one part (firmware, config or apps)")
    order = spec.get("order")
    if order is not None and (not isinstance(order, list)
                              or not all(isinstance(s, list) and all(isinstance(i, str) for i in s) for s in order)):
        raise ConfigError(source, "order",
                          'stages, each a list of parts: [["firmware"], ["config:app"], ["app:hello"]]')
    parts = []
    for kind, where, name in files:
        if Path(name).name != name or name in ("", ".", ".."):
            raise ConfigError(source, where, f"{name!r}: a file name beside release.toml, not a path")
        file = path.parent / name
        try:
            described = describe[kind](file)
            size, digest = file.stat().st_size, file_digest(file)
        except OSError as exc:
            raise ConfigError(source, where, f"{file}: {exc.strerror or exc}") from None
        except EdgeAgentError as exc:
            raise ConfigError(source, where, str(exc)) from None
        parts.append(Part(kind=kind, name=described.name, version=described.version, file=name, sha256=digest,
                          size=size))
    return build_document(spec["name"], spec["version"], parts, key, created_ms=created_ms, order=order,
                          source=source)


__all__ = ["build_from_toml", "file_digest"]
