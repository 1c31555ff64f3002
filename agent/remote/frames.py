"""The frames of a remote session: a shell or a forwarded TCP connection on a device, opened by an
operator, with no inbound port on the device.

    operator's CLI ──Unix socket (length-prefixed frames)──► leader ──MQTT (session/down)──► device
                   ◄─────────────────────────────────────────       ◄──(session/up/{leader})──

The CLI talks only to its leader, over the leader's operator socket: the kernel says who it is
(SO_PEERCRED), the leader checks that user's right to the operation, records the session and
relays its frames to and from the device. The device takes a session only if its own config turns
that operation on, and answers to the leader that opened it.

Every frame is a msgpack map tagged by `t`, every field bounded. Data flows under a window per
direction (`WINDOW_BYTES` unacknowledged at most, `Ack` says how many bytes the receiver has
delivered in all), so a large copy can neither fill the broker's queues nor the device's memory,
and the device's other traffic goes between its frames.
"""

from __future__ import annotations

import struct
from typing import Annotated, Final, Literal

import msgspec

FRAME_DATA_MAX: Final = 16 * 1024  # bytes of one Data frame
WINDOW_BYTES: Final = 256 * 1024  # unacknowledged bytes one side may have in flight
FRAME_MAX: Final = FRAME_DATA_MAX + 1024  # an encoded frame, Data's overhead included
KEEPALIVE_S: Final = 30.0  # an idle session's ping, each way
GONE_AFTER_S: Final = 95.0  # nothing heard from the other side this long: it is gone

Sid = Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[0-9a-f]{0,32}$")]
Op = Literal["shell", "forward", "logs"]
BundleId = Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[0-9a-f]*$")]
UnitName = Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9:_.@*-]+$")]
Text = Annotated[str, msgspec.Meta(max_length=512)]
Arg = Annotated[str, msgspec.Meta(max_length=4096)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:_-]+$")]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Rows = Annotated[int, msgspec.Meta(ge=0, le=1000)]
DeviceName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
OperatorName = Annotated[str, msgspec.Meta(max_length=128)]


TARGET_MAX = 512  # characters of a shell's command line an audit line keeps


class _Frame(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", forbid_unknown_fields=True):
    pass


class Open(_Frame, tag="open", frozen=True, kw_only=True):
    """Open a session. From the CLI: `device` names it and `sid` is empty; to the device: the
    leader's `sid`, the operator's name and `leader` (where to answer) are filled in."""

    sid: Sid = ""
    device: DeviceName
    op: Op
    argv: Annotated[tuple[Arg, ...], msgspec.Meta(max_length=64)] = ()  # shell: the command (none: a login shell)
    pty: bool = False  # shell: on a terminal (interactive)
    rows: Rows = 0
    cols: Rows = 0
    host: Host = "127.0.0.1"  # forward: where the device connects
    port: Port = 1
    since_s: Annotated[int, msgspec.Meta(ge=60, le=31 * 86_400)] = 3600  # logs: how far back
    units: Annotated[tuple[UnitName, ...], msgspec.Meta(max_length=16)] = ()  # logs: whose journal (none: all)
    bundle: BundleId = ""  # logs: the bundle to go on with (a resumed download), from `offset`
    offset: Count = 0
    operator: OperatorName = ""
    leader: Annotated[str, msgspec.Meta(max_length=128)] = ""

    @property
    def target(self) -> str:
        """What it opens, in a few words (the audit's and the sessions log's `target`)."""
        if self.op == "forward":
            return f"{self.host}:{self.port}"
        if self.op == "logs":
            return (f"since {self.since_s} s, " + (", ".join(self.units) if self.units else "every unit")
                    + (f", bundle {self.bundle} from {self.offset}" if self.bundle else ""))
        return " ".join(self.argv)[:TARGET_MAX] if self.argv else "(login shell)"


class Accepted(_Frame, tag="accepted", frozen=True, kw_only=True):
    sid: Sid
    bundle: BundleId = ""  # logs: the bundle's id (to resume it) and its size, compressed
    size: Count = 0


class Refused(_Frame, tag="refused", frozen=True, kw_only=True):
    sid: Sid
    reason: Text


class Data(_Frame, tag="data", frozen=True, kw_only=True):
    sid: Sid
    seq: Count  # the frame's number in its direction: a gap is a lost frame, the session ends
    stream: Literal[0, 1, 2] = 0  # to the device: 0 (stdin, the socket); from a shell: 1 stdout, 2 stderr
    data: Annotated[bytes, msgspec.Meta(max_length=FRAME_DATA_MAX)]


class Ack(_Frame, tag="ack", frozen=True, kw_only=True):
    sid: Sid
    upto: Count  # bytes of Data the receiver has delivered in all


class Eof(_Frame, tag="eof", frozen=True, kw_only=True):
    """This side sends no more data (stdin closed; the socket's read side ended)."""

    sid: Sid


class Resize(_Frame, tag="resize", frozen=True, kw_only=True):
    sid: Sid
    rows: Rows
    cols: Rows


class Ping(_Frame, tag="ping", frozen=True, kw_only=True):
    sid: Sid


class Exit(_Frame, tag="exit", frozen=True, kw_only=True):
    sid: Sid
    code: Annotated[int, msgspec.Meta(ge=-255, le=255)]


class Close(_Frame, tag="close", frozen=True, kw_only=True):
    """The session is over (either side; the leader's also ends it on the device)."""

    sid: Sid
    reason: Text = ""


class CloseSession(_Frame, tag="close_session", frozen=True, kw_only=True):
    """CLI -> leader: end another session (`edge-agent devices close SID`)."""

    sid: Sid


Frame = Open | Accepted | Refused | Data | Ack | Eof | Resize | Ping | Exit | Close | CloseSession

_decoder = msgspec.msgpack.Decoder(Frame)
_encoder = msgspec.msgpack.Encoder()
_LENGTH = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that is not one: too large, not msgpack, an unknown tag, a field out of bounds."""


def encode(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode(data: bytes) -> Frame:
    if len(data) > FRAME_MAX:
        raise FrameError(f"a frame of {len(data)} bytes (at most {FRAME_MAX})")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(str(exc)) from None


def framed(frame: Frame) -> bytes:
    """`frame` on a stream (the operator socket): its length, then its bytes."""
    body = encode(frame)
    return _LENGTH.pack(len(body)) + body


async def read_framed(reader: object) -> Frame | None:
    """The next frame on a stream (an `asyncio.StreamReader`); None at its end."""
    import asyncio

    assert isinstance(reader, asyncio.StreamReader)
    try:
        head = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > FRAME_MAX:
        raise FrameError(f"a frame of {size} bytes (at most {FRAME_MAX})")
    try:
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None
    return decode(body)


__all__ = ["FRAME_DATA_MAX", "FRAME_MAX", "GONE_AFTER_S", "KEEPALIVE_S", "TARGET_MAX", "WINDOW_BYTES", "Accepted",
           "Ack", "Close", "CloseSession", "Data", "Eof", "Exit", "Frame", "FrameError", "Op", "Open", "Ping",
           "Refused", "Resize", "decode", "encode", "framed", "read_framed"]
