"""The worker's applications: the application kind's offers applied through the root
application helper (`app_rollout.device`). On while `[apps] helper_socket` is set and
`[firmware]` names the fleet's key; the kind's modules load only then."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from agent.actors import ActorRef
from agent.service.parts import PartBase
from agent.worker.actors import LEADER
from agent.worker.agent import WorkerAgent
from agent.worker.env import DeviceEnv

if TYPE_CHECKING:
    from app_rollout.device.module import AppModule
    from rollout_engine.device import OfferRunner
    from rollout_engine.keys import Verifier


class AppsPart(PartBase):
    """The offer runner with the application module; offers and cancels routed to it."""

    name = "apps"

    def __init__(self, worker: WorkerAgent, key: Verifier, env: DeviceEnv) -> None:
        from agent.worker.hardware import system_utc_offset_s
        from app_rollout.device.client import AppHelperClient
        from app_rollout.device.module import AppModule
        from rollout_engine.device import OfferRunner
        from rollout_engine.messages import RolloutReport, report_message

        self.worker = worker
        apps = worker.config.apps
        state_dir = Path(apps.state_dir) if Path(apps.state_dir).is_absolute() else worker.data_dir / apps.state_dir
        fw = worker.config.firmware
        if env.apps_hardware is not None:
            helper, fetch = env.apps_hardware(worker)
            self.module: AppModule = AppModule(helper, key=key, state_dir=state_dir, clock=worker.clock, fetch=fetch)
        else:
            self.module = AppModule(AppHelperClient(apps.helper_socket, clock=worker.clock), key=key,
                                    state_dir=state_dir, clock=worker.clock, mirror_timeout_s=fw.mirror_timeout_s,
                                    mirror_ca=fw.mirror_ca)

        async def send(report: RolloutReport) -> None:
            await worker.outbox.enqueue(report_message(report, msg_id=worker.ids.next(), receiver=LEADER))

        self.runner: OfferRunner = OfferRunner(self.module, device_id=worker.device_id, key=key, clock=worker.clock,
                                               state_dir=state_dir, send=send, utc_offset_s=system_utc_offset_s,
                                               excerpt=worker.failure_logs)
        self.ref: ActorRef | None = None

    async def start(self) -> None:
        from app_rollout.messages import KIND_APP_CANCEL, KIND_APP_OFFER, AppOffer
        from rollout_engine.device import Resume
        from rollout_engine.messages import RolloutCancel

        worker = self.worker
        worker.app_states = self.module.states
        self.ref = worker.system.spawn(self.runner, name="app-offers", capacity=8, policy="reject")
        self.ref.tell(Resume())
        worker.register_command(KIND_APP_OFFER, AppOffer, self.ref)
        worker.register_command(KIND_APP_CANCEL, RolloutCancel, self.ref)

    async def stop(self) -> None:
        self.module.helper.close()


async def apps_part(worker: WorkerAgent, env: DeviceEnv) -> AppsPart | None:
    """Applications, when `[apps] helper_socket` (or the simulator's helper) and the fleet's key
    are set; else None."""
    config = worker.config
    if not (config.apps.helper_socket or env.apps_hardware is not None) or not config.firmware.keyed:
        return None
    from agent.worker.fleet_keys import fleet_keys

    part = worker.kind_parts["app"] = AppsPart(worker, await asyncio.to_thread(fleet_keys, worker), env)
    return part


__all__ = ["AppsPart", "apps_part"]
