"""A small rollout kind of the test suite's own: a named file, written on each device.

It shows what a new kind takes: this one module (its traits, its leader side, its worker part), one
line in the leader's table (`{**ROLLOUT_KINDS, "file": KindEntry(FILE, FileKind)}`) and its part
beside the worker's. Nothing of the engine changes.

    a release   JSON {"name": "motd", "version": "1.1.0", "content": "..."} (`.file.json`)
    leader      admits it (checks the fields), offers it as `file.offer`, cancels as `file.cancel`
    device      a module of the device's offer runner (`rollout_engine.device`: trust, the
                maintenance window, cancels, the report sequence are the runner's): it writes
                `files/<name>` under the worker's data directory
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import msgspec

from agent.actors import ActorRef
from agent.core.codec import encode
from agent.core.errors import EdgeAgentError, RolloutError
from agent.core.files import atomic_write
from agent.service.parts import PartBase
from agent.worker.actors import LEADER
from agent.worker.agent import WorkerAgent
from rollout_engine.device import Facts, OfferRunner, Rejected, Reporter, Resume
from rollout_engine.keys import Verifier
from rollout_engine.kinds import Admitted, Described, KindTraits, OfferContext, Outgoing
from rollout_engine.messages import RolloutCancel, RolloutReport, report_message
from rollout_engine.plan import DeviceInfo
from rollout_engine.store import DeviceRow, RolloutRow
from rollout_engine.version import Version

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
                     what=f"file {release.name}", installs=f"file {release.name} {release.version}")


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


# -- the worker part: a module of the device's offer runner ---------------------------------------
class FileModule:
    """Writes the release's file under `directory` (its check: the release parses)."""

    offer_type = FileOffer

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def facts(self, offer: FileOffer) -> Facts:
        try:
            version = msgspec.json.decode(offer.release, type=FileRelease).version
        except msgspec.DecodeError:
            version = "?"
        return Facts(rollout_id=offer.rollout_id, version=version, windows=offer.maintenance_windows, trust=b"")

    def check(self, offer: FileOffer) -> FileRelease:
        try:
            return parse(offer.release, f"the release of {offer.rollout_id}")
        except RolloutError as exc:
            raise Rejected(str(exc)) from None

    async def apply(self, offer: FileOffer, release: FileRelease, report: Reporter) -> None:
        rid = offer.rollout_id
        await report(rid, release.version, "installing", "writing", f"writing {release.name}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(self.directory / release.name, release.content.encode())
        except OSError as exc:
            await report(rid, release.version, "failed", "failed", f"cannot write {release.name}: {exc.strerror}")
            return
        await report(rid, release.version, "succeeded", "written", f"{release.name} {release.version} written")

    async def resume(self, report: Reporter) -> None:
        """Nothing to finish: a file is written whole or not at all."""


class FilePart(PartBase):
    """The kind's worker part: the offer runner with its module, the offers and cancels routed to it."""

    name = "files"

    def __init__(self, worker: WorkerAgent, key: Verifier) -> None:
        self.worker = worker

        async def send(report: RolloutReport) -> None:
            await worker.outbox.enqueue(report_message(report, msg_id=worker.ids.next(), receiver=LEADER))

        self.runner = OfferRunner(FileModule(Path(worker.data_dir) / "files"), device_id=worker.device_id, key=key,
                                  clock=worker.clock, state_dir=Path(worker.data_dir) / "file-offers", send=send)
        self.ref: ActorRef | None = None

    async def start(self) -> None:
        worker = self.worker
        self.ref = worker.system.spawn(self.runner, name="file-offers", capacity=8, policy="reject")
        self.ref.tell(Resume())
        worker.register_command(KIND_FILE_OFFER, FileOffer, self.ref)
        worker.register_command(KIND_FILE_CANCEL, RolloutCancel, self.ref)

    async def stop(self) -> None:
        """Nothing of its own: its actor stops with the worker's."""
