"""Wire format: msgspec Structs encoded as msgpack.

An `Envelope` carries every message between agents; its `payload` is the msgpack encoding of a
message Struct registered under the envelope's `kind`. A receiver answers each envelope with a
`Reply` naming the message id: `accepted`, `busy(retry_after_ms)` or `rejected(reason)`.

Decoding never raises anything but `CodecError`, whatever the bytes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from agent.core.errors import CodecError

WIRE_VERSION = 1

Conflict = Literal["append", "overwrite"]

#: Every integer on the wire fits SQLite's 64-bit INTEGER: msgpack carries uint64, and one
#: value beyond this would fail the whole transaction that stores it.
INT64_MAX = 2**63 - 1
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]

ReplyStatus = Literal["accepted", "busy", "rejected"]

S = TypeVar("S", bound=msgspec.Struct)


class Envelope(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One message on its way from `sender` to `receiver`. Every field is bounded: a decoder
    refuses an envelope outside these bounds with a `CodecError` naming the field. A field at its
    default is left off the wire (the decoder puts it back): bytes on a metered link are paid for."""

    v: Annotated[int, msgspec.Meta(ge=0, le=255)] = WIRE_VERSION
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    sender: Annotated[str, msgspec.Meta(max_length=128)]
    receiver: Annotated[str, msgspec.Meta(max_length=128)]
    key: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    conflict: Conflict = "append"
    seq: Count = 0
    ts_ms: Count = 0
    ttl_ms: Count | None = None
    payload: bytes = b""


class Reply(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The receiver's answer for one envelope id. `body` carries an `ask` reply's payload."""

    v: int = WIRE_VERSION
    id: str
    status: ReplyStatus
    retry_after_ms: int = 0
    reason: str = ""
    body: bytes = b""


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}


def encode(obj: msgspec.Struct) -> bytes:
    """Encode a Struct as msgpack."""
    return _encoder.encode(obj)


def decode(data: bytes | bytearray | memoryview, type_: type[S]) -> S:
    """Decode msgpack `data` into `type_`, or raise `CodecError` saying what was wrong."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    try:
        obj = decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise CodecError(f"invalid {type_.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise CodecError(f"undecodable {type_.__name__}: {exc}") from exc
    except Exception as exc:  # msgspec raises only the above; belt and braces for odd input
        raise CodecError(f"undecodable {type_.__name__}: {exc!r}") from exc
    version = getattr(obj, "v", WIRE_VERSION)
    if version != WIRE_VERSION:
        raise CodecError(f"unsupported wire version {version} in {type_.__name__}")
    return obj


def decode_envelope(data: bytes | bytearray | memoryview) -> Envelope:
    return decode(data, Envelope)


def decode_reply(data: bytes | bytearray | memoryview) -> Reply:
    return decode(data, Reply)


class MessageRegistry:
    """Maps an envelope `kind` to the Struct its payload decodes into.

    Each layer that defines messages registers them; the receiver decodes the payload of a known
    kind and refuses an unknown one with a `CodecError`.
    """

    def __init__(self) -> None:
        self._types: dict[str, type[msgspec.Struct]] = {}
        self._kinds: dict[type[msgspec.Struct], str] = {}

    def register(self, kind: str, type_: type[msgspec.Struct]) -> None:
        existing = self._types.get(kind)
        if existing is not None and existing is not type_:
            raise ValueError(f"message kind {kind!r} is already registered to {existing.__name__}")
        self._types[kind] = type_
        self._kinds[type_] = kind

    def kind_of(self, message: msgspec.Struct) -> str:
        """The kind `message`'s type is registered as; `KeyError` for another type (a bug)."""
        return self._kinds[type(message)]

    def kinds(self) -> dict[str, type[msgspec.Struct]]:
        return dict(self._types)

    def type_of(self, kind: str) -> type[msgspec.Struct]:
        try:
            return self._types[kind]
        except KeyError:
            raise CodecError(f"unknown message kind {kind!r}") from None

    def decode_payload(self, envelope: Envelope) -> msgspec.Struct:
        return decode(envelope.payload, self.type_of(envelope.kind))


__all__ = [
    "INT64_MAX",
    "WIRE_VERSION",
    "Count",
    "Conflict",
    "Envelope",
    "MessageRegistry",
    "Reply",
    "ReplyStatus",
    "decode",
    "decode_envelope",
    "decode_reply",
    "encode",
]
