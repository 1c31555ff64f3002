"""Who is at the other end of a Unix socket, as the kernel says (SO_PEERCRED): the one reading
of it for the local API, the HTTP layer's per-peer bound and the install helper."""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

_CREDS = struct.Struct("3i")


class PeerCredentials(NamedTuple):
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connecting process of a Unix stream socket; `OSError` when the kernel says none."""
    return PeerCredentials(*_CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)))


__all__ = ["PeerCredentials", "peer_credentials"]
