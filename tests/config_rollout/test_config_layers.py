"""The leader's layers over a config release: a value sets only a key the release defines, with
its type; the last value for a key wins; a document no value touches keeps its bytes; the
digest names what was applied. The store: groups in their stated order, then the device's own
overrides, which expire."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from config_rollout.errors import ConfigReleaseError
from config_rollout.layer_store import LayerStore
from config_rollout.layers import LayerValue, digest, parse_value, render

APP = b"# the app\nlog_level = \"info\"\nport = 8080\nratio = 0.5\n[limits]\nmax = 10\nnames = [\"a\"]\n"
DOCS = {"app.toml": APP, "extra.json": b'{"debug": false, "n": 1}\n', "notes.txt": b"keep me\n"}


def value(document: str, key: str, v: object, source: str = "") -> LayerValue:
    return LayerValue(document=document, key=key, value=json.dumps(v), source=source)


def test_values_set_keys_the_release_defines_and_the_last_one_wins() -> None:
    out = render(DOCS, [value("app.toml", "log_level", "debug", "tag site-a"), value("app.toml", "limits.max", 20),
                        value("app.toml", "ratio", 1, "tag cold"), value("extra.json", "debug", True),
                        value("app.toml", "log_level", "warning", "device pi-1")])
    app = tomllib.loads(out.documents["app.toml"].decode())
    assert app == {"log_level": "warning", "port": 8080, "ratio": 1.0, "limits": {"max": 20, "names": ["a"]}}
    assert json.loads(out.documents["extra.json"]) == {"debug": True, "n": 1}
    assert out.documents["notes.txt"] == DOCS["notes.txt"]  # untouched: its bytes exactly
    assert out.sources["app.toml"] == {"log_level": "device pi-1", "limits.max": "", "ratio": "tag cold"}
    assert out.digest and render(DOCS, []).documents == DOCS and render(DOCS, []).digest == ""


@pytest.mark.parametrize(("bad", "said"), [
    (value("app.toml", "colour", "red"), "defines no key colour"),
    (value("app.toml", "port", "8080"), "port is an integer in the release, the value is a string"),
    (value("app.toml", "log_level", True), "log_level is a string in the release, the value is a boolean"),
    (value("app.toml", "limits", 3), "limits is a table in the release"),
    (value("app.toml", "nope.max", 3), "no table 'nope'"),
    (value("notes.txt", "x", 1), "only a TOML or JSON document takes layer values"),
    (value("other.toml", "x", 1), "the release has no document other.toml"),
])
def test_a_value_the_release_does_not_take_is_refused_naming_it(bad: LayerValue, said: str) -> None:
    with pytest.raises(ConfigReleaseError, match=said):
        render(DOCS, [value("app.toml", "port", 1), bad])


def test_values_given_on_the_command_line_read_as_toml_or_json() -> None:
    assert [parse_value(t, "x") for t in ("8080", "debug", '"debug"', "true", "[1, 2]", "0.25")] == [
        8080, "debug", "debug", True, [1, 2], 0.25]
    with pytest.raises(ConfigReleaseError, match="not a table"):
        parse_value('{"a": 1}', "x")
    with pytest.raises(ConfigReleaseError, match="not a finite number"):
        parse_value("nan", "x")


@given(st.lists(st.tuples(st.sampled_from(["log_level", "port", "limits.max"]), st.integers(0, 3)), max_size=8))
def test_the_digest_names_the_winning_values_whatever_their_sources(picks: list[tuple[str, int]]) -> None:
    typed = {"log_level": lambda n: f"l{n}", "port": lambda n: n, "limits.max": lambda n: n}
    values = [value("app.toml", k, typed[k](n), source=f"s{i}") for i, (k, n) in enumerate(picks)]
    winners = {v.key: v for v in values}
    assert digest(values) == digest([LayerValue(document=v.document, key=v.key, value=v.value) for v in
                                     winners.values()])
    assert render(DOCS, values).digest == digest(values)


def test_the_store_gives_a_device_its_groups_in_order_then_its_own_overrides(leader_store: Path | str) -> None:
    with LayerStore.open(leader_store) as store:
        store.set_value("app", "tag", "site-a", "app.toml", "log_level", "debug", set_by="op", now_ms=1_000)
        store.set_value("app", "tag", "cold", "app.toml", "log_level", "warning", set_by="op", now_ms=1_000)
        store.set_value("app", "tag", "cold", "app.toml", "port", 9000, set_by="op", now_ms=1_000)
        store.set_value("app", "device", "pi-1", "app.toml", "port", 9001, set_by="op", now_ms=1_000,
                        expires_ms=5_000)
        assert store.group_order("app") == ["site-a", "cold"]  # in the order of their first value
        store.set_value("app", "tag", "site-a", "app.toml", "log_level", "debug", set_by="op", now_ms=1_500)
        assert store.group_order("app") == ["site-a", "cold"]  # a group's next value keeps its place
        got = store.values_for("app", "pi-1", ["site-a", "cold"], now_ms=2_000)
        assert [(v.key, json.loads(v.value), v.source) for v in got] == [
            ("log_level", "warning", "tag cold"), ("port", 9001, "device pi-1 until 1970-01-01T00:00Z")]
        store.order("app", ["cold", "site-a"], by="test", now_ms=1)  # stated again: site-a wins now
        got = store.values_for("app", "pi-1", ["site-a", "cold"], now_ms=6_000)  # the override expired
        assert [(v.key, json.loads(v.value), v.source) for v in got] == [
            ("port", 9000, "tag cold"), ("log_level", "debug", "tag site-a")]
        assert store.values_for("app", "pi-2", [], now_ms=6_000) == ()
        with pytest.raises(Exception, match="name site-a too"):
            store.order("app", ["cold"], by="test", now_ms=1)
        assert store.unset("app", "tag", "site-a", "app.toml", "log_level", by="test", now_ms=1)
        assert store.group_order("app") == ["cold"]  # a group without values leaves the order
        digests = store.reads().digests("app", {"pi-1": ["cold"], "pi-2": []}, now_ms=6_000)
        assert digests["pi-2"] == "" and digests["pi-1"] == digest(store.values_for("app", "pi-1", ["cold"],
                                                                                     now_ms=6_000))
        # devices of the same tags share their groups' digest; one with its own value has its own
        store.set_value("app", "device", "pi-4", "app.toml", "port", 9004, set_by="op", now_ms=6_000)
        fleet = {"pi-3": ["cold"], "pi-4": ["cold"], "pi-5": ["cold"], "pi-6": ["site-a"]}
        digests = store.reads().digests("app", fleet, now_ms=6_000)
        assert digests == {d: digest(store.values_for("app", d, tags, now_ms=6_000)) for d, tags in fleet.items()}
        assert digests["pi-3"] == digests["pi-5"] != digests["pi-4"]
