"""Shared test fixtures. Fixtures are appended here by the modules that need them."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
# helpers shared by the firmware tests, the engine's, and the simulator's and CLI's rollout tests
sys.path.insert(0, str(Path(__file__).resolve().parent / "firmware_rollout"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "rollout_engine"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "app_rollout"))  # apps_support, for the leader's tests too

from mosquitto import Mosquitto, MosquittoMissing
from nginx_mirror import NginxMirror, NginxMissing
from otheruser import open_directory
from postgres import PostgresCluster, PostgresMissing

from agent.core.clock import VirtualClock
from agent.transport.memory import MemoryBroker

# Property tests assert behaviour, never speed: no per-example deadline (on a loaded machine one
# example may take longer than hypothesis's 200 ms default without anything being wrong).
settings.register_profile("edge-agent", deadline=None)
settings.load_profile("edge-agent")


def _broker(workdir: Path, **kwargs: object) -> Mosquitto:
    try:
        return Mosquitto(workdir, **kwargs)  # type: ignore[arg-type]
    except MosquittoMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def clock() -> VirtualClock:
    """A virtual clock: time moves only when a test advances it."""
    return VirtualClock()


@pytest.fixture
def broker(clock: VirtualClock) -> MemoryBroker:
    """The in-memory broker on that clock (a module needing another broker defines its own)."""
    return MemoryBroker(clock=clock)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory any user may enter (pytest's own are root's alone)."""
    with open_directory() as where:
        yield where


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    """A running mosquitto on a free loopback port (persistence off), stopped by pid after."""
    broker = _broker(tmp_path / "mosquitto")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def mosquitto_persistent(tmp_path: Path) -> Iterator[Mosquitto]:
    """Like `mosquitto`, with persistence on: sessions and queued messages survive restart()."""
    broker = _broker(tmp_path / "mosquitto-persistent", persistence=True)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def mosquitto_factory(tmp_path: Path) -> Iterator[Callable[..., Mosquitto]]:
    """Make (and start) extra brokers with custom options; all stopped after the test."""
    made: list[Mosquitto] = []

    def make(**kwargs: object) -> Mosquitto:
        broker = _broker(tmp_path / f"mosquitto-{len(made)}", **kwargs)
        made.append(broker)
        return broker.start()

    try:
        yield make
    finally:
        for broker in made:
            broker.stop()


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """A test that runs `edge-agent run` installs the agent's log handler on the root logger,
    bound to that test's captured stderr: put the root logger back as it was afterwards."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Callable[..., NginxMirror]]:
    """Start real nginx static mirrors (each on its own free loopback port); all stopped after."""
    made: list[NginxMirror] = []

    def make() -> NginxMirror:
        try:
            mirror = NginxMirror(tmp_path / f"nginx-{len(made)}")
        except NginxMissing as exc:
            pytest.fail(str(exc), pytrace=False)
        made.append(mirror)
        return mirror.start()

    try:
        yield make
    finally:
        for mirror in made:
            mirror.stop()


@contextlib.contextmanager
def _postgres_cluster() -> Iterator[PostgresCluster]:
    try:
        cluster = PostgresCluster()
    except PostgresMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def postgres_shared() -> Iterator[PostgresCluster]:
    """One real PostgreSQL cluster for this test process (each test takes a fresh schema)."""
    with _postgres_cluster() as cluster:
        yield cluster


@pytest.fixture
def postgres() -> Iterator[PostgresCluster]:
    """A real PostgreSQL cluster of this test alone (it may stop and start it)."""
    with _postgres_cluster() as cluster:
        yield cluster


@pytest.fixture
def pg_url(postgres_shared: PostgresCluster) -> str:
    """A fresh, empty schema of the shared cluster, as a `postgresql://` URL."""
    return postgres_shared.new_schema()


@pytest.fixture(params=["sqlite", "postgresql"])
def leader_store(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where a leader store is opened, once on each backend: an SQLite file, then a fresh
    PostgreSQL schema (a `postgresql://` URL)."""
    if request.param == "sqlite":
        return tmp_path / "leader.db"
    cluster: PostgresCluster = request.getfixturevalue("postgres_shared")
    return cluster.new_schema()


# The booted boards' scenarios run for minutes each, mostly waiting on QEMU. scripts/test.sh runs
# twice as many workers as cores and hands each worker two tests to start with, then one more at a
# time (`--maxschedchunk 1`), in this order: the first worker takes the rollout (the longest) and
# a short test; the second the config scenarios, then the power cuts; the third the boot scenario,
# then the releases; the others start on everything else meanwhile. Collected first, they start at
# once instead of one starting last and running alone at the end; no more than four boards run at
# once (a fifth QEMU beside them on a loaded 2-core machine starves the boards' agents of their
# watchdog pings).
BOARD_ORDER = ("test_board_rollout.py", "", "test_board_config.py", "test_board_power_cut.py", "test_board_boot.py",
               "test_board_release.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    boards = {name: [item for item in items if item.path.name == name] for name in BOARD_ORDER if name}
    rest = [item for item in items if item.path.name not in boards]
    ordered: list[pytest.Item] = []
    shorts = 0
    for name in BOARD_ORDER:  # "": a short test, so that the next board goes to the next worker
        ordered += boards[name] if name else rest[shorts:shorts + 1]
        shorts += not name
    items[:] = ordered + rest[shorts:]
