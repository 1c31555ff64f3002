"""Shared helpers of the rollout tests (imported by name: the test dirs are not packages)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from agent.core.clock import VirtualClock
from config_rollout.kind import ConfigKind
from firmware_rollout.artifact.fixture import make_artifact
from firmware_rollout.orchestration.kind import FirmwareKind
from rollout_engine.keys import Verifier
from rollout_engine.kinds import Outgoing, RolloutKind
from rollout_engine.messages import RolloutReport
from rollout_engine.orchestrator import Orchestrator
from rollout_engine.plan import DeviceInfo
from rollout_engine.spec import RolloutSpec, spec_from_dict
from rollout_engine.store import RolloutStore


class FakePort:
    """The leader as the orchestrator sees it: a device table and a list of offers made."""

    def __init__(self, clock: VirtualClock, devices: Sequence[str], *, version: str = "1.0.0") -> None:
        self.clock = clock
        self.infos: dict[str, DeviceInfo] = {
            d: DeviceInfo(d, firmware_version=version, online=True, last_seen_ms=clock.now_ms(),
                          first_seen_ms=clock.now_ms() - 1000)
            for d in devices
        }
        self.offers: list[tuple[int, str, str]] = []  # (at_ms, device, rollout)
        self.kinds: list[str] = []  # the kind of each offer's rollout
        self.config_held: dict[str, dict[str, str]] = {}  # target -> device -> version
        self.cancels: list[tuple[str, str]] = []  # (device, rollout)
        self.paces: list[tuple[int, tuple[str, ...], float]] = []  # (at_ms, devices, for_s)
        self.in_sync: set[str] | None = None  # the devices in sync by their heartbeats (None: all)

    def devices(self) -> list[DeviceInfo]:
        return list(self.infos.values())

    async def send(self, messages: Sequence[Outgoing], *, ttl_ms: int) -> None:
        for m in messages:
            rollout_id = msgspec.msgpack.decode(m.payload)["rollout_id"]
            kind, _, what = m.kind.partition(".")
            if what == "cancel":
                self.cancels.append((m.device, rollout_id))
            else:
                self.offers.append((self.clock.now_ms(), m.device, rollout_id))
                self.kinds.append(kind)

    async def ask_fast_heartbeats(self, devices: Sequence[str], *, for_s: float) -> None:
        self.paces.append((self.clock.now_ms(), tuple(devices), for_s))

    def offered(self, device: str | None = None) -> list[str]:
        return [d for _, d, _ in self.offers if device is None or d == device]

    def heartbeat(self, *devices: str) -> None:
        for d in devices or tuple(self.infos):
            info = self.infos[d]
            self.infos[d] = DeviceInfo(d, info.firmware_version, info.tags, info.online, self.clock.now_ms(),
                                       info.first_seen_ms)

    def set_online(self, device: str, online: bool) -> None:
        info = self.infos[device]
        self.infos[device] = DeviceInfo(device, info.firmware_version, info.tags, online, info.last_seen_ms,
                                        info.first_seen_ms)

    def register(self, device: str, *, tags: tuple[str, ...] = (), version: str = "1.0.0") -> None:
        now = self.clock.now_ms()
        self.infos[device] = DeviceInfo(device, version, tags, True, now, now)


class PortConfigKind(ConfigKind):
    """The config kind reading what devices hold from a `FakePort` (its `config_held`, `in_sync`)
    instead of the leader's registry."""

    def __init__(self, port: FakePort, *, keys: Verifier | None, directory: Path) -> None:
        super().__init__(keys=keys, directory=directory, fleet=self)
        self.port = port

    def config_states(self) -> dict[str, Any]:
        return {}

    def held(self, release: bytes, devices: Sequence[DeviceInfo]) -> dict[str, str]:
        from config_rollout.release import peek_release

        held = self.port.config_held.get(peek_release(release).name, {})
        return {d.device_id: held[d.device_id] for d in devices if d.device_id in held}

    def in_sync(self, release: bytes, devices: Sequence[str]) -> set[str]:
        return set(devices) if self.port.in_sync is None else set(devices) & self.port.in_sync


