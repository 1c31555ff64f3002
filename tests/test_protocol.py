import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.codec import Envelope, decode, encode
from agent.core.errors import CodecError
from agent.protocol import (
    KIND_HEARTBEAT,
    KIND_JOB_OFFER,
    Heartbeat,
    HeartbeatPace,
    JobDemand,
    JobOffer,
    JobResult,
    JobSubmit,
    Ping,
    Presence,
    SystemSample,
    Telemetry,
    agent_registry,
    decode_as,
    decode_message,
    encode_message,
)
from firmware_rollout.messages import ChunkRequest, UpdateOffer, register_messages
from rollout_engine.messages import RolloutCancel, RolloutReport

# An agent registers the firmware kinds when the rollout service or the updater is attached;
# the wire examples below cover both, so this registry holds both.
REGISTRY = agent_registry()
register_messages(REGISTRY)

SAMPLE = SystemSample(
    cpu_percent=12.5, mem_total_bytes=1 << 30, mem_available_bytes=1 << 29, mem_percent=50.0,
    disk_total_bytes=32 << 30, disk_free_bytes=8 << 30, disk_percent=75.0, load_1m=0.5,
    load_5m=0.25, load_15m=0.125, temperature_c=48.3, uptime_s=3600.0,
)

EXAMPLES: dict[str, msgspec.Struct] = {
    "heartbeat": Heartbeat(device_id="pi-1", seq=7, uptime_s=12.5, firmware_version="1.2.3",
                           tags=("lab", "north"), sample=SAMPLE),
    "telemetry": Telemetry(device_id="pi-1", seq=3, name="env", ts_ms=1_700_000_000_000,
                           value=21.5, values={"humidity": 40.0, "co2": 415.0}),
    "presence": Presence(device_id="pi-1", status="offline", ts_ms=5),
    "job.submit": JobSubmit(job_id="job-1", kind="resize", payload=b"\x00\x01"),
    "job.offer": JobOffer(job_id="job-1", epoch=3, kind="resize", payload=b"\x00\x01"),
    "job.demand": JobDemand(worker="pi-1", incarnation="run-1", window=4),
    "job.result": JobResult(job_id="job-1", epoch=3, worker="pi-1", ok=False, error="boom"),
    "firmware.offer": UpdateOffer(rollout_id="r-1", signed_manifest=b"\x01\x02",
                                  maintenance_windows=("01:00-05:00",), chunk_size=4096),
    "rollout.report": RolloutReport(device="pi-1", rollout_id="r-1", version="1.1.0",
                                    state="succeeded", phase="committed", detail="ok",
                                    ts_ms=5, seq=2, active_version="1.1.0"),
    "firmware.chunk": ChunkRequest(rollout_id="r-1", index=3, offset=12288, length=4096),
    "firmware.cancel": RolloutCancel(rollout_id="r-1", reason="canceled by operator"),
    "ping": Ping(sent_ms=1_700_000_000_000),
    "heartbeat.pace": HeartbeatPace(interval_s=5.0, for_s=360.0),
}


def test_examples_cover_every_registered_kind() -> None:
    assert set(EXAMPLES) == set(REGISTRY.kinds())


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_round_trip_through_an_envelope(kind: str) -> None:
    message = EXAMPLES[kind]
    assert REGISTRY.kind_of(message) == kind
    envelope = Envelope(id="01HZX3J5Q0000000000000000A", kind=kind, sender="pi-1",
                        receiver="leader", payload=encode_message(message))
    again = REGISTRY.decode_payload(decode(encode(envelope), Envelope))
    assert again == message
    assert type(again) is type(message)


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_minimal_messages_round_trip(kind: str) -> None:
    type_ = REGISTRY.type_of(kind)
    message = EXAMPLES[kind]
    required = {f: getattr(message, f) for f in type_.__struct_fields__
                if f in _required_fields(type_)}
    minimal = type_(**required)
    assert decode_as(encode_message(minimal), type_) == minimal


def _required_fields(type_: type[msgspec.Struct]) -> set[str]:
    info = msgspec.inspect.type_info(type_)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.name for f in info.fields if f.required}


@pytest.mark.parametrize(
    ("type_", "fields"),
    [
        (Heartbeat, {"device_id": "", "seq": 1, "uptime_s": 0.0}),
        (Heartbeat, {"device_id": "a", "seq": -1, "uptime_s": 0.0}),
        (JobOffer, {"job_id": "j", "epoch": 0, "kind": "k"}),
        (JobDemand, {"worker": "w", "incarnation": "i", "window": 0}),
        (Presence, {"device_id": "a", "status": "maybe"}),
        (Telemetry, {"device_id": "a", "seq": 1, "name": "t"}),  # ts_ms missing
    ],
)
def test_invalid_fields_are_codec_errors(type_: type[msgspec.Struct], fields: dict) -> None:
    with pytest.raises(CodecError):
        decode(msgspec.msgpack.encode(fields), type_)


