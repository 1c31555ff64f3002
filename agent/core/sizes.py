"""Byte counts as the product prints them: in the unit that keeps them readable (`format_bytes`:
`0 B`, `812 B`, `3.2 KiB`, `15.3 MiB`, `1.20 GiB`), so a small delta never shows as `0.0`."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """`n` bytes for a person: bytes below 1 KiB, then KiB, MiB with one decimal, GiB with two."""
    value = max(0.0, float(n))
    if value < 1024:
        return f"{int(value)} B"
    if value < 1024**2:
        return f"{value / 1024:.1f} KiB"
    if value < 1024**3:
        return f"{value / 1024**2:.1f} MiB"
    return f"{value / 1024**3:.2f} GiB"


__all__ = ["format_bytes"]
