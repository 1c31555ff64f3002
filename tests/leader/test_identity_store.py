"""The fleet's device identities (`IdentityStore`), the same on leader.db and on the fleet's
PostgreSQL: the records of enrolment, the tokens and the allow-list spent once, the operators'
controls claimed by one leader, the revocations the CRL lists."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.core.errors import IdentityError
from agent.leader.identities import IdentityStore

DAY_MS = 86_400_000


@pytest.fixture
def store(leader_store: Path | str) -> Iterator[IdentityStore]:
    with IdentityStore.open(leader_store) as opened:
        yield opened


def ask(store: IdentityStore, device: str, key: str = "k1", *, now_ms: int = 1000) -> str:
    return store.record_request(device=device, fingerprint=key * 8, csr=f"csr of {device}", hw_serial=f"s-{device}",
                                machine_id="m", agent_version="1.0", claim="claim-a", now_ms=now_ms).state


def test_a_request_is_pending_until_issued_and_another_key_is_refused(store: IdentityStore) -> None:
    assert ask(store, "pi-1") == "pending" and ask(store, "pi-1", now_ms=2000) == "pending"
    found = store.get("pi-1")
    assert found is not None and found.requests == 2 and store.request_pem("pi-1") == "csr of pi-1"
    with pytest.raises(IdentityError, match="another key"):
        ask(store, "pi-1", key="k2")
    store.issued("pi-1", cert="PEM", serial=0xABC, not_after_ms=365 * DAY_MS, by="token", now_ms=3000)
    assert store.count("approved") == 1
    assert [each.device for each in store.listed("approved")] == ["pi-1"]
    with pytest.raises(IdentityError, match="enrolled with"):
        ask(store, "pi-1", key="k2")


def test_a_revocation_is_final_and_listed_until_its_certificate_expires(store: IdentityStore) -> None:
    ask(store, "pi-1")
    store.issued("pi-1", cert="PEM", serial=0x10, not_after_ms=10 * DAY_MS, by="op", now_ms=1000)
    store.decide("pi-1", "revoked", by="op", reason="stolen", now_ms=2000)
    assert store.revoked_devices() == {"pi-1"} and store.revoked_certs(now_ms=3000) == [(0x10, 2000)]
    assert store.revoked_certs(now_ms=11 * DAY_MS) == []  # expired: the CRL need not name it
    with pytest.raises(IdentityError, match="revoked"):
        ask(store, "pi-1")


def test_a_tokens_uses_and_an_allow_list_entry_are_spent_once(store: IdentityStore) -> None:
    store.add_token("t0k", uses=2, expires_ms=5000, by="op", now_ms=0)
    assert store.vouched_for(serial="", token="t0k", now_ms=1)
    assert [store.take_token("t0k", now_ms=1) for _ in range(3)] == [True, True, False]
    store.add_token("old", uses=5, expires_ms=5000, by="op", now_ms=0)
    assert store.take_token("old", now_ms=5000) is False  # expired
    assert store.allow_serials(["SER1", "SER1", "SER2"], by="op", now_ms=0) == 2
    with pytest.raises(IdentityError, match="serial"):
        store.allow_serials([" padded"], by="op", now_ms=0)
    assert store.take_allowed("SER1", "pi-1", now_ms=1) is True
    assert store.take_allowed("SER1", "pi-2", now_ms=2) is False and store.allow_used_by("SER1") == "pi-1"
    assert not store.vouched_for(serial="SER1", token="", now_ms=3)


def test_an_operators_control_is_claimed_by_one_leader_and_applied_once(store: IdentityStore) -> None:
    first = store.add_control("approve", "pi-1", by="op", now_ms=1)
    second = store.add_control("revoke", "pi-2", by="op", now_ms=2, reason="lost")
    with pytest.raises(IdentityError, match="unknown action"):
        store.add_control("delete", "pi-3", by="op", now_ms=3)
    assert [c.id for c in store.controls()] == [first, second]
    assert store.claim(first, "gw-1") is True and store.claim(first, "gw-2") is False
    store.applied(first, ok=True, outcome="approved", now_ms=4)
    assert [c.id for c in store.controls()] == [second]
    done = store.control(first)
    assert done is not None and done.ok is True and done.outcome == "approved"


def test_pending_records_not_asked_for_are_forgotten(store: IdentityStore) -> None:
    ask(store, "pi-1", now_ms=1000)
    ask(store, "pi-2", now_ms=5000)
    assert store.expire_pending(asked_before_ms=2000) == ["pi-1"]
    assert store.get("pi-1") is None and store.get("pi-2") is not None
