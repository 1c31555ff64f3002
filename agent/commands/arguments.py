"""Argument types and plain-text tables shared by the subcommands."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence


def whole_number(text: str) -> int:
    """A count, a limit, an offset or an id: 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def positive_seconds(text: str) -> float:
    """An interval, a wait or a timeout: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows (the header first) as lines of left-aligned columns two spaces apart, never
    shortened: ids are typed back."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))] if rows else []
    return ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]


__all__ = ["aligned", "positive_seconds", "whole_number"]
