"""The bounded field types an application bundle's manifest and its container spec share."""

from __future__ import annotations

from typing import Annotated

import msgspec

# a file of the bundle: relative, at most 8 parts of A-Z a-z 0-9 _ . + - (no `..`, no leading dot)
FilePath = Annotated[str, msgspec.Meta(max_length=255, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,63}"
                                                               r"(/[A-Za-z0-9_][A-Za-z0-9_.+-]{0,63}){0,7}$")]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]

__all__ = ["FilePath", "Sha256Hex"]
