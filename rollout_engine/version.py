"""Strict semantic versions (semver.org 2.0.0): `MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD]`.

Precedence follows the spec: numeric fields compare as numbers, a pre-release sorts before its
release (`1.0.0-rc.1 < 1.0.0`), pre-release identifiers compare numerically when both are
numeric, numeric before alphanumeric, and a shorter list of equal identifiers first. Build
metadata is kept but ignored for precedence, so `1.0.0+a == 1.0.0+b`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import total_ordering

from rollout_engine.errors import InvalidVersion

_NUM = r"0|[1-9][0-9]*"
_PRE_ID = r"0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*"
_BUILD_ID = r"[0-9A-Za-z-]+"
_PATTERN = re.compile(  # used with fullmatch: no trailing newline slips through
    rf"^(?P<major>{_NUM})\.(?P<minor>{_NUM})\.(?P<patch>{_NUM})"
    rf"(?:-(?P<pre>(?:{_PRE_ID})(?:\.(?:{_PRE_ID}))*))?"
    rf"(?:\+(?P<build>{_BUILD_ID}(?:\.{_BUILD_ID})*))?"
)
_MAX_LENGTH = 128


@total_ordering
class Version:
    """A parsed semantic version; compare with the usual operators."""

    __slots__ = ("major", "minor", "patch", "prerelease", "build")

    def __init__(
        self, major: int, minor: int, patch: int, prerelease: tuple[str, ...] = (), build: tuple[str, ...] = ()
    ) -> None:
        self.major = major
        self.minor = minor
        self.patch = patch
        self.prerelease = prerelease
        self.build = build

    @classmethod
    def parse(cls, text: str) -> Version:
        """Parse `text` or raise `InvalidVersion` naming it."""
        if not isinstance(text, str) or len(text) > _MAX_LENGTH:
            raise InvalidVersion(f"invalid version {text!r}: expected MAJOR.MINOR.PATCH[-pre][+build]")
        match = _PATTERN.fullmatch(text)
        if match is None:
            raise InvalidVersion(f"invalid version {text!r}: expected MAJOR.MINOR.PATCH[-pre][+build]")
        pre = match["pre"]
        build = match["build"]
        return cls(
            int(match["major"]),
            int(match["minor"]),
            int(match["patch"]),
            tuple(pre.split(".")) if pre else (),
            tuple(build.split(".")) if build else (),
        )

    def _key(self) -> tuple[int, int, int, int, tuple[tuple[int, int, str], ...]]:
        # A release (no pre-release) sorts after every pre-release of the same triple.
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease)
        return (self.major, self.minor, self.patch, 0 if self.prerelease else 1, pre)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def __repr__(self) -> str:
        return f"Version({str(self)!r})"


def parse_version(text: str) -> Version:
    """`Version.parse`, as a function."""
    return Version.parse(text)


def ahead_of(offered: str, running: Iterable[str], *, or_equal: bool = False) -> list[str]:
    """Those of the `running` versions above `offered` (or equal to it, with `or_equal`): what a
    device that goes only forward would refuse. A running value that is not a version is left
    out (the device decides itself)."""
    floor = Version.parse(offered)
    ahead = []
    for version in running:
        try:
            parsed = Version.parse(version)
        except InvalidVersion:
            continue
        if parsed > floor or (or_equal and parsed == floor):
            ahead.append(version)
    return ahead


__all__ = ["Version", "ahead_of", "parse_version"]
