"""A small rollout kind of the test suite's own: a named file, written on each device.

It shows what a new kind takes: this one module (its traits, its leader side, its worker part), one
line in the leader's table (`{**ROLLOUT_KINDS, "file": KindEntry(FILE, FileKind)}`) and its part
beside the worker's. Nothing of the engine changes.

    a release   JSON {"name": "motd", "version": "1.1.0", "content": "..."} (`.file.json`)
    leader      admits it (checks the fields), offers it as `file.offer`, cancels as `file.cancel`
    device      waits for its maintenance window (a timer and a message, canceled by a cancel),
                writes `files/<name>` under the worker's data directory, reports each step
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from agent.actors import Actor, ActorRef, Context
from agent.core.clock import TimerHandle
from agent.core.codec import encode
from agent.core.errors import EdgeAgentError, RolloutError
from agent.core.files import atomic_write
from agent.service.parts import PartBase
from agent.worker.actors import LEADER
from agent.worker.agent import WorkerAgent
from rollout_engine.kinds import Admitted, Described, KindTraits, OfferContext, Outgoing
from rollout_engine.messages import ReportState, RolloutCancel, RolloutReport, report_message
from rollout_engine.plan import DeviceInfo
from rollout_engine.store import DeviceRow, RolloutRow
from rollout_engine.version import Version
from rollout_engine.windows import parse_window, window_wait

log = logging.getLogger(__name__)

KIND_FILE_OFFER = "file.offer"
KIND_FILE_CANCEL = "file.cancel"
SUFFIX = ".file.json"


class FileRelease(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]
    version: Annotated[str, msgspec.Meta(max_length=64)]
    content: Annotated[str, msgspec.Meta(max_length=4096)]


def parse(data: bytes, source: str) -> FileRelease:
    try:
        release = msgspec.json.decode(data, type=FileRelease)
        Version.parse(release.version)
    except (msgspec.DecodeError, EdgeAgentError) as exc:
        raise RolloutError(f"file release {source}: {exc}") from None
    return release


def describe(path: Path) -> Described:
    try:
        release = parse(path.read_bytes()[:8192], str(path))
    except OSError as exc:
        raise RolloutError(f"file release {path}: {exc.strerror}") from None
    return Described(name=release.name, version=release.version, size=len(release.content.encode()),
                     what=f"file {release.name}")


FILE = KindTraits(name="file", installs="file", cancel_kind=KIND_FILE_CANCEL, describe=describe,
                  file_suffixes=(SUFFIX,))


class FileOffer(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    rollout_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    release: Annotated[bytes, msgspec.Meta(max_length=8192)]
    maintenance_windows: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=16)], ...],
                                   msgspec.Meta(max_length=16)] = ()


class FileKind:
    """The kind on a leader (made by the table's factory from the leader it runs in)."""

    traits = FILE

    def __init__(self, _host: object) -> None:
        pass

    def admit(self, artifact: str, *, undone: RolloutRow | None) -> Admitted:
        try:
            data = Path(artifact).read_bytes()[:8193]
        except OSError as exc:
            raise RolloutError(f"file release {artifact}: {exc.strerror}") from None
        return Admitted(version=parse(data, artifact).version, artifact=artifact, release=data)

    def held(self, release: bytes, devices: Sequence[DeviceInfo]) -> dict[str, str]:
        return {}  # (its devices do not say what they hold: every target is offered it)

    def offers(self, r: RolloutRow, devices: Sequence[DeviceRow], context: OfferContext) -> list[Outgoing]:
        offer = encode(FileOffer(rollout_id=r.id, release=r.signed_manifest,
                                 maintenance_windows=tuple(r.spec.device.maintenance_windows)))
        return [Outgoing(d.device_id, KIND_FILE_OFFER, offer, key=f"file.offer:{r.id}") for d in devices]

    def in_sync(self, release: bytes, devices: Sequence[str]) -> set[str]:
        return set()


# -- the worker part ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _WindowOpen:
    rollout_id: str


class FileOfferActor(Actor):
    def __init__(self, worker: WorkerAgent) -> None:
        self.worker = worker
        self.directory = Path(worker.data_dir) / "files"
        self._seq = 0
        self._waiting: dict[str, tuple[FileOffer, TimerHandle]] = {}

    async def receive(self, message: object, ctx: Context) -> None:
        if isinstance(message, FileOffer):
            await self._offer(message, ctx, window_open=False)
        elif isinstance(message, _WindowOpen):
            waiting = self._waiting.pop(message.rollout_id, None)
            if waiting is not None:
                await self._offer(waiting[0], ctx, window_open=True)
        elif isinstance(message, RolloutCancel):
            waiting = self._waiting.pop(message.rollout_id, None)
            if waiting is not None:
                waiting[1].cancel()
                release = msgspec.json.decode(waiting[0].release, type=FileRelease)
                await self._report(message.rollout_id, release.version, "canceled",
                                   f"canceled while waiting for its window: {message.reason}")

    async def on_stop(self, ctx: Context) -> None:
        for _, timer in self._waiting.values():
            timer.cancel()

    async def _offer(self, offer: FileOffer, ctx: Context, *, window_open: bool) -> None:
        rid = offer.rollout_id
        try:
            release = parse(offer.release, f"the release of {rid}")
            windows = [parse_window(w) for w in offer.maintenance_windows]
        except (RolloutError, ValueError) as exc:
            await self._report(rid, "", "rejected", str(exc))
            return
        clock = self.worker.clock
        wait_s, until = window_wait(windows, clock.now_ms(), 0.0)
        if wait_s > 0 and not window_open:
            def open_window() -> None:
                with contextlib.suppress(EdgeAgentError):
                    ctx.self.tell(_WindowOpen(rid))

            self._waiting[rid] = (offer, clock.call_later(wait_s, open_window))
            await self._report(rid, release.version, "waiting_window", until,
                               until_ms=clock.now_ms() + int(wait_s * 1000))
            return
        await self._report(rid, release.version, "installing", f"writing {release.name}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(self.directory / release.name, release.content.encode())
        except OSError as exc:
            await self._report(rid, release.version, "failed", f"cannot write {release.name}: {exc.strerror}")
            return
        await self._report(rid, release.version, "succeeded", f"{release.name} {release.version} written")

    async def _report(self, rollout_id: str, version: str, state: ReportState, detail: str, *,
                      until_ms: int = 0) -> None:
        worker = self.worker
        now = worker.clock.now_ms()
        self._seq = max(self._seq + 1, now)
        report = RolloutReport(device=worker.device_id, rollout_id=rollout_id, version=version, state=state,
                               phase=state, detail=detail, ts_ms=now, seq=self._seq, until_ms=until_ms)
        await worker.outbox.enqueue(report_message(report, msg_id=worker.ids.next(), receiver=LEADER))


class FilePart(PartBase):
    """The kind's worker part: its actor, the offers and cancels routed to it."""

    name = "files"

    def __init__(self, worker: WorkerAgent) -> None:
        self.worker = worker
        self.ref: ActorRef | None = None

    async def start(self) -> None:
        worker = self.worker
        self.ref = worker.system.spawn(FileOfferActor(worker), name="file-offers", capacity=8, policy="reject")
        worker.register_command(KIND_FILE_OFFER, FileOffer, self.ref)
        worker.register_command(KIND_FILE_CANCEL, RolloutCancel, self.ref)

    async def stop(self) -> None:
        """Nothing of its own: its actor stops with the worker's."""
