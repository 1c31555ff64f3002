"""A session's flow control, one direction at a time.

    Sender      `await send(data)`: cut into Data frames of `FRAME_DATA_MAX`, each sent once the
                bytes in flight (sent, not acknowledged) leave room for it within `WINDOW_BYTES`
    Receiver    `take(frame)`: checks the frame's seq (a gap is a lost frame: `FlowError`) and
                that the sender kept to the window; `delivered(n)` once n bytes reached their
                sink (the process's stdin, the socket) returns the Ack to send, every quarter window
    RelayWindow what a relay passes on in one direction: `pass_on(frame)` refuses a sender past the
                window, `ack(frame)` an acknowledgement of bytes it was never sent (`FlowError`)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

from agent.remote.frames import FRAME_DATA_MAX, WINDOW_BYTES, Ack, Data


class FlowError(Exception):
    """The other side broke the session's rules (a lost or repeated frame, more than the window)."""


class Sender:
    def __init__(self, sid: str, send: Callable[[Data], Awaitable[None]]) -> None:
        self.sid = sid
        self._send = send
        self.seq = 0
        self.sent = 0  # bytes of data sent
        self.acked = 0  # ... of which the other side delivered
        self._room = asyncio.Event()
        self._room.set()
        self.closed = False

    def ack(self, frame: Ack) -> None:
        if frame.upto > self.sent:
            raise FlowError(f"an acknowledgement of {frame.upto} bytes when {self.sent} were sent")
        self.acked = max(self.acked, frame.upto)
        self._room.set()

    def close(self) -> None:
        """Stop waiting for room (the session is over)."""
        self.closed = True
        self._room.set()

    async def send(self, data: bytes, stream: Literal[0, 1, 2] = 0) -> None:
        for start in range(0, len(data), FRAME_DATA_MAX):
            chunk = data[start:start + FRAME_DATA_MAX]
            while self.sent - self.acked + len(chunk) > WINDOW_BYTES:
                self._room.clear()
                if self.closed:
                    return
                await self._room.wait()
            if self.closed:
                return
            self.seq += 1
            self.sent += len(chunk)
            await self._send(Data(sid=self.sid, seq=self.seq, stream=stream, data=chunk))


class Receiver:
    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.seq = 0
        self.received = 0  # bytes of data taken
        self.delivered_bytes = 0  # ... delivered to the sink
        self._acked = 0

    def take(self, frame: Data) -> None:
        if frame.seq != self.seq + 1:
            raise FlowError(f"frame {frame.seq} after frame {self.seq}: a frame was lost")
        self.seq = frame.seq
        self.received += len(frame.data)
        if self.received - self.delivered_bytes > WINDOW_BYTES:
            raise FlowError(f"{self.received - self.delivered_bytes} bytes in flight: more than the window of"
                            f" {WINDOW_BYTES}")

    def delivered(self, n: int) -> Ack | None:
        """Record n bytes delivered; the Ack to send when a quarter window has gone since the last."""
        self.delivered_bytes += n
        if self.delivered_bytes - self._acked >= WINDOW_BYTES // 4:
            self._acked = self.delivered_bytes
            return Ack(sid=self.sid, upto=self.delivered_bytes)
        return None


class RelayWindow:
    """One direction of a session a relay passes on (the leader, between the operator and the
    device): the data bytes passed and what the far end acknowledged. A sender that keeps the
    window never has more than it (and the frame under way) unacknowledged."""

    def __init__(self) -> None:
        self.passed = 0
        self.acked = 0

    def pass_on(self, frame: Data) -> None:
        self.passed += len(frame.data)
        if self.passed - self.acked > WINDOW_BYTES + FRAME_DATA_MAX:
            raise FlowError("sent more than the window")

    def ack(self, frame: Ack) -> None:
        if frame.upto > self.passed:
            raise FlowError("acknowledged bytes it was never sent")
        self.acked = max(self.acked, frame.upto)


__all__ = ["FlowError", "Receiver", "RelayWindow", "Sender"]
