"""The orchestrator lease on a real PostgreSQL: one holder at a time, a standby takes over when
the holder stops renewing, and a holder that lost it (frozen, then woken) writes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from rollout_support import FakePort, engine_kinds, spec_data

from agent.core.clock import VirtualClock
from agent.core.postgres import PgConnection, connect
from agent.core.sql import ServerUrl
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.lease import LEASE_NAME, LeaseLost, OrchestratorLease, lease_of
from rollout_engine.orchestrator import Orchestrator
from rollout_engine.spec import spec_from_dict
from rollout_engine.store import RolloutStore


def _expire(admin: PgConnection) -> None:
    """The holder stopped renewing and its lease time passed (without waiting for it)."""
    admin.execute("UPDATE leases SET expires_ms = 0 WHERE name = ?", (LEASE_NAME,))


@pytest.fixture
def admin(pg_url: str) -> Iterator[PgConnection]:
    RolloutStore.open(pg_url, clock=VirtualClock()).close()  # the tables
    conn = connect(ServerUrl(pg_url))
    yield conn
    conn.close()


def _leader(url: str, name: str) -> tuple[RolloutStore, OrchestratorLease]:
    store = RolloutStore.open(url, clock=VirtualClock())
    lease = OrchestratorLease(store, name, ttl_s=10.0)
    store.fence = lease.fence
    return store, lease


def _write(store: RolloutStore) -> None:
    with store.atomic():
        store.add_control("r1", "pause")  # any write of the orchestrator's store


def test_one_holder_at_a_time_and_a_standby_takes_over_when_the_lease_runs_out(
        pg_url: str, admin: PgConnection) -> None:
    a_store, a = _leader(pg_url, "gw-1")
    b_store, b = _leader(pg_url, "gw-2")
    try:
        assert a.hold() and not b.hold()
        assert a.hold()  # renewed, same token
        first = a.token
        _write(a_store)
        with pytest.raises(LeaseLost, match="gw-1"):
            _write(b_store)
        _expire(admin)
        assert b.hold() and b.token == (first or 0) + 1
        with pytest.raises(LeaseLost, match="gw-2"):  # a woken gw-1 writes nothing
            _write(a_store)
        assert not a.held and not a.hold()  # and does not take it back while gw-2 renews
        _write(b_store)
        row = lease_of(b_store)
        assert row is not None and (row.holder, row.token) == ("gw-2", b.token)
    finally:
        a_store.close()
        b_store.close()


def test_a_released_lease_is_taken_at_once_and_a_restarted_holder_takes_its_own_back(pg_url: str,
                                                                                   admin: PgConnection) -> None:
    a_store, a = _leader(pg_url, "gw-1")
    b_store, b = _leader(pg_url, "gw-2")
    again_store, again = _leader(pg_url, "gw-2")  # gw-2 after a restart: same name, no token
    try:
        assert a.hold()
        a.release()
        assert not a.held and b.hold()
        token = b.token
        assert again.hold() and again.token == (token or 0) + 1  # its own lease: no wait for it to run out
        with pytest.raises(LeaseLost):
            _write(b_store)  # the process before the restart, were it still there
    finally:
        for store in (a_store, b_store, again_store):
            store.close()


async def test_an_orchestrator_that_lost_the_lease_offers_nothing_and_the_new_one_resends_pending_offers(
        tmp_path: Path, pg_url: str, admin: PgConnection) -> None:
    clock = VirtualClock()
    artifact, _ = make_artifact(tmp_path, chunk_size=1024, size=4096)
    spec = spec_from_dict(spec_data(artifact, waves={"canary": 2, "counts": [4]}))
    devices = [f"d{i}" for i in range(6)]
    a_store, a = _leader(pg_url, "gw-1")
    b_store, b = _leader(pg_url, "gw-2")
    a_port, b_port = FakePort(clock, devices), FakePort(clock, devices)
    a_orch = Orchestrator(a_store, clock=clock, port=a_port, poll_s=1.0, kinds=engine_kinds())
    b_orch = Orchestrator(b_store, clock=clock, port=b_port, poll_s=1.0, kinds=engine_kinds())
    try:
        assert a.hold()
        rid = await a_orch.start_rollout(spec, rollout_id="r1")
        await a_orch.tick()
        canary = sorted(a_port.offered())
        assert len(canary) == 2
        _expire(admin)  # gw-1 froze and its lease ran out
        assert b.hold()
        assert await b_orch.resend_offers() == 2  # what gw-1 may have left in its outbox
        assert sorted(b_port.offered()) == canary
        for device in canary:  # the canary reports through gw-2
            await _succeed(b_orch, rid, device, clock)
        with pytest.raises(LeaseLost):  # gw-1 wakes: fenced before it changes anything (`run` then ends)
            await a_orch.tick()
        assert a_orch.ticks == 2 and sorted(a_port.offered()) == canary
        await b_orch.tick()
        await b_orch.tick()
        offered = [d for d in b_port.offered() if d not in canary]
        assert sorted(offered) == sorted(set(devices) - set(canary))  # wave 2, offered once, by gw-2
        assert sorted(d for d, _, _ in b_store.offers(rid)) == sorted(devices)  # one offer each in the tables
        row = b_store.get(rid)
        assert row is not None and row.current_wave == 1
        await b_orch.control(rid, "cancel")
        await b_orch.tick()
        cancelled = sorted(d for d, _ in b_port.cancels)
        assert cancelled == sorted(set(devices) - set(canary))  # the devices still updating
        _expire(admin)  # gw-2 dies with those cancels in its outbox: gw-1 takes over, sends them again
        assert a.hold()
        a_port.cancels.clear()
        assert await a_orch.resend_offers() == 0  # no offer pending in a canceled rollout
        await a_orch.tick()
        assert sorted(d for d, _ in a_port.cancels) == cancelled
    finally:
        a_store.close()
        b_store.close()


async def _succeed(orch: Orchestrator, rid: str, device: str, clock: VirtualClock) -> None:
    from rollout_engine.messages import RolloutReport

    report = RolloutReport(device=device, rollout_id=rid, version="1.1.0", state="succeeded", phase="committed",
                          detail="", ts_ms=clock.now_ms(), seq=1)
    assert await orch.on_report(f"{device}-ok", report)


class LeaseMachine(RuleBasedStateMachine):
    """Three leaders renew, write, freeze and restart in any order; the lease running out is a
    step of its own. A write succeeds exactly when its leader took the lease most recently, and
    tokens only grow."""

    url = ""

    @initialize()
    def setup(self) -> None:
        self.admin = connect(ServerUrl(self.url))
        self.leaders = [_leader(self.url, f"gw-{i}") for i in range(3)]  # (the leases table made)
        self.admin.execute("DELETE FROM leases")
        self.current: int | None = None  # who took it last (the model)
        self.expired = True
        self.tokens: list[int] = []

    def teardown(self) -> None:
        for store, _ in getattr(self, "leaders", []):
            store.close()
        if hasattr(self, "admin"):
            self.admin.close()

    @rule(i=st.integers(0, 2))
    def hold(self, i: int) -> None:
        _, lease = self.leaders[i]
        had = lease.token
        held = lease.hold()
        may_take = self.current is None or self.expired or self.current == i
        assert held == may_take
        if held:
            if self.current != i or had is None:
                self.tokens.append(lease.token or 0)
            self.current, self.expired = i, False

    @rule(i=st.integers(0, 2))
    def write(self, i: int) -> None:
        store, lease = self.leaders[i]
        mine = self.current == i and lease.token is not None and lease.token == (self.tokens[-1] if self.tokens
                                                                                 else None)
        try:
            _write(store)
        except LeaseLost:
            assert not mine
        else:
            assert mine

    @rule()
    def run_out(self) -> None:
        _expire(self.admin)
        self.expired = True

    @rule(i=st.integers(0, 2))
    def restart(self, i: int) -> None:
        store, _ = self.leaders[i]
        store.close()
        self.leaders[i] = _leader(self.url, f"gw-{i}")

    @invariant()
    def tokens_only_grow(self) -> None:
        if hasattr(self, "tokens"):
            assert self.tokens == sorted(set(self.tokens))


def test_the_lease_state_machine(pg_url: str, admin: PgConnection) -> None:
    LeaseMachine.url = pg_url
    runner = LeaseMachine.TestCase
    runner.settings = settings(max_examples=25, stateful_step_count=20, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])
    runner().runTest()
