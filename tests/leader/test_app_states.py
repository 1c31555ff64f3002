"""What each device's applications run and what it is (arch, board, os), as its full heartbeats
say: kept by the registry on leader.db and on PostgreSQL, shown by `status DEVICE`, and read by
the application kind for each device's version before a rollout."""

from __future__ import annotations

from pathlib import Path

from apps_support import app_dir, fleet_key

from agent.core.clock import VirtualClock
from agent.core.sql import store_target
from agent.leader.readonly import open_leader_db
from agent.leader.registry import AppCounts, DeviceRegistry
from agent.leader.status import fleet_status, format_status
from agent.protocol import AppState, Heartbeat
from app_rollout.bundle import build_bundle
from app_rollout.kind import AppKind
from rollout_engine.plan import DeviceInfo


def test_the_registry_keeps_what_each_application_runs(leader_store: Path | str) -> None:
    clock = VirtualClock()
    with DeviceRegistry.open(leader_store, clock=clock) as reg:
        two, one = AppState(version="2.0.0", previous="1.0.0"), AppState(version="1.0.0", health="failed")
        reg.apply_heartbeats([Heartbeat(device_id="pi-1", seq=1, uptime_s=1.0, apps={"hello": two},
                                        facts={"arch": "aarch64", "board": "Raspberry Pi 4 Model B"}),
                              Heartbeat(device_id="pi-2", seq=1, uptime_s=1.0, apps={"hello": one}),
                              Heartbeat(device_id="pi-3", seq=1, uptime_s=1.0)])
        # a short heartbeat keeps what the full one said; so does a full one of a new boot whose
        # application helper has not answered yet (apps not known: None), not an empty list
        reg.apply_heartbeats([Heartbeat(device_id="pi-1", seq=2, uptime_s=2.0, full=False)])
        reg.apply_heartbeats([Heartbeat(device_id="pi-1", seq=3, uptime_s=0.1, boot="second",
                                        facts={"arch": "aarch64", "board": "Raspberry Pi 4 Model B"})])
        states = reg.app_states()
        assert states == {"pi-1": {"hello": AppState(version="2.0.0", previous="1.0.0")},
                          "pi-2": {"hello": AppState(version="1.0.0", health="failed")}}
        kind = AppKind(keys=None, directory=Path("/nonexistent"),
                       versions=lambda name: {d: a[name].version for d, a in reg.app_states().items() if name in a})
        assert kind.versions is not None and kind.versions("hello") == {"pi-1": "2.0.0", "pi-2": "1.0.0"}
    with open_leader_db(store_target(str(leader_store), source="test")) as db:  # what `status pi-1` reads
        found = db.registry.device("pi-1")
        assert found is not None and found[1].apps == states["pi-1"]
        lines = device_lines(db, "pi-1")
        assert lines[-2:] == ["  applications:", "    hello: 2.0.0; 1.0.0 kept to go back to"]
        assert "  is: arch aarch64, board Raspberry Pi 4 Model B" in lines  # what it says it is
        assert found[0].facts == {"arch": "aarch64", "board": "Raspberry Pi 4 Model B"}
        # the fleet: each application's versions, what `status` and the console's fleet page say
        fleet = fleet_status(db, 0)
        assert fleet.apps == {"hello": AppCounts(versions={"1.0.0": 1, "2.0.0": 1}, on_trial=0, took_back=1)}
        assert "app hello: 1.0.0 x1, 2.0.0 x1 (1 took their last new version back)" in format_status(fleet)


def device_lines(db: object, device: str) -> list[str]:
    from agent.commands.status import format_device
    from agent.leader.fleet_view import device_detail

    detail = device_detail(db, device)  # type: ignore[arg-type]
    assert detail is not None
    return format_device(detail, 0).splitlines()


def test_held_names_the_version_each_device_runs(tmp_path: Path) -> None:
    key, _, _ = fleet_key(tmp_path / "keys")
    head = build_bundle(app_dir(tmp_path / "hello", version="2.0.0"), key, tmp_path / "hello.eaapp").head
    kind = AppKind(keys=key.public, directory=tmp_path / "a",
                   versions=lambda name: {"pi-1": "2.0.0", "pi-2": "1.0.0"} if name == "hello" else {})
    devices = [DeviceInfo(d, "", (), True, 0, 0) for d in ("pi-1", "pi-2", "pi-3")]
    assert kind.held(head, devices) == {"pi-1": "2.0.0", "pi-2": "1.0.0"}
    assert not kind.traits.skips_held  # (the engine's "already on" compares firmware versions)