def engine_kinds(port: FakePort | None = None, *, keys: Verifier | None = None,
               directory: Path | None = None) -> dict[str, RolloutKind]:
    """Firmware whose artifacts are served as given; with a port, config too (checked with `keys`,
    kept in `directory`)."""
    kinds: dict[str, RolloutKind] = {"firmware": FirmwareKind(None)}
    if port is not None:
        kinds["config"] = PortConfigKind(port, keys=keys, directory=directory or Path("artifacts"))
    return kinds


def spec_data(artifact: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {
        "rollout": {"name": "test", "artifact": str(artifact), "seed": 1},
        "waves": {"canary": 2, "counts": [4, 4]},
        "gates": {"success_threshold_pct": 100.0},
        "device": {"timeout_s": 100.0},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


class Harness:
    """An orchestrator on a VirtualClock and a FakePort, its loop running."""

    def __init__(self, tmp_path: Path, devices: int = 10, *, db: Path | str | None = None,
                 **sections: dict[str, Any]) -> None:
        self.tmp_path = tmp_path
        self.clock = VirtualClock()
        self.ids = [f"d{i:02d}" for i in range(devices)]
        self.port = FakePort(self.clock, self.ids)
        self.artifact, _ = make_artifact(tmp_path, chunk_size=1024, size=4096)
        self.spec_data = spec_data(self.artifact, **sections)
        self.spec: RolloutSpec = spec_from_dict(self.spec_data)
        self.db = db if db is not None else tmp_path / "leader.db"  # a file, or a postgresql:// URL
        self.store = RolloutStore.open(self.db, clock=self.clock)
        self.orch = Orchestrator(self.store, clock=self.clock, port=self.port, poll_s=1.0, kinds=engine_kinds())
        self._task: asyncio.Task[None] | None = None
        self._seq = itertools.count(1)
        self.rid = ""

    async def __aenter__(self) -> Harness:
        self._task = asyncio.get_running_loop().create_task(self.orch.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self.orch.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.store.close()

    async def restart(self) -> None:
        """Throw the orchestrator away and build a new one on the same database (a leader restart)."""
        await self.close()
        self.store = RolloutStore.open(self.db, clock=self.clock)
        self.orch = Orchestrator(self.store, clock=self.clock, port=self.port, poll_s=1.0, kinds=engine_kinds())
        await self.__aenter__()

    async def start(self, **kwargs: Any) -> str:
        self.rid = await self.orch.start_rollout(self.spec, rollout_id="r1", **kwargs)
        await self.clock.advance(0.1)
        return self.rid

    async def report(self, device: str, state: str, *, msg_id: str | None = None, seq: int | None = None,
                     detail: str = "", excerpt: tuple[str, ...] = ()) -> bool:
        n = next(self._seq)
        report = RolloutReport(device=device, rollout_id=self.rid, version="1.1.0", state=state,  # type: ignore[arg-type]
                              phase="committed" if state == "succeeded" else "downloading", detail=detail,
                              ts_ms=self.clock.now_ms(), seq=seq if seq is not None else n, excerpt=excerpt)
        changed = await self.orch.on_report(msg_id or f"m{n}", report)
        await self.clock.advance(0.01)
        return changed

    async def succeed(self, *devices: str) -> None:
        for d in devices:
            await self.report(d, "succeeded")

    def wave_members(self, idx: int) -> list[str]:
        return [d.device_id for d in self.store.devices(self.rid, wave=idx)]

    def state(self, device: str) -> str:
        row = self.store.device(self.rid, device)
        assert row is not None
        return row.state

    def rollout_state(self) -> str:
        r = self.store.get(self.rid)
        assert r is not None
        return r.state

    def wave_state(self, idx: int) -> str:
        w = self.store.wave(self.rid, idx)
        assert w is not None
        return w.state
