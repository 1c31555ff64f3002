"""The messages the leader refused, as `edge-agent rejects` and the console show them: the reads
are the reject log's (`RejectReads`); this is how a person sees a payload's first bytes."""

from __future__ import annotations

import string

from agent.leader.rejects import Reject, RejectCount

RejectRow = Reject  # one refused message, as RejectLog keeps it

_PRINTABLE = frozenset(string.printable.encode()) - frozenset(b"\t\n\r\x0b\x0c")


def printable(head: bytes, width: int) -> str:
    """The first `width` bytes of a refused payload as text, `.` for what does not print (the
    first bytes of junk from a hostile device must not drive a terminal)."""
    return "".join(chr(b) if b in _PRINTABLE else "." for b in head[:width])


__all__ = ["RejectCount", "RejectRow", "printable"]
