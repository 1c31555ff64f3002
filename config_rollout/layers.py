"""The leader's layers over a config release, rendered into one device's documents.

A release is the fleet default and the schema at once: its TOML and JSON documents name every
key a layer may set. A layer value (a group's by tag, or one device's override) sets one key of
one document, and only a key the release defines as a value (not a table), with a value of the
same type (an integer may stand for a float). The device renders its documents itself from the
signed release and the values the leader sends, and refuses a value that breaks these rules: a
leader can choose among values of the keys the signed release exposes, never add a key or a
document, nor change a document that is not TOML or JSON.

Values are applied in the order given (the leader sends groups in their stated order, then the
device's own overrides), the last for a key winning. A document no value touches keeps its
bytes exactly; one that a value touches is written again from its parsed form (TOML comments
are not kept). `digest` names the values a device applied, so the leader sees from a heartbeat
whether a device holds what the layers say now (else: "pending").
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from config_rollout.errors import ConfigReleaseError

MAX_VALUES = 256  # layer values in one offer
MAX_VALUE_BYTES = 4096  # one value, as JSON
KEY_PATTERN = r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){0,7}$"  # a dotted path, tables to the key
LAYERED_SUFFIXES = (".toml", ".json")


class LayerValue(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """One key of one document set by a layer: `value` is JSON text; `source` says which layer
    (for the reports and `config diff`)."""

    document: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
    key: Annotated[str, msgspec.Meta(pattern=KEY_PATTERN)]
    value: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_VALUE_BYTES)]
    source: Annotated[str, msgspec.Meta(max_length=160)] = ""


@dataclass(frozen=True)
class Rendered:
    documents: dict[str, bytes]  # each of the release's documents, layers applied
    sources: dict[str, dict[str, str]]  # document -> key -> the layer whose value won
    digest: str  # of the values applied ("" when none)


def digest(values: Sequence[LayerValue]) -> str:
    """Names what the values make of a release: the winning value of each key (sources aside)."""
    if not values:
        return ""
    winners = {(v.document, v.key): v.value for v in values}
    canonical = json.dumps(sorted([d, k, json.loads(v)] for (d, k), v in winners.items()), sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def parse_value(text: str, where: str) -> Any:
    """A layer value given as JSON or TOML's spelling of a value (`8080`, `"debug"`, `true`,
    `[1, 2]`); a bare word is a string. A `ConfigReleaseError` names `where`."""
    try:
        value = json.loads(text)
    except ValueError:
        import tomllib

        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigReleaseError(f"{where}: {text!r} is not a finite number")
    if isinstance(value, dict):
        raise ConfigReleaseError(f"{where}: a layer sets one value, not a table: set its keys one by one")
    if len(json.dumps(value)) > MAX_VALUE_BYTES:
        raise ConfigReleaseError(f"{where}: over {MAX_VALUE_BYTES} bytes")
    return value


def render(documents: dict[str, bytes], values: Sequence[LayerValue]) -> Rendered:
    """The release's documents with `values` applied; a `ConfigReleaseError` names the first
    value this release does not take (and nothing is rendered)."""
    if len(values) > MAX_VALUES:
        raise ConfigReleaseError(f"{len(values)} layer values: at most {MAX_VALUES}")
    parsed: dict[str, dict[str, Any]] = {}
    sources: dict[str, dict[str, str]] = {}
    for v in values:
        where = f"layer value {v.document}:{v.key}" + (f" ({v.source})" if v.source else "")
        if v.document not in documents:
            raise ConfigReleaseError(f"{where}: the release has no document {v.document}")
        if not v.document.endswith(LAYERED_SUFFIXES):
            raise ConfigReleaseError(f"{where}: only a TOML or JSON document takes layer values")
        if v.document not in parsed:
            parsed[v.document] = _load(v.document, documents[v.document])
        try:
            value = json.loads(v.value)
        except ValueError:
            raise ConfigReleaseError(f"{where}: the value is not JSON") from None
        _set(parsed[v.document], v.key, value, where)
        sources.setdefault(v.document, {})[v.key] = v.source
    rendered = dict(documents)
    for name, tree in parsed.items():
        rendered[name] = _dump(name, tree)
    return Rendered(rendered, sources, digest(values))


def _load(name: str, data: bytes) -> dict[str, Any]:
    try:
        if name.endswith(".json"):
            tree = json.loads(data)
        else:
            import tomllib

            tree = tomllib.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigReleaseError(f"document {name} of the release does not parse, so it takes no layer value: "
                                 f"{exc}") from None
    if not isinstance(tree, dict):
        raise ConfigReleaseError(f"document {name} of the release is not an object: it takes no layer value")
    return tree


def _set(tree: dict[str, Any], key: str, value: Any, where: str) -> None:
    *tables, leaf = key.split(".")
    node: Any = tree
    for part in tables:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise ConfigReleaseError(f"{where}: the release's document has no table {part!r} on this path")
    if not isinstance(node, dict) or leaf not in node:
        raise ConfigReleaseError(f"{where}: the release's document defines no key {key}: a layer may set only a "
                                 "key the release defines")
    current = node[leaf]
    if isinstance(current, dict):
        raise ConfigReleaseError(f"{where}: {key} is a table in the release: set its keys one by one")
    if not _same_type(current, value):
        raise ConfigReleaseError(f"{where}: {key} is {_type_name(current)} in the release, the value is "
                                 f"{_type_name(value)}")
    node[leaf] = float(value) if isinstance(current, float) else value


def _same_type(current: Any, value: Any) -> bool:
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, float):
        return isinstance(value, int | float)
    return type(current) is type(value) or (isinstance(current, list) and isinstance(value, list))


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array"}.get(
        type(value), f"a {type(value).__name__}")


def _dump(name: str, tree: dict[str, Any]) -> bytes:
    if name.endswith(".json"):
        return (json.dumps(tree, indent=2, ensure_ascii=False) + "\n").encode()
    import tomli_w

    return tomli_w.dumps(tree).encode()


__all__ = ["KEY_PATTERN", "MAX_VALUES", "LayerValue", "Rendered", "digest", "parse_value", "render"]
