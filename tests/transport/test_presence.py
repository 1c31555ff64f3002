"""Presence payloads: a session's birth and will, and what a hostile device may put there."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.codec import INT64_MAX
from agent.transport.presence import (
    MAX_PRESENCE_BYTES,
    PresenceFormatError,
    PresenceState,
    decode_presence,
    encode_presence,
)

sessions = st.text(alphabet="0123456789abcdef", min_size=1, max_size=32)


@given(online=st.booleans(), session=sessions, since=st.integers(0, INT64_MAX))
def test_a_birth_or_will_reads_back_as_written(online: bool, session: str, since: int) -> None:
    payload = encode_presence(online, session, since)
    assert len(payload) <= MAX_PRESENCE_BYTES
    assert decode_presence(payload) == PresenceState(online, session, since)


def test_a_bare_state_from_an_agent_before_sessions_has_no_session() -> None:
    assert decode_presence(b"online") == PresenceState(True)
    assert decode_presence(b"offline") == PresenceState(False, "", 0)


@pytest.mark.parametrize(("payload", "reason"), [
    (b"", "start with online or offline"),
    (b"up", "start with online or offline"),
    (b"online aa01", "'online|offline SESSION SINCE_MS'"),
    (b"online aa01 1 2", "'online|offline SESSION SINCE_MS'"),
    (b"online AA01 1", "lowercase hex"),
    (b"online " + b"a" * 33 + b" 1", "lowercase hex"),
    (b"online \xff\xfe 1", "lowercase hex"),
    (b"online aa01 -1", "64-bit"),
    (b"online aa01 " + str(2**63).encode(), "64-bit"),
    (b"offline aa01 " + b"9" * 19, "64-bit"),
    (b"online aa01 1" + b" " * 100, "longer than"),
])
def test_a_malformed_presence_names_what_is_wrong(payload: bytes, reason: str) -> None:
    with pytest.raises(PresenceFormatError, match=reason):
        decode_presence(payload)


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_the_typed_error(payload: bytes) -> None:
    try:
        state = decode_presence(payload)
    except PresenceFormatError:
        return
    assert 0 <= state.since_ms <= INT64_MAX and len(state.session) <= 32
