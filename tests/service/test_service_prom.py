"""Prometheus exposition: names, escaping, merging, and that the output parses."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from promparse import parse

from agent.service.prom import (
    Counter,
    Gauge,
    MetricError,
    MetricFamily,
    Sample,
    collect,
    family,
    format_value,
    render,
)


def test_counter_and_gauge_render_with_help_and_type() -> None:
    sent = Counter("ea_sent_total", "Messages sent.", ["topic"])
    sent.inc(topic="up")
    sent.inc(2, topic="up")
    sent.inc(topic="down")
    depth = Gauge("ea_depth", "Queue depth.")
    depth.set(7)
    depth.dec(2)
    text = render([*sent.collect(), *depth.collect()])
    assert text == (
        "# HELP ea_sent_total Messages sent.\n"
        "# TYPE ea_sent_total counter\n"
        'ea_sent_total{topic="down"} 1\n'
        'ea_sent_total{topic="up"} 3\n'
        "# HELP ea_depth Queue depth.\n"
        "# TYPE ea_depth gauge\n"
        "ea_depth 5\n"
    )
    assert sent.get(topic="up") == 3


def test_escaping_of_help_and_label_values() -> None:
    fam = family("ea_x", "gauge", 'back\\slash\nnewline "quoted"',
                 [({"path": 'C:\\dir\n"x"'}, 1.5)])
    text = render([fam])
    assert '# HELP ea_x back\\\\slash\\nnewline "quoted"\n' in text
    assert 'ea_x{path="C:\\\\dir\\n\\"x\\""} 1.5\n' in text
    parsed = parse(text)
    assert parsed["ea_x"]["help"] == 'back\\slash\nnewline "quoted"'
    assert parsed["ea_x"]["samples"] == [({"path": 'C:\\dir\n"x"'}, 1.5)]


@pytest.mark.parametrize(
    ("value", "text"),
    [(3.0, "3"), (0.25, "0.25"), (float("inf"), "+Inf"), (float("-inf"), "-Inf"),
     (float("nan"), "NaN"), (1e300, "1e+300"), (-2.0, "-2")],
)
def test_values(value: float, text: str) -> None:
    assert format_value(value) == text


@pytest.mark.parametrize("name", ["", "1abc", "a-b", "a b", "é"])
def test_invalid_metric_names_are_refused(name: str) -> None:
    with pytest.raises(MetricError):
        Gauge(name, "x")


@pytest.mark.parametrize("label", ["__reserved", "a-b", "1x", ""])
def test_invalid_label_names_are_refused(label: str) -> None:
    with pytest.raises(MetricError):
        Gauge("ok", "x", [label])


def test_counter_cannot_go_down_and_labels_must_match() -> None:
    counter = Counter("ea_c_total", "c", ["a"])
    with pytest.raises(MetricError):
        counter.inc(-1, a="x")
    with pytest.raises(MetricError):
        counter.inc(1)
    with pytest.raises(MetricError):
        counter.inc(1, a="x", b="y")


def test_same_family_from_two_collectors_merges_and_type_clash_is_an_error() -> None:
    a = family("ea_m", "gauge", "m", [({"k": "1"}, 1)])
    b = family("ea_m", "gauge", "m", [({"k": "2"}, 2)])
    parsed = parse(render([a, b]))
    assert parsed["ea_m"]["samples"] == [({"k": "1"}, 1.0), ({"k": "2"}, 2.0)]
    with pytest.raises(MetricError):
        render([a, MetricFamily("ea_m", "counter", "m", [Sample(1.0)])])


def test_empty_render_is_empty() -> None:
    assert render([]) == ""


async def test_collect_accepts_sync_and_async_collectors() -> None:
    async def async_collector():
        return [family("ea_a", "gauge", "a", 1)]

    assert [f.name for f in await collect(lambda: [family("ea_s", "gauge", "s", 1)])] == ["ea_s"]
    assert [f.name for f in await collect(async_collector)] == ["ea_a"]


@settings(deadline=None, max_examples=80)
@given(
    st.dictionaries(
        st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda s: not s.startswith("__")),
        st.text(max_size=20),
        max_size=4,
    ),
    st.floats(allow_nan=False),
)
def test_any_label_values_round_trip_through_the_parser(labels: dict[str, str], value: float) -> None:
    text = render([family("ea_prop", "gauge", "property", [(labels, value)])])
    parsed = parse(text)
    [(got_labels, got_value)] = parsed["ea_prop"]["samples"]
    assert got_labels == labels
    assert got_value == value or (math.isinf(value) and got_value == value)
