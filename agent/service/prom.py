"""Prometheus text exposition (format 0.0.4), without a dependency.

A collector is a callable returning metric families (sync or async), so components export what
they already count (`statistics()`, `stats()`, `metrics()`) at scrape time instead of keeping a
second set of counters. `Counter` and `Gauge` are there for values nothing else keeps.

    # HELP ea_outbox_pending Messages waiting in the outbox.
    # TYPE ea_outbox_pending gauge
    ea_outbox_pending{class="telemetry"} 12
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from agent.core.errors import EdgeAgentError

MetricType = Literal["counter", "gauge", "untyped"]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class MetricError(EdgeAgentError):
    """A metric or label name is invalid, or two families clash."""


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise MetricError(f"invalid metric name {name!r}")
    return name


def check_label(name: str) -> str:
    if not _LABEL.match(name) or name.startswith("__"):
        raise MetricError(f"invalid label name {name!r}")
    return name


Labels = tuple[tuple[str, str], ...]


def labels_of(mapping: Mapping[str, object] | None) -> Labels:
    if not mapping:
        return ()
    return tuple((check_label(str(k)), str(v)) for k, v in mapping.items())


@dataclass(frozen=True, slots=True)
class Sample:
    value: float
    labels: Labels = ()


@dataclass(frozen=True, slots=True)
class MetricFamily:
    name: str
    type: MetricType
    help: str
    samples: Sequence[Sample]

    def __post_init__(self) -> None:
        check_name(self.name)


def family(
    name: str,
    type_: MetricType,
    help_: str,
    samples: Iterable[tuple[Mapping[str, object] | None, float]] | float,
) -> MetricFamily:
    """Build a family from `value` or from `(labels, value)` pairs."""
    if isinstance(samples, int | float):
        return MetricFamily(name, type_, help_, [Sample(float(samples))])
    return MetricFamily(name, type_, help_, [Sample(float(v), labels_of(lb)) for lb, v in samples])


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def render(families: Iterable[MetricFamily]) -> str:
    """The exposition text; families with the same name and type are merged, a name used with
    two types is a `MetricError`."""
    merged: dict[str, MetricFamily] = {}
    for fam in families:
        seen = merged.get(fam.name)
        if seen is None:
            merged[fam.name] = fam
        elif seen.type != fam.type:
            raise MetricError(f"metric {fam.name!r} exported as {seen.type} and {fam.type}")
        else:
            merged[fam.name] = MetricFamily(
                fam.name, fam.type, seen.help, [*seen.samples, *fam.samples]
            )
    lines: list[str] = []
    for fam in merged.values():
        lines.append(f"# HELP {fam.name} {escape_help(fam.help)}")
        lines.append(f"# TYPE {fam.name} {fam.type}")
        for sample in fam.samples:
            if sample.labels:
                inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in sample.labels)
                lines.append(f"{fam.name}{{{inner}}} {format_value(sample.value)}")
            else:
                lines.append(f"{fam.name} {format_value(sample.value)}")
    return "\n".join(lines) + "\n" if lines else ""


class _Metric:
    type: MetricType = "untyped"

    def __init__(self, name: str, help_: str, labelnames: Sequence[str] = ()) -> None:
        self.name = check_name(name)
        self.help = help_
        self.labelnames = tuple(check_label(n) for n in labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        if not self.labelnames:
            self._values[()] = 0.0

    def _key(self, labels: Mapping[str, object]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise MetricError(f"{self.name}: labels must be exactly {list(self.labelnames)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def get(self, **labels: object) -> float:
        return self._values.get(self._key(labels), 0.0)

    def collect(self) -> list[MetricFamily]:
        samples = [
            Sample(v, tuple(zip(self.labelnames, key, strict=True)))
            for key, v in sorted(self._values.items())
        ]
        return [MetricFamily(self.name, self.type, self.help, samples)]


class Counter(_Metric):
    """Only goes up. Name it `..._total`."""

    type: MetricType = "counter"

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if amount < 0:
            raise MetricError(f"{self.name}: a counter cannot go down")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Metric):
    type: MetricType = "gauge"

    def set(self, value: float, **labels: object) -> None:
        self._values[self._key(labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: object) -> None:
        self.inc(-amount, **labels)


Collected = Iterable[MetricFamily]
Collector = Callable[[], Collected | Awaitable[Collected]]


async def collect(collector: Collector) -> list[MetricFamily]:
    """Run one collector, sync or async."""
    result = collector()
    if inspect.isawaitable(result):
        result = await result
    return list(result)


__all__ = [
    "CONTENT_TYPE",
    "Collector",
    "Counter",
    "Gauge",
    "MetricError",
    "MetricFamily",
    "MetricType",
    "Sample",
    "collect",
    "escape_help",
    "escape_label_value",
    "family",
    "format_value",
    "labels_of",
    "render",
]
