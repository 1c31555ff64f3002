"""An application offer on a device: the offer runner's module for the application kind.

    offer ─► the head verified (the fleet's key) ─► running that version already: succeeded
        └─► fetch the bundle (mirrors, resumed) ─► the helper installs it beside the running one
            ─► the helper starts it on trial ─► its health check (within health.timeout_s)
                ├─ healthy:   commit (the version before kept to go back to) ─► succeeded
                └─ unhealthy: revert (the version before started again)     ─► failed, saying why

Each trial is in a journal (`trials/NAME.json`) before the helper starts it: a device stopped or
cut off during the check checks it again at its next start, and an application the helper has on
trial that no journal names is taken back. A release holds its applications on trial until all
its parts are healthy (`hold`); a held trial a start finds is left to the release, which commits
it or takes it back (`settle_held`).

Health checks, each within the bundle's `timeout_s`:

    active    the unit active and not restarted for `settle_s`
    http      the unit active, then a 2xx answer from its loopback URL, then `settle_s` more active
    command   the unit active for `settle_s`, then its command exits 0 (run as the application)
    container the unit active for `settle_s`, then the container's own healthcheck passes (asked
              again until it does: the image's start period is its own)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import msgspec

from agent.core.clock import Clock
from agent.core.errors import EdgeAgentError
from agent.core.files import atomic_write
from agent.protocol import AppState
from app_rollout.bundle import HEAD_MAX, AppManifest, SignedApp, peek_head, verify_head
from app_rollout.device.fetch import Fetched, Reuse, fetch_bundle
from app_rollout.device.helper import AppRecord, AppReply
from app_rollout.errors import AppBundleError, AppInstallError
from app_rollout.messages import AppOffer
from app_rollout.unit import service_name
from rollout_engine.device import Facts, Rejected, Reporter
from rollout_engine.keys import Verifier

log = logging.getLogger(__name__)

TRIAL = "trial.json"  # the one trial journal of agents before releases (read, never written)
TRIALS = "trials"
POLL_S = 0.5


class _Trial(msgspec.Struct, frozen=True):
    rollout_id: str
    name: str
    version: str
    head: bytes
    release: bool = False  # held by a release: its start settles it


@dataclass
class AppFigures:
    """What the last apply took (the benchmark reads it)."""

    bytes_fetched: int = 0
    bytes_reused: int = 0  # of the files of the version it ran, not fetched
    fetch_s: float = 0.0
    install_s: float = 0.0
    health_s: float = 0.0


class AppHelperPort(Protocol):
    """The application helper as the module asks it (`AppHelperClient`; the simulator's runs in
    the agent's process)."""

    known: dict[str, AppRecord] | None
    root: str

    async def ask(self, op: str, name: str = "", **fields: object) -> AppReply: ...

    async def records(self) -> dict[str, AppRecord]: ...

    def close(self) -> None: ...


class Fetch(Protocol):
    async def __call__(self, mirrors: Sequence[str], digest: str, size: int, directory: Path, *, head: bytes,
                       manifest: AppManifest, reuse: Reuse | None = None, timeout_s: float = 10.0,
                       ca: str = "") -> Fetched: ...


class AppModule:
    """Applies application offers through the helper `helper`; keeps downloads and the trial
    journal in `state_dir`; `fetch` brings a bundle from the mirrors (`fetch_bundle`)."""

    offer_type = AppOffer

    def __init__(self, helper: AppHelperPort, *, key: Verifier, state_dir: Path, clock: Clock,
                 mirror_timeout_s: float = 10.0, mirror_ca: str = "", fetch: Fetch = fetch_bundle) -> None:
        self.helper = helper
        self.fetch = fetch
        self.key = key
        self.state_dir = state_dir
        self.clock = clock
        self.mirror_timeout_s = mirror_timeout_s
        self.mirror_ca = mirror_ca
        self.figures = AppFigures()
        self.health: dict[str, str] = {}  # application -> its last trial's outcome: healthy, failed

    def facts(self, offer: AppOffer) -> Facts:
        try:
            head = peek_head(offer.head)
        except AppBundleError:
            return Facts(rollout_id=offer.rollout_id, version="?", windows=offer.maintenance_windows,
                         trust=offer.trust)
        return Facts(rollout_id=offer.rollout_id, version=head.version, windows=offer.maintenance_windows,
                     trust=offer.trust, units=(service_name(head.name),))

    def check(self, offer: AppOffer) -> SignedApp:
        try:
            return verify_head(offer.head, self.key, source=f"the bundle of {offer.rollout_id}")
        except AppBundleError as exc:
            raise Rejected(str(exc)) from None

    async def apply(self, offer: AppOffer, app: SignedApp, report: Reporter, *,
                    hold: Callable[[], Awaitable[str]] | None = None) -> None:
        """Install, start on trial, check; commit or take back. `hold`: once healthy, asked
        whether to commit ("") or take it back (why): a release commits its parts together."""
        rid, name, version = offer.rollout_id, app.name, app.version
        if app.manifest.runtime == "removed":
            await self._remove(rid, app, report)
            return
        try:
            record = (await self.helper.records()).get(name)
            if record is not None and record.current == version and not record.trial:
                await self.helper.ask("start", name, version=version)  # running, as it must be
                if hold is not None:
                    await hold()  # (nothing of its own to take back)
                await report(rid, version, "succeeded", "running", f"{name} {version} runs already")
                return
            await report(rid, version, "installing", "downloading", f"fetching {name} {version} ({app.size} bytes)")
            started = self.clock.monotonic()
            fetched = await self.fetch(offer.mirrors, offer.bundle, offer.size, self.state_dir / "downloads",
                                         head=app.head, manifest=app.manifest,
                                         reuse=self._running_files(name, record.current if record else ""),
                                         timeout_s=self.mirror_timeout_s, ca=self.mirror_ca)
            self.figures = AppFigures(bytes_fetched=fetched.bytes_fetched, bytes_reused=fetched.bytes_reused,
                                      fetch_s=self.clock.monotonic() - started)
            await report(rid, version, "installing", "installing",
                         f"installing {name} {version} (fetched {fetched.bytes_fetched} bytes)")
            started = self.clock.monotonic()
            await self.helper.ask("install", path=str(fetched.path))
            fetched.path.unlink(missing_ok=True)
            self._keep(_Trial(rid, name, version, app.head, release=hold is not None))
            await self.helper.ask("start", name, version=version)
            self.figures.install_s = self.clock.monotonic() - started
        except (AppInstallError, OSError) as exc:
            log.warning("application %s %s: %s", name, version, exc)
            await report(rid, version, "failed", "failed", f"{name} {version}: {exc}")
            return
        await report(rid, version, "installing", "checking", f"{name} {version} started: checking its health"
                                                              f" ({app.manifest.health.check})")
        await self._conclude(_Trial(rid, name, version, app.head, release=hold is not None), app,
                             record.current if record else "", report, hold)

    async def _remove(self, rid: str, removal: SignedApp, report: Reporter) -> None:
        """The signed removal of an application: the helper stops it and removes its versions
        (its data kept); a device that does not run it has nothing to do."""
        name, version = removal.name, removal.version
        try:
            record = (await self.helper.records()).get(name)
            if record is None or not record.installed:
                gone = f"removed at {record.removed}" if record is not None and record.removed else "not installed"
                await report(rid, version, "succeeded", "removed", f"{name} is {gone} here: nothing to remove")
                return
            await report(rid, version, "installing", "removing", f"removing {name} {record.current}")
            await self.helper.ask("remove", name, head=removal.head)
        except AppInstallError as exc:
            log.warning("application %s: removal %s: %s", name, version, exc)
            await report(rid, version, "failed", "failed", f"{name}: {exc}")
            return
        self.health.pop(name, None)
        await report(rid, version, "succeeded", "removed", f"{name} {record.current} stopped and removed (its data"
                                                           f" kept in /var/lib/edge-apps/{name})")

    async def _conclude(self, trial: _Trial, app: SignedApp, before: str, report: Reporter,
                        hold: Callable[[], Awaitable[str]] | None = None) -> None:
        """The trial's health checked (and, held by a release, its word); committed or taken
        back, and said."""
        rid, name, version = trial.rollout_id, trial.name, trial.version
        started = self.clock.monotonic()
        try:
            why = await self.unhealthy(app)
        except AppInstallError as exc:
            why = str(exc)
        self.figures.health_s = self.clock.monotonic() - started
        held_back = False
        if not why and hold is not None:
            await report(rid, version, "verifying", "held", f"{name} {version} healthy: held for the release")
            why = await hold()
            held_back = bool(why)
            started = self.clock.monotonic()
        try:
            if not why:
                await self.helper.ask("commit", name)
            else:
                await self.helper.ask("revert", name)
        except AppInstallError as exc:
            await report(rid, version, "failed", "failed", f"{name} {version}: {exc}")
            return
        finally:
            self._forget(name)
        self.health[name] = "failed" if why else "healthy"
        f = self.figures
        said = (f"fetched {f.bytes_fetched} bytes, reused {f.bytes_reused} in {f.fetch_s:.1f} s; installed and"
                f" started in {f.install_s:.1f} s; health {f.health_s:.1f} s")
        if not why:
            await report(rid, version, "succeeded", "running", f"{name} {version} runs and is healthy ({said})")
            return
        back = f"back on {before}" if before else "removed"
        taken = f"taken back in {self.clock.monotonic() - started - (0 if held_back else f.health_s):.1f} s"
        if held_back:
            await report(rid, version, "failed", "release", f"{name} {version} healthy, taken back with its release"
                                                             f" ({why}); {back} ({said}; {taken})")
            return
        log.warning("application %s %s unhealthy (%s): %s", name, version, why, back)
        await report(rid, version, "failed", "health",
                     f"{name} {version} failed its health check: {why}; {back} ({said}; {taken})")

    def _running_files(self, name: str, version: str) -> Reuse:
        """The files and chunks of the version `name` runs (the helper's copy, readable), for
        the fetch to copy instead of downloading; none when they cannot be read. Each copy is
        checked against its hash as it is made."""
        if not version or not self.helper.root:
            return Reuse.none()
        kept = Path(self.helper.root) / name / version
        try:
            manifest = peek_head((kept / "head").read_bytes()[:HEAD_MAX])
        except (OSError, AppBundleError):
            return Reuse.none()
        return Reuse.of(manifest, kept / "files")

    async def unhealthy(self, app: SignedApp) -> str:
        """Why the application on trial is not healthy ("" when it is), within its timeout."""
        health = app.manifest.health
        name = app.name
        deadline = self.clock.monotonic() + health.timeout_s
        first = await self.helper.ask("state", name)
        restarts = first.restarts
        steady_since: float | None = None
        answered = health.check != "http"
        last = ""
        while self.clock.monotonic() < deadline:
            state = await self.helper.ask("state", name)
            if state.restarts > restarts or state.active == "failed":
                return (f"the unit {state.active} ({state.sub}): its process ended {state.result} (status"
                        f" {state.status}), restarted {state.restarts} times")
            if state.active == "active":
                if not answered:
                    answered, last = await _http_ok(health.url, timeout_s=min(5.0, health.timeout_s))
                    if answered:
                        steady_since = self.clock.monotonic()
                elif steady_since is None:
                    steady_since = self.clock.monotonic()
                if answered and steady_since is not None and self.clock.monotonic() - steady_since >= health.settle_s:
                    if health.check not in ("command", "container"):
                        return ""
                    check = await self.helper.ask("check", name)
                    if check.exit_code == 0:
                        return ""
                    last = f"{check.exit_code}: {check.output.strip()[-200:]}"
                    if health.check == "command":
                        return f"its command exited {last}"
                    # (a container's check runs until it passes: its start period is the image's)
            else:
                steady_since = None
            await self.clock.sleep(POLL_S)
        if health.check == "http" and not answered:
            return f"{health.url} did not answer 2xx within {health.timeout_s:g}s ({last or 'no answer'})"
        if health.check == "container" and last:
            return f"its container's healthcheck did not pass within {health.timeout_s:g}s (last exit {last})"
        return f"not active for {health.settle_s:g}s within {health.timeout_s:g}s"

    def states(self) -> dict[str, AppState] | None:
        """What each application runs, for the heartbeat (None: the helper has not answered yet)."""
        known = self.helper.known
        if known is None:
            return None
        installed = [(name, r) for name, r in sorted(known.items()) if r.installed][:64]
        return {name: AppState(version=r.current, previous=r.previous, trial=r.trial,
                               health=self.health.get(name, "")) for name, r in installed}

    async def resume(self, report: Reporter) -> None:
        """A trial a stop interrupted is checked again; one no journal names is taken back; one a
        release held is left to the release's start (`settle_held`)."""
        trials = self._journals()
        try:
            records = await self.helper.records()
        except AppInstallError as exc:
            log.warning("applications: the helper does not answer at the start (%s)", exc)
            return
        for name, record in records.items():
            if record.trial and name not in trials:
                log.warning("application %s %s was on trial with no journal: taken back", name, record.trial)
                try:
                    await self.helper.ask("revert", name)
                except AppInstallError as exc:
                    log.warning("application %s: %s", name, exc)
        for name, trial in trials.items():
            held = records.get(name)
            if held is None or held.trial != trial.version:
                self._forget(name)
                continue
            if trial.release:
                continue
            try:
                app = verify_head(trial.head, self.key, source=f"the trial of {name}")
            except AppBundleError as exc:
                log.warning("the trial of %s: %s: taken back", name, exc)
                await self.helper.ask("revert", name)
                self._forget(name)
                continue
            await report(trial.rollout_id, trial.version, "installing", "checking",
                         f"{name} {trial.version} on trial at the start: checking its health")
            await self._conclude(trial, app, held.current, report)

    def held(self) -> dict[str, str]:
        """application -> the version a release holds on trial (as the journals say)."""
        return {name: t.version for name, t in self._journals().items() if t.release}

    async def settle_held(self, name: str, *, commit: bool) -> str:
        """A trial a release held committed or taken back; "" done, else why not."""
        trial = self._journals().get(name)
        if trial is None or not trial.release:
            return ""
        try:
            await self.helper.ask("commit" if commit else "revert", name)
        except AppInstallError as exc:
            return f"{name} {trial.version}: {exc}"
        self._forget(name)
        self.health[name] = "healthy" if commit else "failed"
        return ""

    # -- the journals ----------------------------------------------------------------------------
    def _journals(self) -> dict[str, _Trial]:
        """application -> its trial, as journaled (an agent's older single journal too)."""
        found: dict[str, _Trial] = {}
        paths = [self.state_dir / TRIAL]
        with contextlib.suppress(OSError):
            paths += sorted((self.state_dir / TRIALS).glob("*.json"))
        for path in paths:
            try:
                trial = msgspec.json.decode(path.read_bytes(), type=_Trial)
            except FileNotFoundError:
                continue
            except (OSError, msgspec.DecodeError) as exc:
                log.warning("%s: unreadable (%s)", path, exc)
                continue
            found[trial.name] = trial
        return found

    def _keep(self, trial: _Trial) -> None:
        (self.state_dir / TRIALS).mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(self.state_dir / TRIALS / f"{trial.name}.json", msgspec.json.encode(trial), mode=0o600)

    def _forget(self, name: str) -> None:
        (self.state_dir / TRIALS / f"{name}.json").unlink(missing_ok=True)
        legacy = self.state_dir / TRIAL
        with contextlib.suppress(OSError, msgspec.DecodeError):
            if msgspec.json.decode(legacy.read_bytes(), type=_Trial).name == name:
                legacy.unlink()


async def _http_ok(url: str, *, timeout_s: float) -> tuple[bool, str]:
    """Whether a GET of the loopback `url` answers 2xx, and what it answered."""
    parts = urlsplit(url)
    host = (parts.hostname or "127.0.0.1").strip("[]")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, parts.port or 80), timeout_s)
    except (OSError, TimeoutError) as exc:
        return False, f"{type(exc).__name__}: {exc}"[:120]
    try:
        path = parts.path or "/"
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {parts.netloc}\r\nUser-Agent: edge-agent\r\n\r\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (OSError, TimeoutError, EdgeAgentError) as exc:
        return False, f"{type(exc).__name__}"
    finally:
        writer.close()
    status = line.decode(errors="replace").strip()
    fields = status.split()
    return len(fields) >= 2 and fields[1].startswith("2"), status[:80]


__all__ = ["AppFigures", "AppModule"]
