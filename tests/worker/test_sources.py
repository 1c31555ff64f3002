"""The built-in sources: a real command, a real file, the psutil sample, into a worker's intake."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import config, worker

from agent.core.clock import SystemClock
from agent.core.config import CommandSourceSection, FileSourceSection, SystemSourceSection, load_config
from agent.core.errors import ConfigError
from agent.protocol import AppMessage, decode_as
from agent.telemetry import SystemSampler
from agent.transport.memory import MemoryBroker
from agent.worker.agent import WORKER_DB, WorkerAgent
from agent.worker.sources import CommandSource, FileSource, SourceOffsets, SystemSource


async def _offline_worker(tmp: Path) -> WorkerAgent:
    # no leader and no relay: every message stays in the outbox, where the test reads it back
    # (a direct try finds no leader: it gives up soon)
    return await worker(SystemClock(), tmp, "pi-1", broker=MemoryBroker(clock=SystemClock()), relay=False,
                        sections={"local_api": {"direct_timeout_s": 0.1}})


async def _stored(device: WorkerAgent, cls: str) -> list[AppMessage]:
    rows = await device.outbox.take_ready(limit=10_000, kinds=[f"app.{cls}"])
    await device.outbox.release([r.row_id for r in rows])
    out = []
    for r in rows:
        message = decode_as(r.payload, AppMessage)
        assert isinstance(message, AppMessage)
        out.append(message)
    return out


async def test_a_command_source_sends_each_json_line_and_skips_the_rest(tmp_path: Path) -> None:
    device = await _offline_worker(tmp_path)
    try:
        script = "print('{\"a\": 1}'); print('not json'); print(); print('[2, 3]')"
        source = CommandSource("probe", device.messages, CommandSourceSection(
            command=[sys.executable, "-c", script], cls="telemetry"), clock=device.clock)
        await source.run_once()
        got = [json.loads(m.payload) for m in await _stored(device, "telemetry")]
        assert got == [{"a": 1}, [2, 3]] and source.skipped == 1
        failing = CommandSource("broken", device.messages, CommandSourceSection(
            command=[sys.executable, "-c", "print('{}'); raise SystemExit(3)"]), clock=device.clock)
        await failing.run_once()
        missing = CommandSource("absent", device.messages, CommandSourceSection(
            command=[str(tmp_path / "no-such-program")]), clock=device.clock)
        await missing.run_once()
        assert (failing.errors, missing.errors) == (1, 1)
        assert len(await _stored(device, "telemetry")) == 2  # a failed run sends nothing
    finally:
        await device.stop()


async def test_a_file_source_keeps_its_offset_and_waits_for_a_whole_line(tmp_path: Path) -> None:
    device = await _offline_worker(tmp_path)
    log = tmp_path / "app.jsonl"
    log.write_bytes(b'{"n": 1}\n{"n": 2}\n{"n": 3')  # the last line is still being written
    offsets = SourceOffsets.open(tmp_path / "pi-1" / WORKER_DB)
    try:
        settings = FileSourceSection(path=str(log), cls="events")
        source = FileSource("app", device.messages, settings, clock=device.clock, offsets=offsets, device_id="pi-1")
        assert await source.poll() is True
        assert await source.poll() is False  # nothing whole to add
        with open(log, "ab") as f:
            f.write(b'}\n{"n": 4}\n')
        assert await source.poll() is True
        first = [json.loads(m.payload)["n"] for m in await _stored(device, "events")]
        assert first == [1, 2, 3, 4]
        # a restart from the kept offset reads nothing again; a line re-read (the offset lost in a
        # crash) carries the id it had, and the outbox keeps it once
        again = FileSource("app", device.messages, settings, clock=device.clock, offsets=offsets, device_id="pi-1")
        assert await again.poll() is False
        offsets.put("file.app", log.stat().st_ino, 0, 0)
        assert await again.poll() is True
        assert [json.loads(m.payload)["n"] for m in await _stored(device, "events")] == [1, 2, 3, 4]
        assert device.messages.stats["events"].duplicates == 4
    finally:
        offsets.close()
        await device.stop()


async def test_a_file_replaced_or_truncated_is_read_from_its_start(tmp_path: Path) -> None:
    device = await _offline_worker(tmp_path)
    log = tmp_path / "app.jsonl"
    log.write_text('{"n": 1}\n{"n": 2}\n')
    offsets = SourceOffsets.open(tmp_path / "pi-1" / WORKER_DB)
    try:
        source = FileSource("app", device.messages, FileSourceSection(path=str(log), cls="events"),
                            clock=device.clock, offsets=offsets, device_id="pi-1")
        await source.poll()
        log.write_text('{"n": 3}\n')  # truncated in place and rewritten
        await source.poll()
        rotated = tmp_path / "app.jsonl.new"
        rotated.write_text('{"n": 4}\n')
        rotated.rename(log)  # logrotate's way: a new inode
        await source.poll()
        assert [json.loads(m.payload)["n"] for m in await _stored(device, "events")] == [1, 2, 3, 4]
    finally:
        offsets.close()
        await device.stop()


async def test_the_system_source_sends_the_sample_as_json(tmp_path: Path) -> None:
    device = await _offline_worker(tmp_path)
    try:
        sampler = SystemSampler(tmp_path, clock=device.clock)
        source = SystemSource(device.messages, SystemSourceSection(interval_s=3600.0), clock=device.clock,
                              sample=sampler.sample)
        await source.start()
        stored: list[AppMessage] = []
        while not stored:  # the first sample is taken at start
            stored = await _stored(device, "telemetry")
            if not stored:
                await asyncio.sleep(0.01)
        await source.stop()
        sample = json.loads(stored[0].payload)
        assert "mem_total_bytes" in sample and stored[0].content_type == "application/json"
    finally:
        await device.stop()


@pytest.mark.parametrize(("text", "key"), [
    ('[sources.file.app]\npath = "/tmp/x"\nclass = "nope"\n', "sources.file.app.class"),
    ('[sources.command.m]\ncommand = ["x"]\nclass = "Bad Name"\n', "sources.command.m.class"),
    ('[sources.file.app]\nclass = "events"\n', "sources.file.app.path"),
    ('[classes.telemetry]\nmode = "sometimes"\n', "classes.telemetry.mode"),
    ('[classes.telemetry]\nmax_payload_bytes = 1000\nmax_bytes = 10\n', "classes.telemetry.max_payload_bytes"),
    ('[local_api]\nmax_batch = 0\n', "local_api.max_batch"),
    ('[northbound]\ntopic = "x/{nope}"\n', "northbound.topic"),
])
def test_a_wrong_source_or_class_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "worker.toml"
    path.write_text('[agent]\ndevice_id = "pi-1"\n' + text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}: {key}:" in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_the_test_config_keeps_the_builtin_classes() -> None:
    assert set(config("worker", "d").classes) == {"telemetry", "events", "state"}
