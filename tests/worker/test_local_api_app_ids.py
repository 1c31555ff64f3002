"""Idempotent submissions: a message the application names (`app_id`) is stored once however
often it is sent, and every copy is answered with the first answer's id and path, marked a
duplicate. On the local API's real socket, a worker and a leader on the in-memory broker; the
retry across a SIGKILLed worker is tests/e2e/test_app_retry_mqtt.py."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from local_api_support import Setup, post, raw, start_api, stop_api

from agent.client import AsyncClient, Client
from agent.core.clock import SystemClock
from agent.transport.memory import MemoryBroker


def _forget(setup: Setup) -> None:
    """What a restarted worker knows of earlier answers: nothing but its stores."""
    setup.device.messages._recent.clear()


async def test_a_named_message_sent_twice_is_stored_once_and_answered_as_the_first(online: Setup) -> None:
    client = AsyncClient(online.socket)
    first = await client.submit("telemetry", {"t": 1}, app_id="reading-0001")
    again = await client.submit("telemetry", {"t": 1}, app_id="reading-0001")
    assert (first.path, first.duplicate) == ("direct", False)
    assert (again.id, again.path, again.duplicate) == (first.id, "direct", True)
    assert online.gw is not None and online.gw.messages is not None
    assert online.gw.messages.count("pi-1", "telemetry") == 1
    counts = (await client.status())["classes"]["telemetry"]
    assert (counts["accepted"], counts["duplicates"]) == (1, 1)


async def test_after_a_restart_the_leader_says_it_holds_the_message(online: Setup) -> None:
    client = AsyncClient(online.socket)
    first = await client.submit("telemetry", {"t": 2}, app_id="reading-0002")
    _forget(online)
    again = await client.submit("telemetry", {"t": 2}, app_id="reading-0002")
    assert (again.id, again.path, again.duplicate) == (first.id, "direct", True)
    assert online.gw is not None and online.gw.messages is not None
    assert online.gw.messages.count("pi-1", "telemetry") == 1


async def test_offline_the_copy_is_found_in_the_outbox(offline: Setup) -> None:
    client = AsyncClient(offline.socket)
    first = await client.submit("telemetry", b"x", app_id="evt:7")
    again = await client.submit("telemetry", b"x", app_id="evt:7")
    _forget(offline)
    after_restart = await client.submit("telemetry", b"x", app_id="evt:7")
    assert first.path == "outbox" and not first.duplicate
    assert (again.id, again.path, again.duplicate) == (first.id, "outbox", True)
    assert (after_restart.id, after_restart.path, after_restart.duplicate) == (first.id, "outbox", True)
    assert (await offline.device.outbox.stats()).by_class["app.telemetry"].pending == 1


async def test_a_retry_racing_the_first_try_gets_its_answer(offline: Setup) -> None:
    client = AsyncClient(offline.socket)
    answers = await asyncio.gather(*(client.submit("telemetry", b"y", app_id="same") for _ in range(5)))
    assert len({a.id for a in answers}) == 1
    assert sorted(a.duplicate for a in answers) == [False, True, True, True, True]
    assert (await offline.device.outbox.stats()).by_class["app.telemetry"].pending == 1


async def test_a_batch_answers_each_message_and_stores_only_the_new_ones(offline: Setup) -> None:
    client = AsyncClient(offline.socket)
    first = await client.submit("telemetry", 1, app_id="b-1")
    body = json.dumps({"messages": [{"class": "telemetry", "payload": 1, "app_id": "b-1"},
                                    {"class": "telemetry", "payload": 2, "app_id": "b-2"},
                                    {"class": "telemetry", "payload": 3}]}).encode()
    status, _, doc = await raw(offline.socket, post("/v1/messages", body))
    assert status == 202
    answers = doc["messages"]
    assert isinstance(answers, list)
    assert answers[0] == {"id": first.id, "path": "outbox", "duplicate": True}
    assert [a["duplicate"] for a in answers[1:]] == [False, False]
    assert (await offline.device.outbox.stats()).by_class["app.telemetry"].pending == 3


@pytest.mark.parametrize(("body", "field"), [
    ({"class": "telemetry", "payload": 1, "app_id": ""}, "app_id"),
    ({"class": "telemetry", "payload": 1, "app_id": "x" * 129}, "app_id"),
    ({"class": "telemetry", "payload": 1, "app_id": "no spaces"}, "app_id"),
    ({"class": "telemetry", "payload": 1, "app_id": 7}, "app_id"),
    ({"messages": [{"class": "telemetry", "payload": 1, "app_id": "d"},
                   {"class": "telemetry", "payload": 2, "app_id": "d"}]}, "messages.1.app_id"),
])
async def test_a_wrong_app_id_is_refused_naming_it_and_nothing_is_stored(offline: Setup, body: dict[str, object],
                                                                          field: str) -> None:
    status, _, doc = await raw(offline.socket, post("/v1/messages", json.dumps(body).encode()))
    assert (status, doc["field"]) == (400, field)
    assert (await offline.device.outbox.stats()).pending == 0


async def test_the_client_names_every_message_and_resends_it_on_a_new_connection(offline: Setup) -> None:
    def session() -> tuple[str, str, bool]:
        with Client(offline.socket) as client:
            first = client.submit("telemetry", 1)
            # the agent closes the kept-alive connection (a restart of its API): the next call
            # finds it dead and sends again on a new one, under the same name
            asyncio.run_coroutine_threadsafe(offline.api.stop(), loop).result()
            asyncio.run_coroutine_threadsafe(offline.api.start(), loop).result()
            second = client.submit("telemetry", 2)
            return first.app_id, second.app_id, second.duplicate

    loop = asyncio.get_running_loop()
    a, b, duplicate = await asyncio.to_thread(session)
    assert a != b and len(a) == 32 and not duplicate
    assert (await offline.device.outbox.stats()).by_class["app.telemetry"].pending == 2


async def test_the_status_says_what_each_class_promises(tmp_path: Path) -> None:
    setup = await start_api(tmp_path, MemoryBroker(clock=SystemClock()), with_leader=False,
                         classes={"readings": {"mode": "append", "durability": "crash"}})
    try:
        classes = (await AsyncClient(setup.socket).status())["classes"]
        assert classes["telemetry"]["durability"] == "power"  # the default: a 202 survives a power cut
        assert classes["readings"]["durability"] == "crash"
    finally:
        await stop_api(setup)


async def test_a_copy_waiting_on_a_cancelled_first_try_is_stored_itself(offline: Setup,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.worker.messages import Submission

    intake = offline.device.messages
    real = intake._submit
    release = asyncio.Event()
    calls: list[str] = []

    async def slow(msg: object) -> object:
        calls.append(str(getattr(msg, "msg_id", "")))
        if len(calls) == 1:
            await release.wait()
        return await real(msg)  # type: ignore[arg-type]

    monkeypatch.setattr(intake, "_submit", slow)
    sub = Submission("telemetry", b"z", app_id="c-1")
    first = asyncio.create_task(intake.submit(sub))
    await asyncio.sleep(0)
    second = asyncio.create_task(intake.submit(sub))
    await asyncio.sleep(0)
    first.cancel()  # the first request goes away (its client hung up)
    done = await second
    assert not done.duplicate and len(calls) == 2 and first.cancelled()
    assert (await offline.device.outbox.stats()).by_class["app.telemetry"].pending == 1
