from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firmware_rollout.errors import InvalidVersion
from rollout_engine.version import Version

ORDERED = [
    "1.0.0-alpha",
    "1.0.0-alpha.1",
    "1.0.0-alpha.beta",
    "1.0.0-beta",
    "1.0.0-beta.2",
    "1.0.0-beta.11",
    "1.0.0-rc.1",
    "1.0.0",
    "1.0.1",
    "1.2.0",
    "1.10.0",
    "2.0.0",
]


def test_precedence_follows_semver() -> None:
    parsed = [Version.parse(v) for v in ORDERED]
    for low, high in zip(parsed, parsed[1:], strict=False):
        assert low < high and high > low and low != high


def test_build_metadata_is_ignored_for_precedence_but_kept() -> None:
    assert Version.parse("1.0.0+a") == Version.parse("1.0.0+b")
    assert str(Version.parse("1.2.3-rc.1+build.7")) == "1.2.3-rc.1+build.7"


@pytest.mark.parametrize(
    "text",
    [
        "1.0",
        "1",
        "01.0.0",
        "1.01.0",
        "1.0.0-",
        "1.0.0-01",
        "v1.0.0",
        "1.0.0+",
        "",
        "1.0.0\n",
        " 1.0.0",
        "1.0.0-a..b",
        "1.0.0-é",
    ],
)
def test_rejects_what_is_not_strict_semver(text: str) -> None:
    with pytest.raises(InvalidVersion, match="invalid version"):
        Version.parse(text)


@settings(deadline=None, max_examples=100)
@given(
    st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50)),
)
def test_release_order_matches_tuple_order(a: tuple[int, int, int], b: tuple[int, int, int]) -> None:
    va, vb = Version.parse(".".join(map(str, a))), Version.parse(".".join(map(str, b)))
    assert (va < vb) == (a < b) and (va == vb) == (a == b)
