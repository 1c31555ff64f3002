"""Applications as a rollout kind (`rollout_engine.kinds`): a signed bundle, checked whole and
kept by the leader under its sha256 (`{sha256}.eaapp`, what its artifact server and any mirror
serve), offered as an `AppOffer` with the bundle's signed head and the mirrors, canceled as
`app.cancel`. A device fetches the bundle, checks every file against the head, and installs,
starts and checks it through its application helper (`app_rollout.device`)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.core.codec import encode
from agent.core.errors import RolloutError
from app_rollout.bundle import SUFFIX, AppBundleError, peek_head, read_bundle, read_head
from app_rollout.messages import KIND_APP_CANCEL, KIND_APP_OFFER, AppOffer
from rollout_engine.keys import Verifier
from rollout_engine.kinds import Admitted, Described, KindTraits, OfferContext, Outgoing
from rollout_engine.plan import DeviceInfo
from rollout_engine.store import DeviceRow, RolloutRow
from rollout_engine.version import Version, ahead_of


def describe_bundle(path: Path) -> Described:
    """A bundle's manifest, read (not verified)."""
    try:
        m = peek_head(read_head(path))
    except AppBundleError as exc:
        raise RolloutError(f"application bundle {path}: {exc}") from None
    if m.runtime == "removed":
        return Described(name=m.name, version=m.version, size=0, lane=m.name,
                         what=f"removal of application {m.name}: stopped, its versions removed, its data kept",
                         installs=f"the removal of application {m.name} at {m.version}")
    n = len(m.files)
    kind = "container application" if m.container else "application"
    return Described(name=m.name, version=m.version, size=m.payload_size, lane=m.name,
                     what=f"{kind} {m.name}: {n} file{'s' if n != 1 else ''}, health {m.health.check}",
                     installs=f"application {m.name} {m.version}")


def check_going_forward(bundle: Described, source: str, targets: Sequence[DeviceInfo]) -> list[str]:
    """Every device refuses a version of an application below the one it runs, and a removal not
    above it: a rollout that every targeted device would refuse could only fail (refused); some
    of them: a warning naming how many (returned)."""
    try:
        removal = peek_head(read_head(source)).runtime == "removed"
    except AppBundleError as exc:
        raise RolloutError(f"application bundle {source}: {exc}") from None
    running = [version for t in targets if (version := dict(t.apps).get(bundle.name, ""))]
    ahead = ahead_of(bundle.version, running, or_equal=removal)
    if not ahead:
        return []
    what = f"{source} is {bundle.installs}"
    if len(ahead) == len(targets):
        raise RolloutError(f"{what}, not above what every targeted device runs ({', '.join(sorted(set(ahead)))}): each"
                           f" would refuse it (an application goes forward: build the content again as a version"
                           f" above {max(ahead, key=Version.parse)})")
    return [f"{what}, not above what {len(ahead)} of the {len(targets)} targeted devices run: they will refuse it"
            " (failures that count against the rollout's gates)"]


def bundle_lane(release: bytes) -> str:
    """A rollout of a bundle holds its application on a device (others may roll out beside)."""
    try:
        return peek_head(release).name
    except AppBundleError:
        return ""


APP = KindTraits(name="app", installs="application", cancel_kind=KIND_APP_CANCEL, describe=describe_bundle,
                 file_suffixes=(SUFFIX,), lane=bundle_lane, check_targets=check_going_forward)


def bundle_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def keep_bundle(keys: Verifier | None, directory: Path, source: str) -> tuple[Path, bytes]:
    """A bundle checked whole as a device checks it, kept in `directory` as `{sha256}.eaapp`:
    (the copy, its signed head). A `RolloutError` says why not."""
    if keys is None:
        raise RolloutError(f"cannot check application bundle {source}: the leader's config has no [firmware]"
                           " public_key or trust_root (the fleet's key, as the devices pin it)")
    directory.mkdir(parents=True, exist_ok=True, mode=0o750)
    partial = directory / f".{os.getpid()}-{Path(source).name}.partial"
    try:
        shutil.copyfile(source, partial)  # checked as copied: the source may change meanwhile
        app = read_bundle(partial, keys)
        kept = directory / f"{bundle_digest(partial)}{SUFFIX}"
        os.chmod(partial, 0o640)
        os.replace(partial, kept)
    except AppBundleError as exc:
        raise RolloutError(str(exc).replace(str(partial), source)) from None
    except OSError as exc:
        raise RolloutError(f"application bundle {source}: {exc.strerror or exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return kept, app.head


class AppKind:
    """Applications on a leader: bundles checked against `keys` (the fleet's, as devices pin
    them) and kept in `directory`."""

    traits = APP

    def __init__(self, *, keys: Verifier | None, directory: Path,
                 versions: Callable[[str], dict[str, str]] | None = None) -> None:
        self.keys = keys
        self.directory = directory
        self.versions = versions  # application -> device -> the version it runs, as its heartbeats say

    def admit(self, artifact: str, *, undone: RolloutRow | None) -> Admitted:
        kept, head = keep_bundle(self.keys, self.directory, artifact)
        return Admitted(version=peek_head(head).version, artifact=str(kept), release=head)

    def held(self, release: bytes, devices: Sequence[DeviceInfo]) -> dict[str, str]:
        """device -> the version of the application it runs (each rollout's `from_version`; a
        device offered the version it runs answers `succeeded` at once)."""
        if self.versions is None:
            return {}
        running = self.versions(peek_head(release).name)
        return {d.device_id: running[d.device_id] for d in devices if d.device_id in running}

    def offers(self, r: RolloutRow, devices: Sequence[DeviceRow], context: OfferContext) -> list[Outgoing]:
        path = Path(r.artifact)
        offer = encode(AppOffer(rollout_id=r.id, head=r.signed_manifest, bundle=path.name.removesuffix(SUFFIX),
                                size=path.stat().st_size if path.exists() else 0, mirrors=context.mirrors,
                                maintenance_windows=tuple(r.spec.device.maintenance_windows), trust=context.trust))
        return [Outgoing(d.device_id, KIND_APP_OFFER, offer, key=f"app.offer:{r.id}") for d in devices]

    def in_sync(self, release: bytes, devices: Sequence[str]) -> set[str]:
        return set()


__all__ = ["APP", "AppKind", "bundle_digest", "describe_bundle", "keep_bundle"]
