"""Bodies an application may send to break the local API get a 400 naming what is wrong, and
the API keeps serving: nesting too deep, invalid Unicode, numbers JSON cannot carry."""

from __future__ import annotations

import logging

import msgspec
import pytest
from local_api_support import Setup, post, raw

# nested 30,000 and 60,000 deep, within the test API's 64 KiB body
DEEP_JSON = b'{"class": "telemetry", "payload": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
DEEP_MSGPACK = (b"\x82" + msgspec.msgpack.encode("class") + msgspec.msgpack.encode("telemetry")
                + msgspec.msgpack.encode("payload") + b"\x91" * 60_000 + b"\xc0")


@pytest.mark.parametrize(("body", "ctype", "reason"), [
    (DEEP_JSON, "application/json", "nested too deeply"),
    (DEEP_MSGPACK, "application/msgpack", "nested too deeply"),
    (b'{"class": "telemetry", "payload": "\\ud800"}', "application/json", "not valid Unicode"),
    (b'{"class": "telemetry", "payload": {"t": "x"}, "key": "\\udfff"}', "application/json", "not valid Unicode"),
    (b'{"class": "telemetry", "payload": NaN}', "application/json", "not a JSON number"),
    (b'{"class": "telemetry", "payload": [1, -Infinity]}', "application/json", "not a JSON number"),
    (b'{"class": "telemetry", "payload": 1e999}', "application/json", "not a JSON number"),
    (msgspec.msgpack.encode({"class": "telemetry", "payload": {"t": float("nan")}}), "application/msgpack",
     "not a JSON number"),
])
async def test_a_hostile_body_is_a_400_with_the_reason(offline: Setup, body: bytes, ctype: str, reason: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        status, _, answer = await raw(offline.socket, post("/v1/messages", body, ctype))
    assert status == 400 and reason in str(answer["error"]), answer
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback
    status, _, answer = await raw(offline.socket, post("/v1/messages", b'{"class": "telemetry", "payload": 1.5}'))
    assert status == 202, answer  # and it goes on serving
    stored = await offline.device.outbox.stats()
    assert stored.enqueued == 1  # nothing of the refused one


async def test_refused_bodies_are_logged_once_a_minute(offline: Setup, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agent.worker.local_api"):
        for _ in range(5):
            status, _, _ = await raw(offline.socket, post("/v1/messages", DEEP_JSON))
            assert status == 400
    lines = [r.getMessage() for r in caplog.records if "refused a request" in r.getMessage()]
    assert len(lines) == 1 and "nested too deeply" in lines[0]
