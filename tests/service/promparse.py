"""A strict little parser for the Prometheus text format (0.0.4), for the tests."""

from __future__ import annotations

import re

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^(?P<name>{_NAME})(?:\{{(?P<labels>.*)\}})? (?P<value>\S+)$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\[\\"n])*)"\s*(,|$)')


def _unescape(text: str) -> str:
    return re.sub(r"\\([\\\"n])", lambda m: "\n" if m[1] == "n" else m[1], text)


def parse(text: str) -> dict[str, dict]:
    """{family: {"type": t, "help": h, "samples": [(labels dict, value float)]}}.

    Raises AssertionError on any line that is not valid exposition format, a sample before its
    TYPE line, a family declared twice, or a malformed value.
    """
    assert text.endswith("\n"), "exposition must end with a newline"
    families: dict[str, dict] = {}
    current: str | None = None
    for line in text.split("\n")[:-1]:  # only \n ends a line in this format
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert re.fullmatch(_NAME, name), line
            assert name not in families, f"family {name} declared twice"
            families[name] = {"help": _unescape(help_text), "type": None, "samples": []}
            current = name
        elif line.startswith("# TYPE "):
            name, _, type_ = line[7:].partition(" ")
            assert name == current, f"TYPE for {name} not after its HELP"
            assert type_ in ("counter", "gauge", "untyped", "summary", "histogram"), line
            families[name]["type"] = type_
        else:
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name = match["name"]
            assert name == current and families[name]["type"], f"sample out of place: {line!r}"
            labels: dict[str, str] = {}
            raw = match["labels"] or ""
            pos = 0
            while pos < len(raw):
                found = _LABEL.match(raw, pos)
                assert found, f"bad labels in {line!r}"
                assert found[1] not in labels, f"duplicate label in {line!r}"
                labels[found[1]] = _unescape(found[2])
                pos = found.end()
            value = float(match["value"].replace("+Inf", "inf").replace("-Inf", "-inf"))
            families[name]["samples"].append((labels, value))
    return families