def test_unknown_kind_is_a_codec_error() -> None:
    envelope = Envelope(id="x", kind="no.such.kind", sender="a", receiver="b", payload=b"\x80")
    with pytest.raises(CodecError, match="unknown message kind"):
        decode_message(envelope)


def test_payload_of_another_kind_is_refused() -> None:
    envelope = Envelope(id="x", kind=KIND_JOB_OFFER, sender="a", receiver="b",
                        payload=encode_message(EXAMPLES[KIND_HEARTBEAT]))
    with pytest.raises(CodecError):
        decode_message(envelope)


def test_unknown_fields_from_a_newer_peer_are_ignored() -> None:
    raw = msgspec.msgpack.encode({"device_id": "a", "status": "online", "future": [1, 2]})
    assert decode(raw, Presence) == Presence(device_id="a", status="online")


@settings(deadline=None, max_examples=300)
@given(data=st.binary(max_size=256), kind=st.sampled_from(sorted(EXAMPLES)))
def test_fuzzed_bytes_raise_only_codec_error(data: bytes, kind: str) -> None:
    envelope = Envelope(id="x", kind=kind, sender="a", receiver="b", payload=data)
    try:
        decoded = REGISTRY.decode_payload(envelope)
    except CodecError:
        return
    assert isinstance(decoded, REGISTRY.type_of(kind))


@settings(deadline=None, max_examples=200)
@given(
    prefix=st.sampled_from(sorted(EXAMPLES)),
    cut=st.integers(min_value=0, max_value=400),
    flip=st.integers(min_value=0, max_value=255),
)
def test_damaged_valid_payloads_raise_only_codec_error(prefix: str, cut: int, flip: int) -> None:
    good = bytearray(encode_message(EXAMPLES[prefix]))
    cut %= len(good)
    good[cut] ^= flip
    for data in (bytes(good), bytes(good[:cut])):
        try:
            decode_as(data, REGISTRY.type_of(prefix))
        except CodecError:
            pass


@settings(deadline=None, max_examples=100)
@given(
    device=st.text(min_size=1, max_size=40),
    seq=st.integers(min_value=0, max_value=2**63 - 1),
    uptime=st.floats(min_value=0, max_value=1e15),
    tags=st.lists(st.text(max_size=10), max_size=4).map(tuple),
    temp=st.none() | st.floats(min_value=-1e300, max_value=1e300),
)
def test_heartbeat_round_trip_property(device: str, seq: int, uptime: float,
                                       tags: tuple[str, ...], temp: float | None) -> None:
    hb = Heartbeat(device_id=device, seq=seq, uptime_s=uptime, tags=tags,
                   sample=SystemSample(temperature_c=temp))
    assert decode_as(encode_message(hb), Heartbeat) == hb


OUT_OF_BOUNDS = [
    ("seq", dict(device_id="d", seq=2**63, uptime_s=1.0)),
    ("seq", dict(device_id="d", seq=2**64 - 1, uptime_s=1.0)),
    ("uptime_s", dict(device_id="d", seq=1, uptime_s=float("nan"))),
    ("uptime_s", dict(device_id="d", seq=1, uptime_s=float("inf"))),
    ("firmware_version", dict(device_id="d", seq=1, uptime_s=1.0, firmware_version="x" * 200_000)),
    ("tags", dict(device_id="d", seq=1, uptime_s=1.0, tags=["t"] * 1000)),
]


@pytest.mark.parametrize(("field", "fields"), OUT_OF_BOUNDS)
def test_a_heartbeat_out_of_bounds_is_refused_naming_the_field(field: str, fields: dict[str, object]) -> None:
    """msgpack carries uint64 and unbounded strings: the decoder refuses what SQLite cannot store
    or what would grow a leader's state without bound, before any actor sees it."""
    raw = msgspec.msgpack.encode(fields)
    with pytest.raises(CodecError, match=field):
        decode_as(raw, Heartbeat)


@pytest.mark.parametrize("field", ["seq", "ts_ms", "ttl_ms"])
def test_an_envelope_integer_beyond_int64_is_refused(field: str) -> None:
    raw = msgspec.msgpack.encode({"id": "e1", "kind": "heartbeat", "sender": "d", "receiver": "leader",
                                  field: 2**63})
    with pytest.raises(CodecError, match=field):
        decode(raw, Envelope)
