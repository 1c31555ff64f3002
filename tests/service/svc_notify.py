"""The systemd side of the notify protocol, for the service tests."""

from __future__ import annotations

import socket


class NotifyListener:
    """The systemd side of the notify protocol: a bound AF_UNIX datagram socket."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address  # what goes into $NOTIFY_SOCKET

    @property
    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.address}

    def drain(self) -> list[str]:
        """Every datagram queued now, without waiting."""
        out = []
        while True:
            try:
                data = self.sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return out
            out.append(data.decode())

    def receive(self, timeout_s: float = 30.0) -> str:
        """The next datagram; a generous timeout only guards against a hang."""
        self.sock.settimeout(timeout_s)
        try:
            return self.sock.recv(4096).decode()
        finally:
            self.sock.settimeout(None)

    def wait_for(self, line: str, timeout_s: float = 30.0) -> list[str]:
        """Datagrams up to and including the first that contains `line`."""
        seen = []
        while True:
            message = self.receive(timeout_s)
            seen.append(message)
            if line in message.split("\n"):
                return seen
