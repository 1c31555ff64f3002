"""Damaged state files: a worker moves a damaged worker.db aside and runs on (as with its
outbox); a leader refuses to start on a damaged leader.db with one line saying what to do, and
`edge-agent run --recover` moves it aside."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import config, leader, stop_all, worker

from agent.cli import main as cli_main
from agent.core.clock import VirtualClock
from agent.core.errors import StoreError
from agent.transport.memory import MemoryBroker

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GARBAGE = b"SQLite format 3\x00" + b"\xff" * 8000


async def test_a_damaged_worker_db_is_moved_aside_and_the_worker_runs(tmp_path: Path) -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    (tmp_path / "w1").mkdir()
    (tmp_path / "w1" / "worker.db").write_bytes(GARBAGE)
    w = await worker(clock, tmp_path, "w1", broker=broker)
    try:
        assert w.recovered_from is not None and ".corrupt-" in w.recovered_from
        assert Path(w.recovered_from).read_bytes() == GARBAGE  # kept as evidence
        assert w.incarnation == 1  # started afresh
    finally:
        await stop_all(w, clock=clock)


async def test_a_damaged_leader_db_refuses_to_start_unless_asked_to_recover(tmp_path: Path) -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    (tmp_path / "gw").mkdir()
    db = tmp_path / "gw" / "leader.db"
    db.write_bytes(GARBAGE)
    with pytest.raises(StoreError, match="--recover"):
        await leader(clock, tmp_path, broker=broker)
    assert db.read_bytes() == GARBAGE  # nothing touched


def test_run_says_what_to_do_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "leader.db").write_bytes(GARBAGE)
    code = cli_main(["run", "--config", str(CONFIGS / "leader.toml"), "--data-dir", str(data),
                     "--broker", "mqtt://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "edge-agent run --recover" in err and "Traceback" not in err


async def test_recover_moves_a_damaged_leader_db_aside(tmp_path: Path) -> None:
    from agent.app import AppEnv, assemble, make_transport
    from agent.leader.env import GatewayEnv

    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    data = tmp_path / "data"
    data.mkdir()
    (data / "leader.db").write_bytes(GARBAGE)
    cfg = config("leader", "gw")
    app = await assemble(cfg, transport=make_transport(cfg, clock=clock, memory_broker=broker), clock=clock,
                         base=data, env=AppEnv(gateway=GatewayEnv(recover=True)))
    agent = app.agent
    try:
        assert [p.name.startswith("leader.db.corrupt-") for p in data.iterdir() if p.name != "leader.db"]
        assert agent.registry.counts() == (0, 0)  # an empty registry, working
    finally:
        await app.discard()


async def test_a_leader_db_that_lost_state_refuses_to_start_and_recover_moves_it_aside(tmp_path: Path) -> None:
    """A sound file that holds less than the leader committed (an old copy put back: its job
    queue's epoch went back) is lost state: refused in one line, moved aside with --recover."""
    import shutil

    from agent.app import AppEnv, assemble, make_transport
    from agent.leader.env import GatewayEnv

    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    db = tmp_path / "gw" / "leader.db"
    await stop_all(await leader(clock, tmp_path, broker=broker), clock=clock)  # epoch 1
    shutil.copyfile(db, tmp_path / "old.db")
    await stop_all(await leader(clock, tmp_path, broker=broker), clock=clock)  # epoch 2
    db.with_name("leader.db-wal").unlink(missing_ok=True)
    shutil.copyfile(tmp_path / "old.db", db)
    with pytest.raises(StoreError, match=r"lost state: its epoch went back to 1 \(it was 2 on .*--recover"):
        await leader(clock, tmp_path, broker=broker)
    cfg = config("leader", "gw")
    app = await assemble(cfg, transport=make_transport(cfg, clock=clock, memory_broker=broker), clock=clock,
                         base=db.parent, env=AppEnv(gateway=GatewayEnv(recover=True)))
    try:
        assert any(p.name.startswith("leader.db.lost-") for p in db.parent.iterdir())
        assert app.agent.jobs_queue.epoch == 1  # afresh
    finally:
        await app.discard()


async def test_a_leader_db_that_vanished_under_its_mark_refuses_to_start(tmp_path: Path) -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    await stop_all(await leader(clock, tmp_path, broker=broker), clock=clock)
    for name in ("leader.db", "leader.db-wal", "leader.db-shm"):
        (tmp_path / "gw" / name).unlink(missing_ok=True)
    with pytest.raises(StoreError, match="lost state: its tables are gone"):
        await leader(clock, tmp_path, broker=broker)


async def test_a_worker_whose_outbox_lost_state_runs_on_a_fresh_one_and_says_so(tmp_path: Path) -> None:
    from agent.commands.doctor import _kept_state

    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    await stop_all(await worker(clock, tmp_path, "w1", broker=broker), clock=clock)
    data = tmp_path / "w1"
    assert _kept_state(data).ok is True
    for name in ("outbox.db", "outbox.db-wal", "outbox.db-shm"):
        (data / name).unlink(missing_ok=True)  # the tables gone, the mark still there
    w = await worker(clock, tmp_path, "w1", broker=broker)
    try:
        assert w.outbox.lost_from is not None and ".lost-" in w.outbox.lost_from
        families = {f.name: f for f in await w.collectors()["worker"]()}
        assert families["ea_worker_outbox_state_lost"].samples[0].value == 1
    finally:
        await stop_all(w, clock=clock)
    kept = _kept_state(data)
    assert kept.ok is False and "lost state" in kept.text
