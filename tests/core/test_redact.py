"""Secrets out of log lines (`agent.core.redact`): by shape and by value; a planted secret never
survives, wherever it sits in the line (a property)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.redact import REDACTED, redact, redact_lines


@pytest.mark.parametrize(("line", "kept", "gone"), [
    ("db connect failed: password=hunter2 host=db1", "host=db1", "hunter2"),
    ('DB_PASSWORD: "s3cr3t!" next', "next", "s3cr3t!"),
    ('{"api_key": "abcd1234", "n": 1}', '"n": 1', "abcd1234"),
    ("curl -H 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.x' https://x", "curl -H", "eyJhbGciOiJIUzI1NiJ9"),
    ("fetch https://fleet:pa55w0rd@mirror.example/a.bin", "mirror.example/a.bin", "pa55w0rd"),
    ("run --token abcdef12 --verbose", "--verbose", "abcdef12"),
    ("wpa: psk=0xdeadbeef;", "wpa:", "0xdeadbeef"),
    ("client_secret = 'q9q9q9q9'", "client_secret", "q9q9q9q9"),
    ("-----BEGIN PRIVATE KEY-----MIIEvQIBADANBg-----END PRIVATE KEY-----", "", "MIIEvQIBADANBg"),
])
def test_secrets_by_shape_are_taken_out_and_the_rest_kept(line: str, kept: str, gone: str) -> None:
    out = redact(line)
    assert gone not in out and REDACTED in out and kept in out, out


@pytest.mark.parametrize("line", [
    "token expired at 12:00, asking for a new one",
    "Basic auth failed for user pi",
    "app 1.2.0: sha256 0123abcd ok",
    "health command exited 1: mode is not good",
])
def test_prose_about_secrets_is_not_taken_for_one(line: str) -> None:
    assert redact(line) == line


def test_a_pem_block_across_lines_goes_whole() -> None:
    lines = ["before", "-----BEGIN EC PRIVATE KEY-----", "MHcCAQEEIB", "oUQDQgAE", "-----END EC PRIVATE KEY-----",
             "after"]
    assert redact_lines(lines) == ["before", REDACTED, "after"]


@given(secret=st.text(alphabet="ABCDEFGHJKLMNPQRSTUVWXYZ0123456789_-", min_size=4, max_size=48),
       before=st.text(max_size=40), after=st.text(max_size=40), times=st.integers(1, 3))
def test_a_known_secret_never_survives_wherever_it_sits(secret: str, before: str, after: str, times: int) -> None:
    line = before + (secret + after) * times
    assert secret not in redact(line, [secret])
    assert all(secret not in out for out in redact_lines([before, line, after], [secret]))
