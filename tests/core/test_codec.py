import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.codec import (
    WIRE_VERSION,
    Envelope,
    MessageRegistry,
    Reply,
    decode,
    decode_envelope,
    decode_reply,
    encode,
)
from agent.core.errors import CodecError


def make_envelope(**overrides: object) -> Envelope:
    fields: dict[str, object] = dict(
        id="01HZX3J5Q0000000000000000A",
        kind="heartbeat",
        sender="pi-1",
        receiver="leader",
        key="heartbeat",
        conflict="overwrite",
        seq=7,
        ts_ms=1_700_000_000_123,
        ttl_ms=60_000,
        payload=b"\x81\xa1a\x01",
    )
    fields.update(overrides)
    return Envelope(**fields)  # type: ignore[arg-type]


def test_envelope_round_trip() -> None:
    env = make_envelope()
    assert decode_envelope(encode(env)) == env


@pytest.mark.parametrize("status", ["accepted", "busy", "rejected"])
def test_reply_round_trip(status: str) -> None:
    reply = Reply(id="x", status=status, retry_after_ms=250, reason="full", body=b"\x00")  # type: ignore[arg-type]
    assert decode_reply(encode(reply)) == reply


def test_wrong_field_type_names_the_field() -> None:
    bad = msgspec.msgpack.encode({"id": 5, "kind": "k", "sender": "a", "receiver": "b"})
    with pytest.raises(CodecError, match=r"\$\.id"):
        decode_envelope(bad)


def test_missing_field_is_codec_error() -> None:
    with pytest.raises(CodecError, match="sender"):
        decode_envelope(msgspec.msgpack.encode({"id": "1", "kind": "k", "receiver": "b"}))


def test_unknown_conflict_policy_is_refused() -> None:
    with pytest.raises(CodecError, match="conflict"):
        decode_envelope(encode(make_envelope()).replace(b"overwrite", b"overwrote"))


def test_future_wire_version_is_refused() -> None:
    env = make_envelope(v=WIRE_VERSION + 1)
    with pytest.raises(CodecError, match="unsupported wire version"):
        decode_envelope(encode(env))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzzed_bytes_raise_only_codec_error(data: bytes) -> None:
    for decoder in (decode_envelope, decode_reply):
        try:
            decoder(data)
        except CodecError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(min_value=0, max_value=200))
def test_corrupted_envelopes_raise_only_codec_error(noise: bytes, cut: int) -> None:
    raw = encode(make_envelope())
    mangled = raw[: cut % len(raw)] + noise
    try:
        decode_envelope(mangled)
    except CodecError:
        pass


class Sample(msgspec.Struct, frozen=True):
    n: int


def test_registry_decodes_known_kind_and_refuses_unknown() -> None:
    registry = MessageRegistry()
    registry.register("sample", Sample)
    env = make_envelope(kind="sample", payload=encode(Sample(3)))
    assert registry.decode_payload(env) == Sample(3)
    with pytest.raises(CodecError, match="unknown message kind"):
        registry.decode_payload(make_envelope(kind="nope"))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("sample", Reply)


def test_decode_payload_of_wrong_shape_is_codec_error() -> None:
    registry = MessageRegistry()
    registry.register("sample", Sample)
    with pytest.raises(CodecError, match="Sample"):
        registry.decode_payload(make_envelope(kind="sample", payload=encode(Reply(id="1", status="busy"))))


def test_decode_generic_struct() -> None:
    assert decode(encode(Sample(9)), Sample) == Sample(9)
