"""The presence applier: a device's presence change is applied, or kept until the store takes it,
the newest per device winning; nothing is dropped while the store is away."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.clock import SystemClock
from agent.core.errors import MailboxFull, StoreUnavailable, UnstorableValue
from agent.leader.presence import PresenceApplier
from agent.protocol import Presence


class _Store:
    """The LeaderActor as the applier sees it: a tell whose commit settles the future, failing
    while `down` (the database lost) or refusing while `full` (a full mailbox)."""

    def __init__(self) -> None:
        self.online: dict[str, bool] = {}
        self.down = False
        self.full = False
        self.commits = 0

    def tell(self, presence: Presence, done: asyncio.Future[bool]) -> None:
        if self.full:
            raise MailboxFull("leader", 5)
        loop = asyncio.get_running_loop()
        loop.call_soon(self._commit, presence, done)

    def _commit(self, presence: Presence, done: asyncio.Future[bool]) -> None:
        if self.down:
            done.set_exception(StoreUnavailable("the database is away"))
            return
        self.commits += 1
        self.online[presence.device_id] = presence.status == "online"
        done.set_result(True)


def _presence(device: str, online: bool) -> Presence:
    return Presence(device_id=device, status="online" if online else "offline")


async def _settled(applier: PresenceApplier) -> None:
    for _ in range(10_000):
        if applier.pending == 0:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{applier.pending} presence changes still pending")


async def test_a_change_the_store_could_not_take_is_applied_when_it_is_back() -> None:
    store = _Store()
    applier = PresenceApplier(store.tell, SystemClock(), retry_s=0.0)
    task = asyncio.create_task(applier.run())
    try:
        store.down = True
        applier.put(_presence("pi-1", False))
        for _ in range(50):
            await asyncio.sleep(0)
        assert applier.pending == 1 and applier.retries >= 1 and store.online == {}
        applier.put(_presence("pi-1", True))  # newer, while still away: it replaces the offline
        store.down = False
        await _settled(applier)
        assert store.online == {"pi-1": True} and store.commits == 1 and applier.superseded == 1
    finally:
        task.cancel()


async def test_a_full_mailbox_keeps_the_changes_for_the_next_round() -> None:
    store = _Store()
    applier = PresenceApplier(store.tell, SystemClock(), retry_s=0.0)
    task = asyncio.create_task(applier.run())
    try:
        store.full = True
        for n in range(5):
            applier.put(_presence(f"pi-{n}", n % 2 == 0))
        for _ in range(50):
            await asyncio.sleep(0)
        assert applier.pending == 5
        store.full = False
        await _settled(applier)
        assert store.online == {f"pi-{n}": n % 2 == 0 for n in range(5)}
    finally:
        task.cancel()


async def test_a_change_the_store_refuses_for_good_is_not_tried_for_ever() -> None:
    store = _Store()

    def tell(presence: Presence, done: asyncio.Future[bool]) -> None:
        if presence.device_id == "bad":
            done.set_exception(UnstorableValue("a value beyond the column"))
        else:
            store.tell(presence, done)

    applier = PresenceApplier(tell, SystemClock(), retry_s=0.0)
    task = asyncio.create_task(applier.run())
    try:
        applier.put(_presence("bad", True))
        applier.put(_presence("ok", True))
        await _settled(applier)
        assert store.online == {"ok": True} and applier.refused == 1
    finally:
        task.cancel()


_EVENTS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(["a", "b", "c"]), st.booleans()),
    st.tuples(st.just("down"), st.booleans(), st.just(False)),
    st.tuples(st.just("full"), st.booleans(), st.just(False)),
    st.tuples(st.just("yield"), st.integers(0, 5), st.just(False)),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(_EVENTS)
def test_whatever_the_store_does_each_device_ends_at_its_newest_presence(events: list[tuple[object, ...]]) -> None:
    """Changes put in any order while the store goes away, comes back and fills its mailbox:
    once it takes them again, every device's presence is the newest one put, and nothing is
    left pending."""

    async def scenario() -> None:
        store = _Store()
        applier = PresenceApplier(store.tell, SystemClock(), retry_s=0.0, batch=2)
        task = asyncio.create_task(applier.run())
        newest: dict[str, bool] = {}
        try:
            for kind, a, b in events:
                if kind == "put":
                    applier.put(_presence(str(a), bool(b)))
                    newest[str(a)] = bool(b)
                elif kind == "down":
                    store.down = bool(a)
                elif kind == "full":
                    store.full = bool(a)
                else:
                    for _ in range(int(str(a))):
                        await asyncio.sleep(0)
            store.down = store.full = False
            await _settled(applier)
            assert store.online == newest
        finally:
            task.cancel()

    asyncio.run(scenario())
