"""The console's HTTP server: pages, the token, the controls.

Every request needs the token: `Authorization: Bearer TOKEN`, or the session cookie a browser
gets by signing in with it on `/login` (HttpOnly, SameSite=Strict; it is an HMAC of the token,
not the token). Without either, 401 and the sign-in form. Wrong tokens (on `/login` or in a
Bearer header) are limited per address and in total (`SignInLimiter`, the total only for the
addresses that guessed wrong): beyond, 429 with
Retry-After and the token is not even compared. A control is a POST from the confirmation page
and carries a CSRF value derived from the token the same way; only a request that proves the
token itself (a valid Bearer header) goes without it, whatever other headers come along. No page
shows text taken from the URL as the console's own words: a queued control is named by its id,
a refused one is answered with the page and the reason, not a redirect. Requests are small: a
body over 4 KiB is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jinja2
import markupsafe

from agent.console import charts, data, times
from agent.core.clock import SystemClock
from agent.core.durations import ago, format_age
from agent.core.errors import ArtifactError, ConfigError, EdgeAgentError, IdentityError, RolloutError
from agent.core.sizes import format_bytes
from agent.core.sql import StoreTarget
from agent.leader.fleet_view import DeviceFilter
from agent.leader.reject_view import printable
from agent.leader.rollout import ARTIFACTS_DIR
from agent.leader.rollout_plan import plan_rollout, render_plan
from agent.protocol import SystemSample
from agent.service.http import HttpServer, Limits, RefuseBody, Request, Response
from rollout_engine.orchestrator import rollout_id_for
from rollout_engine.spec import RolloutSpec, StartControl, spec_from_dict

log = logging.getLogger(__name__)

COOKIE = "ea_console"
OPERATOR_COOKIE = "ea_operator"  # the name given at sign-in, for the audit record, with its HMAC
OPERATOR_NAME = re.compile(r"^[A-Za-z0-9 ._@-]{1,64}$")
MAX_BODY = 4096
REFRESH_S = 5
CONTROL_HELP = {
    "pause": "The leader stops offering the image; devices mid-update finish and report.",
    "resume": "The rollout goes on; the failure threshold counts afresh.",
    "cancel": "The rollout ends: devices not offered the image yet are never offered it.",
    "next": "The current wave ends now and the next one starts, whatever its gates say.",
    "approve": "The next wave, waiting for approval, starts.",
    "rollback": "The devices this rollout updated are offered the rollout's rollback artifact.",
}


SIGN_IN_WINDOW_S = 60.0
SIGN_IN_PER_ADDRESS = 5  # wrong tokens from one address within the window
SIGN_IN_TOTAL = 30  # from every address together


class SignInLimiter:
    """Wrong tokens within the last `window_s`, per address and in total: `refuse` says how long
    to wait before another try is even compared (0: go on). The total slows only the addresses
    that guessed wrong in the window: wrong tokens from anywhere never lock out a client that has
    not, so the operator's right token still works during a flood. Thread-safe (pages render in
    threads)."""

    def __init__(self, *, per_address: int = SIGN_IN_PER_ADDRESS, total: int = SIGN_IN_TOTAL,
                 window_s: float = SIGN_IN_WINDOW_S, max_addresses: int = 10_000) -> None:
        self._per_address = per_address
        self._total = total
        self._window_s = window_s
        self._max_addresses = max_addresses
        self._failed: dict[str, list[float]] = {}
        self._all: list[float] = []
        self._lock = threading.Lock()

    def refuse(self, address: str) -> float:
        now = time.monotonic()
        with self._lock:
            since = now - self._window_s
            self._all = [t for t in self._all if t > since]
            mine = [t for t in self._failed.get(address, ()) if t > since]
            if mine:
                self._failed[address] = mine
            else:
                self._failed.pop(address, None)
            if len(mine) >= self._per_address:
                return mine[0] + self._window_s - now
            if mine and len(self._all) >= self._total:
                return self._all[0] + self._window_s - now
            return 0.0

    def failed(self, address: str) -> None:
        now = time.monotonic()
        with self._lock:
            if address not in self._failed and len(self._failed) >= self._max_addresses:
                self._failed.clear()  # addresses come from peers: bounded
            self._failed.setdefault(address, []).append(now)
            self._all.append(now)


Proof = Literal["token", "cookie", ""]


@dataclass(frozen=True, slots=True)
class ConsoleConfig:
    db: StoreTarget  # leader.db, or the fleet's PostgreSQL database (several leaders)
    outbox: Path | None  # the leader's outbox (None: several leaders, each with its own, none named)
    token: str
    artifacts: Path | None = None  # the leader's artifact store (default: `artifacts` beside the db)
    public_key: Path | None = None  # the fleet's key, to check uploads against (None: no uploads)
    max_upload_bytes: int = 4 * 1024**3
    # the leader's operator socket: a device page's "Fetch its logs" opens a log bundle through it,
    # as the console's own user (a right of the leader's remote.logs_operators; None: no button)
    operator_socket: Path | None = None


def _ago(ms: int | None) -> str:
    return ago(int(time.time() * 1000), ms)


def _when(ms: int) -> str:
    """A moment as every page writes it (`agent.console.times`)."""
    return times.moment(ms)


def _now() -> str:
    return times.moment(int(time.time() * 1000))


#: The engine's details name CLI commands; on a page with the control's button, the button is named.
_CLI_HINTS = (
    (re.compile(r"waiting for `rollout approve [^`]+`"), "waiting for an operator's approval (the approve button)"),
    (re.compile(r"`rollout approve [^`]+` installs them"), "the approve button installs them"),
)


def _console_words(detail: str) -> str:
    for pattern, said in _CLI_HINTS:
        detail = pattern.sub(said, detail)
    return detail


def _chart(series: charts.Series, label: str) -> markupsafe.Markup:
    return markupsafe.Markup(charts.svg(series, label=label))


def _preview(head: bytes) -> str:
    return printable(head, 32)


def _outcomes(wave: Mapping[str, Any]) -> list[tuple[str, int]]:
    """How a wave's devices read on its bar, by the chart's kinds and in their order: each kind
    a colour of its own (an aborted wave does not read as a full green bar; queued is not drawn)."""
    found = dict.fromkeys(charts.KINDS, 0)
    for state, n in wave["counts"].items():
        if state in charts.KIND_OF:
            found[charts.KIND_OF[state]] += n
    return [(kind, n) for kind, n in found.items() if n]


def _sample_text(s: SystemSample) -> list[str]:
    """A device's system sample as a person reads it."""
    parts = []
    if s.cpu_percent is not None:
        parts.append(f"cpu {s.cpu_percent:.0f}%")
    for what, pct, total, free in (("memory", s.mem_percent, s.mem_total_bytes, s.mem_available_bytes),
                                   ("disk", s.disk_percent, s.disk_total_bytes, s.disk_free_bytes)):
        if pct is not None or total is not None:
            text = f"{what} {pct:.0f}% used" if pct is not None else what
            if total is not None:
                text += f" of {format_bytes(total)}" + (f" ({format_bytes(free)} free)" if free is not None else "")
            parts.append(text)
    if s.load_1m is not None:
        loads = " ".join(f"{v:.2f}" for v in (s.load_1m, s.load_5m, s.load_15m) if v is not None)
        parts.append(f"load {loads}")
    if s.temperature_c is not None:
        parts.append(f"{s.temperature_c:.1f} °C")
    if s.uptime_s is not None:
        parts.append(f"host up {format_age(s.uptime_s)}")
    return parts


class Console:
    """The pages, rendered from the database on each request."""

    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.env = jinja2.Environment(loader=jinja2.PackageLoader("agent.console", "templates"), autoescape=True,
                                      undefined=jinja2.StrictUndefined)
        self.env.globals.update(ago=_ago, preview=_preview, db=str(config.db), size=format_bytes, age=format_age,
                                outcomes=_outcomes, when=_when, chart=_chart, now=_now, zone=times.zone)
        self.env.filters["console_words"] = _console_words
        key = config.token.encode()
        self.session = hmac.new(key, b"edge-agent console session", hashlib.sha256).hexdigest()
        self.csrf = hmac.new(key, b"edge-agent console csrf", hashlib.sha256).hexdigest()

    def render(self, name: str, **values: Any) -> bytes:
        values.setdefault("title", name)
        values.setdefault("page", name)
        values.setdefault("refresh", None)
        values.setdefault("message", "")
        values.setdefault("error", "")
        return self.env.get_template(f"{name}.html").render(**values).encode()

    def _operator_mac(self, name: str) -> str:
        return hmac.new(self.config.token.encode(), b"operator|" + name.encode(), hashlib.sha256).hexdigest()[:32]

    def operator_cookie(self, name: str) -> str:
        """The cookie that carries the operator's name (signed: a browser cannot change it)."""
        return (f"{OPERATOR_COOKIE}={urllib.parse.quote(name, safe='')}.{self._operator_mac(name)}; HttpOnly;"
                " SameSite=Strict; Path=/")

    def operator(self, headers: Mapping[str, str]) -> str:
        """The name the browser signed in with ("": none, or a cookie that does not verify)."""
        for part in headers.get("cookie", "").split(";"):
            key, _, value = part.strip().partition("=")
            if key == OPERATOR_COOKIE:
                quoted, _, mac = value.rpartition(".")
                name = urllib.parse.unquote(quoted)
                if OPERATOR_NAME.match(name) and hmac.compare_digest(mac.encode(), self._operator_mac(name).encode()):
                    return name
        return ""

    def authorized(self, headers: Mapping[str, str]) -> Proof:
        """How the request proves the token: a Bearer header with it, the session cookie, or
        not at all (""). `headers`: names in lower case."""
        auth = headers.get("authorization", "")
        if auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].strip().encode(), self.config.token.encode()):
            return "token"
        for part in headers.get("cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE and hmac.compare_digest(value.encode(), self.session.encode()):
                return "cookie"
        return ""

    # -- pages ------------------------------------------------------------------------------
    def page(self, path: str, query: dict[str, str]) -> tuple[int, bytes]:
        if path == "/":
            return 200, self._fleet(query)
        if path.startswith("/devices/"):
            device_id = urllib.parse.unquote(path[len("/devices/"):])
            detail = data.device(self.config.db, device_id)
            if detail is None:
                return 404, self.render("not_found", what=f"no device {device_id!r}")
            sample = _sample_text(detail.sample) if detail.sample else []
            acked = query.get("acknowledged", "") == "1"
            return 200, self.render("device", title=device_id, x=detail, sample=sample, refresh=REFRESH_S,
                                    csrf=self.csrf, logs=self.config.operator_socket is not None,
                                    message="acknowledged: no longer counted as failed" if acked else "")
        if path == "/rollouts":
            return 200, self.render("rollouts", title="rollouts", rollouts=data.rollouts(self.config.db),
                                    refresh=REFRESH_S)
        if path == "/rollouts/new":
            return 200, self.new_rollout_page(NEW_ROLLOUT_DEFAULTS)
        if path == "/artifacts":
            store = self._store()
            return 200, self.render("artifacts", title="artifacts", artifacts=data.artifacts(store), store=str(store),
                                    csrf=self.csrf, uploads=self.config.public_key is not None,
                                    most=format_bytes(self.config.max_upload_bytes), accept=data.file_suffixes())
        if path.startswith("/rollouts/") and path.endswith("/confirm"):
            rollout_id = urllib.parse.unquote(path[len("/rollouts/"):-len("/confirm")])
            action = query.get("action", "")
            if action not in CONTROL_HELP:
                return 400, self.render("not_found", what=f"no control {action!r}")
            choices = self._rollback_choices(data.rollout_version(self.config.db, rollout_id)) \
                if action == "rollback" else []
            spec_artifact = data.spec_rollback(self.config.db, rollout_id) if action == "rollback" else ""
            return 200, self.render("confirm", title=f"{action} {rollout_id}", rollout_id=rollout_id, action=action,
                                    help=CONTROL_HELP[action], csrf=self.csrf, choices=choices,
                                    spec_artifact=spec_artifact)
        if path.startswith("/rollouts/"):
            queued = query.get("queued", "")
            # the banner stands while the control waits; once applied, the audit table says what came of it
            message = (f"queued as control {int(queued)}: the leader applies it on its next tick"
                       if queued.isdigit() and len(queued) <= 18 and data.control_pending(self.config.db, int(queued))
                       else "")
            return self.rollout_page(urllib.parse.unquote(path[len("/rollouts/"):]), message=message,
                                     state=query.get("state", "")[:32])
        if path == "/config":
            done = query.get("done", "")
            return 200, self.config_page(message="saved: offered with the target's next config rollout"
                                         if done == "1" else "")
        if path == "/identities":
            queued = query.get("queued", "")
            return 200, self.identities_page(message=f"queued as control {int(queued)}: the leader applies it within a"
                                             " second" if queued.isdigit() and len(queued) <= 18 else "")
        if path == "/dead-letters":
            outbox = self.config.outbox
            total, rows = data.dead_letters(outbox) if outbox is not None else (0, [])
            return 200, self.render("dead", title="dead letters", total=total, rows=rows,
                                    outbox=str(outbox) if outbox is not None else None, refresh=REFRESH_S)
        if path == "/audit":
            return 200, self.render("audit", title="audit", entries=data.audit(self.config.db), refresh=REFRESH_S)
        if path == "/rejects":
            return 200, self.render("rejects", title="rejects", x=data.rejects(self.config.db, query.get("device")),
                                    refresh=REFRESH_S)
        return 404, self.render("not_found", what=f"no page {path}")

    def log_bundle(self, device_id: str, since: str, actor: str) -> Response:
        """A device's log bundle (gzip) through the leader's operator socket, as a download."""
        import tempfile

        from agent.core.durations import parse_seconds
        from agent.remote.operator import SessionRefused, logs

        socket_path = self.config.operator_socket
        if socket_path is None:
            return _refusal(409, "this console has no --operator-socket: fetch logs with `edge-agent devices logs`")
        try:
            since_s = max(60, min(31 * 86_400, int(parse_seconds(since))))
        except ValueError:
            return _refusal(400, f"since: {since[:32]!r} is not a duration (e.g. 30m, 1h, 2d)")
        with tempfile.TemporaryDirectory(prefix="console-logs-") as tmp:
            out = Path(tmp) / "bundle.gz"
            try:
                asyncio.run(logs(socket_path, device_id, out, since_s=since_s, on_behalf_of=actor))
            except (SessionRefused, OSError) as exc:
                return _refusal(502, f"no log bundle of {device_id}: {exc}")
            body = out.read_bytes()
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", device_id)[:64]
        return Response(200, body, "application/gzip", headers=(
            *HEADERS, ("Content-Disposition", f'attachment; filename="{name}-logs.txt.gz"')))

    def rollout_page(self, rollout_id: str, *, message: str = "", error: str = "",
                     state: str = "") -> tuple[int, bytes]:
        """A rollout's page; `message` and `error` are the console's own words, never the URL's;
        `state`: list only its devices in that state."""
        found = data.rollout(self.config.db, rollout_id, state=state)
        if found is None:
            start = data.start_control(self.config.db, rollout_id)
            if start is None:
                return 404, self.render("not_found", what=f"no rollout {rollout_id!r}")
            return 200, self.render("rollout_starting", title=rollout_id, rollout_id=rollout_id, c=start,
                                    refresh=REFRESH_S, message=message, error=error)
        actions = found.actions
        can_roll_back = bool(found.spec_rollback or self._rollback_choices(found.described["version"]))
        if "rollback" not in actions and can_roll_back:
            actions = [*actions, "rollback"]  # with an artifact of the store, picked on the confirmation page
        elif "rollback" in actions and not can_roll_back:
            actions = [a for a in actions if a != "rollback"]  # nothing to offer: no button that cannot work
        return 200, self.render("rollout", title=rollout_id, r=found.described, actions=actions,
                                refresh=REFRESH_S, message=message, error=error, devices=found.devices,
                                more=found.more, device_states=found.states, state=state, series=found.chart,
                                serves_image=found.serves_image, detail=_console_words(found.described["detail"]))

    def _fleet(self, query: dict[str, str]) -> bytes:
        state = query.get("state", "")
        try:
            offset = max(0, int(query.get("offset", "0") or 0))
        except ValueError:
            offset = 0
        flt = DeviceFilter(online=True if state == "online" else False if state == "offline" else None,
                           version=query.get("version") or None, tag=query.get("tag") or None,
                           rollout=query.get("rollout") or None, limit=data.PAGE, offset=offset)
        fleet = data.fleet(self.config.db, flt)
        kept = {k: v for k, v in query.items() if k in ("state", "version", "tag", "rollout") and v}

        def link(at: int) -> str:
            return "/?" + urllib.parse.urlencode({**kept, "offset": max(0, at)})

        done = query.get("acknowledged", "")
        message = (f"acknowledged {int(done)} attempt{'' if done == '1' else 's'}: no longer counted as failed"
                   if done.isdigit() and len(done) <= 9 else "")
        return self.render("fleet", title="fleet", s=fleet.summary, page=fleet.page, f=flt, state=state, link=link,
                           per_page=data.PAGE, refresh=REFRESH_S, online=fleet.online, csrf=self.csrf,
                           message=message)

    def acknowledge(self, form: dict[str, str], proof: Proof, actor: str = "") -> tuple[int, bytes, str]:
        """A POST of an "acknowledge" button (the fleet's configuration table: every device's open
        attempt at a target; a device's page: its own): 303 back to the page it came from, or a
        page with the reason (403: the form's CSRF value is wrong; 409: nothing of it to acknowledge)."""
        device = form.get("device", "")[:128]
        back = f"/devices/{urllib.parse.quote(device, safe='')}" if device else "/"
        if proof != "token" and not hmac.compare_digest(form.get("csrf", "").encode(), self.csrf.encode()):
            return 403, self.render("not_found", title="expired", what="the form has expired: open the page again"), ""
        try:
            done = data.acknowledge(self.config.db, form.get("target", ""), device or None, actor or "the console")
        except ConfigError as exc:
            return 409, self.render("not_found", title="nothing to acknowledge", what=str(exc)), ""
        log.info("configuration attempts acknowledged", extra={"kv": {"target": form.get("target", "")[:64],
                                                                   "devices": len(done), "by": actor}})
        return 303, b"", back + "?" + urllib.parse.urlencode({"acknowledged": len(done)})

    def control(self, path: str, form: dict[str, str], proof: Proof, actor: str = "") -> tuple[int, bytes, str]:
        """A POST to /rollouts/ID/control: (303, b"", where to send the browser) when it was
        queued, else the rollout's page with the reason (403: the form's CSRF value is wrong;
        409: the control does not apply)."""
        rollout_id = urllib.parse.unquote(path[len("/rollouts/"):-len("/control")])
        back = f"/rollouts/{urllib.parse.quote(rollout_id, safe='')}"
        if proof != "token" and not hmac.compare_digest(form.get("csrf", "").encode(), self.csrf.encode()):
            expired = "the form has expired: open the control again"
            status, body = self.rollout_page(rollout_id, error=expired)
            return 403, body if status == 200 else self.render("not_found", what=expired), ""
        action = form.get("action", "")
        artifact = None
        if action == "rollback" and not form.get("artifact") and not data.spec_rollback(self.config.db, rollout_id):
            status, body = self.rollout_page(rollout_id, error="choose a rollback artifact: this rollout's spec names"
                                             " none (upload one signed as a rollback on the artifacts page)")
            return (409 if status == 200 else status), body, ""
        if action == "rollback" and form.get("artifact"):
            choices = self._rollback_choices(data.rollout_version(self.config.db, rollout_id))
            chosen = next((a for a in choices if a.file == form["artifact"]), None)
            if chosen is None:
                status, body = self.rollout_page(rollout_id, error="choose a rollback artifact of the leader's store")
                return (409 if status == 200 else status), body, ""
            artifact = chosen.path
        try:
            control_id = data.control(self.config.db, rollout_id, action, artifact=artifact, actor=actor)
        except (RolloutError, ConfigError) as exc:
            status, body = self.rollout_page(rollout_id, error=str(exc))
            return (409 if status == 200 else status), body, ""
        log.info("control queued", extra={"kv": {"rollout": rollout_id, "action": action, "control": control_id,
                                                 "by": actor}})
        return 303, b"", back + "?" + urllib.parse.urlencode({"queued": control_id})


    def config_page(self, *, form: Mapping[str, str] | None = None, message: str = "", error: str = "") -> bytes:
        """The configuration layers, with the form to set a value (`error`: the console's own words)."""
        return self.render("config", title="configuration", x=data.config_layers(self.config.db), csrf=self.csrf,
                           f=form or {}, message=message, error=error)

    def change_layer(self, form: dict[str, str], proof: Proof, actor: str = "") -> tuple[int, bytes, str]:
        """A POST of the layers page: set or unset one value (303 back to the page), or the page
        again with the reason (403: the form's CSRF value is wrong; 400: a field)."""
        if proof != "token" and not hmac.compare_digest(form.get("csrf", "").encode(), self.csrf.encode()):
            return 403, self.config_page(form=form, error="the form has expired: fill it in again"), ""
        try:
            said = data.change_layer(self.config.db, form, actor or "the console")
        except ConfigError as exc:
            return 400, self.config_page(form=form, error=str(exc)), ""
        log.info("configuration layer changed", extra={"kv": {"change": said, "by": actor}})
        return 303, b"", "/config?done=1"

    def identities_page(self, *, message: str = "", error: str = "") -> bytes:
        """Device identities: pending enrolments to approve or reject, enrolled devices to revoke."""
        return self.render("identities", title="device identities", x=data.identities(self.config.db),
                           csrf=self.csrf, message=message, error=error, refresh=REFRESH_S)

    def decide_identity(self, form: dict[str, str], proof: Proof, actor: str = "") -> tuple[int, bytes, str]:
        """A POST of the identities page: approve, reject or revoke one device (303 back to the
        page), or the page again with the reason (403: the form's CSRF value is wrong; 409: no
        such enrolment or action)."""
        if proof != "token" and not hmac.compare_digest(form.get("csrf", "").encode(), self.csrf.encode()):
            return 403, self.identities_page(error="the form has expired: open the page again"), ""
        try:
            control_id = data.identity_control(self.config.db, form, actor or "the console")
        except (ConfigError, IdentityError) as exc:
            return 409, self.identities_page(error=str(exc)), ""
        log.info("identity control queued", extra={"kv": {"device": form.get("device", "")[:128],
                                                          "action": form.get("action", "")[:16], "by": actor}})
        return 303, b"", f"/identities?queued={control_id}"

    def _store(self) -> Path:
        """The leader's artifact store."""
        if self.config.artifacts is not None:
            return self.config.artifacts
        assert isinstance(self.config.db, Path)  # (a postgresql:// console is started with its --artifacts)
        return self.config.db.parent / ARTIFACTS_DIR

    def _rollback_choices(self, version: str | None) -> list[data.ArtifactChoice]:
        """The store's rollback artifacts for a rollout of `version` (None: no such rollout)."""
        return data.rollback_choices(self._store(), version) if version is not None else []

    # -- an artifact uploaded ---------------------------------------------------------------
    def may_upload(self, headers: Mapping[str, str], proof: Proof) -> bool:
        """Whether a request that proved the token so (`authorized`) may send an artifact: from a
        browser, with the CSRF value in `X-CSRF-Token`."""
        return proof == "token" or (proof == "cookie" and hmac.compare_digest(
            headers.get("x-csrf-token", "").encode(), self.csrf.encode()))

    def upload(self, body: Path | None, name: str, actor: str) -> tuple[int, str]:
        """Check an uploaded artifact as the leader does at admission and keep the verified copy
        in the store: (201, what it is) or (4xx, why not)."""
        if self.config.public_key is None:
            return 409, NO_UPLOADS
        if body is None:
            return 411, "send the artifact as the request body, with a Content-Length"
        from firmware_rollout.orchestration.artifacts import ArtifactStore
        from rollout_engine.keys import load_verify_key

        shown = printable(name.encode(), 100) or "the upload"
        from app_rollout.bundle import MAGIC as APP_MAGIC

        if _starts_with(body, APP_MAGIC):
            return self._take_app_bundle(body, shown, actor)
        if _is_config_release(body):
            return self._take_config_release(body, shown, actor)
        try:  # the upload was written into the store's directory: checked there and renamed, not copied
            admitted = ArtifactStore(self._store(), load_verify_key(self.config.public_key)).take(body, shown=shown)
        except EdgeAgentError as exc:
            return 422, str(exc)
        m = admitted.signed.manifest
        log.info("artifact uploaded in the console", extra={"kv": {"file": admitted.path.name, "name": m.name,
                                                                    "version": m.version, "by": actor}})
        return 201, f"{shown}: {m.name} {m.version} ({format_bytes(m.size)}) verified and kept as {admitted.path.name}"

    def _take_config_release(self, body: Path, shown: str, actor: str) -> tuple[int, str]:
        """A config release uploaded: checked as the leader checks one at a rollout's start, kept
        by its id (the upload's file is removed by the HTTP layer)."""
        from config_rollout.kind import keep_release
        from rollout_engine.keys import load_verify_key

        assert self.config.public_key is not None
        try:
            release, kept, data = keep_release(load_verify_key(self.config.public_key), self._store(), str(body))
        except EdgeAgentError as exc:
            return 422, str(exc).replace(str(body), shown)
        log.info("config release uploaded in the console", extra={"kv": {"file": kept.name, "name": release.name,
                                                                         "version": release.version, "by": actor}})
        return 201, (f"{shown}: config release {release.name} {release.version} ({format_bytes(len(data))}) verified"
                     f" and kept as {kept.name}")

    def _take_app_bundle(self, body: Path, shown: str, actor: str) -> tuple[int, str]:
        """An application bundle (or a removal) uploaded: checked whole as the leader checks one at
        a rollout's start, kept as `{sha256}.eaapp`."""
        from app_rollout.kind import describe_bundle, keep_bundle
        from rollout_engine.keys import load_verify_key

        assert self.config.public_key is not None
        try:
            kept, _ = keep_bundle(load_verify_key(self.config.public_key), self._store(), str(body))
            described = describe_bundle(kept)
        except EdgeAgentError as exc:
            return 422, str(exc).replace(str(body), shown)
        log.info("application bundle uploaded in the console", extra={"kv": {
            "file": kept.name, "name": described.name, "version": described.version, "by": actor}})
        return 201, (f"{shown}: {described.installs} ({format_bytes(kept.stat().st_size)}) verified and kept as"
                     f" {kept.name}")

    def upload_room(self) -> tuple[Path, int]:
        """Where an upload's body goes (the store's directory: the copy is made on the same
        filesystem) and how large it may be."""
        store = self._store()
        store.mkdir(parents=True, exist_ok=True, mode=0o750)
        return store, self.config.max_upload_bytes

    # -- a new rollout: the form, its plan, the start ----------------------------------------
    def new_rollout_page(self, form: Mapping[str, Any], *, plan: str = "", error: str = "",
                         choices: list[data.ArtifactChoice] | None = None) -> bytes:
        """The form (`choices`: the store's artifacts, when the caller listed them already)."""
        store = self._store()
        return self.render("new_rollout", title="start a rollout",
                           artifacts=data.artifacts(store) if choices is None else choices, store=str(store),
                           f=form, plan=plan, error=error, csrf=self.csrf)

    def new_rollout(self, form: dict[str, str], proof: Proof, actor: str = "") -> tuple[int, bytes, str]:
        """A POST of the form: with `step=preview` the plan as `rollout start --dry-run` prints
        it; with `step=start` the start control `rollout start` writes (303 to the rollout). A
        mistake is the form again with the reason (400); a wrong CSRF value, 403."""
        fields: dict[str, Any] = {key: form.get(key, default)[:FIELD_MAX]
                                  for key, default in NEW_ROLLOUT_DEFAULTS.items() if isinstance(default, str)}
        fields["approval"] = form.get("approval", "") == "1"
        if proof != "token" and not hmac.compare_digest(form.get("csrf", "").encode(), self.csrf.encode()):
            return 403, self.new_rollout_page(fields, error="the form has expired: open it again"), ""
        choices = data.artifacts(self._store())
        try:
            spec, manifest, rid = self._new_spec(fields, choices)
            fields["id"] = rid  # the start uses the very id the preview showed
            plan = plan_rollout(spec, manifest, self.config.db)
            if form.get("step") != "start":
                held = data.holders(self.config.db, [d for wave in plan.waves for d in wave],
                                    kind=spec.rollout.kind, lane=manifest.lane)
                text = render_plan(rid, spec, manifest, plan, held)
                text += "".join(f"\nwarning: {w}" for w in plan.warnings)
                return 200, self.new_rollout_page(fields, plan=text, choices=choices), ""
            control_id = data.start(self.config.db, rid, StartControl(spec=spec, waves=plan.waves).to_json().decode(),
                                    actor=actor)
        except (ConfigError, RolloutError, ArtifactError) as exc:
            return 400, self.new_rollout_page(fields, error=str(exc), choices=choices), ""
        log.info("rollout start queued from the console", extra={"kv": {"rollout": rid, "control": control_id,
                                                                        "by": actor}})
        return 303, b"", f"/rollouts/{urllib.parse.quote(rid, safe='')}?" + urllib.parse.urlencode(
            {"queued": control_id})

    def _new_spec(self, f: Mapping[str, Any], choices: list[data.ArtifactChoice]) -> tuple[RolloutSpec, Any, str]:
        """The spec the form says, checked as a spec file is (a mistake names its key)."""
        chosen = next((a for a in choices if a.file == f["artifact"]), None)
        if chosen is None:
            raise ConfigError("the form", "artifact", "choose one of the leader's artifacts")
        values = [v.strip() for v in str(f["values"]).split(",") if v.strip()]
        select = str(f["select"])
        try:
            canary = int(str(f["canary"]) or 0)
            counts = [int(c) for c in str(f["counts"]).replace(" ", "").split(",") if c]
            soak_s = float(str(f["soak_s"]) or 0)
        except ValueError:
            raise ConfigError("the form", "waves", "canary and counts are whole numbers, soak a number of seconds"
                              ) from None
        targets: dict[str, Any] = {"select": select}
        if select in ("tags", "versions", "devices"):
            targets[select] = values
        rollout: dict[str, Any] = {"name": str(f["name"]) or chosen.manifest.name, "artifact": str(chosen.path),
                                   "kind": chosen.kind}
        if f.get("rollback_artifact"):
            back = next((a for a in choices if a.file == f["rollback_artifact"] and a.rollback), None)
            if back is None:
                raise ConfigError("the form", "rollback artifact", "choose one of the store's rollback artifacts")
            rollout["rollback_artifact"] = str(back.path)
        gates: dict[str, Any] = {"manual_approval": bool(f["approval"]), "soak_s": soak_s,
                                 **_numbers(f, "gates", ("success_threshold_pct", "failure_threshold_pct"))}
        for key, allowed in (("failure_action", ("abort", "pause")), ("on_abort", ("nothing", "rollback"))):
            if f.get(key):
                if f[key] not in allowed:
                    raise ConfigError("the form", f"gates.{key}", f"one of {', '.join(allowed)}")
                gates[key] = f[key]
        device = {**_numbers(f, "device", ("timeout_s",)), **_numbers(f, "device", ("retries",), whole=True)}
        windows = [w.strip() for w in str(f.get("windows", "")).split(",") if w.strip()]
        if windows:
            device["maintenance_windows"] = windows
        schedule: dict[str, Any] = {k: str(f[k]).strip() for k in ("start_at", "end_at") if str(f.get(k, "")).strip()}
        schedule.update(_numbers(f, "schedule", ("devices_per_minute",), whole=True))
        spec = spec_from_dict({
            "rollout": rollout,
            "targets": targets,
            "waves": {"canary": canary, **({"counts": counts} if counts else {"percents": [100.0]})},
            "gates": gates, "device": device, "schedule": schedule,
        }, source="the form")
        rid = str(f["id"]) or rollout_id_for(spec, SystemClock().now_ms())
        if not ROLLOUT_ID.match(rid):
            raise ConfigError("the form", "id", "letters, digits, '.', '_' and '-' only, at most 64")
        return spec, chosen.manifest, rid


def _numbers(form: Mapping[str, Any], section: str, keys: tuple[str, ...], *, whole: bool = False) -> dict[str, Any]:
    """The form's fields `keys` that were filled in, as numbers of the spec's `section` (a mistake
    names the spec's key)."""
    found: dict[str, Any] = {}
    for key in keys:
        text = str(form.get(key, "")).strip()
        if not text:
            continue
        try:
            found[key] = int(text) if whole else float(text)
        except ValueError:
            raise ConfigError("the form", f"{section}.{key}",
                              f"{text!r} is not a {'whole number' if whole else 'number'}") from None
    return found


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def _is_config_release(path: Path) -> bool:
    from config_rollout.release import MAGIC

    return _starts_with(path, MAGIC)


NO_UPLOADS = "this console was started without --public-key: it cannot check an artifact, so takes none"
UPLOAD_EXPIRED = "the upload has expired: open the artifacts page again"
NEW_ROLLOUT_DEFAULTS: dict[str, Any] = {"artifact": "", "name": "", "id": "", "select": "all", "values": "",
                                        "canary": "1", "counts": "", "approval": False, "soak_s": "0",
                                        # the rest of the spec: empty is the spec's default
                                        "rollback_artifact": "", "success_threshold_pct": "",
                                        "failure_threshold_pct": "", "failure_action": "", "on_abort": "",
                                        "timeout_s": "", "retries": "", "windows": "", "start_at": "", "end_at": "",
                                        "devices_per_minute": ""}
FIELD_MAX = 2000  # characters of one form field
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

HEADERS = (("Cache-Control", "no-store"), ("X-Frame-Options", "DENY"),
           ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; script-src 'self';"
            " connect-src 'self'; form-action 'self'"))
SCRIPTS = {name: (Path(__file__).parent / "static" / name).read_bytes() for name in ("live.js", "upload.js")}
MAX_CONNECTIONS = 64
LIMITS = Limits(max_body_bytes=MAX_BODY, head_timeout_s=10.0, body_timeout_s=10.0, idle_timeout_s=30.0,
                max_connections=MAX_CONNECTIONS)


def _page(status: int, body: bytes, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, body, "text/html; charset=utf-8", headers=(*HEADERS, *headers))


def _refusal(status: int, reason: str) -> Response:
    return Response(status, (reason + "\n").encode(), headers=HEADERS)


class ConsoleHttp:
    """The console's requests, on the product's HTTP layer: rendering reads SQLite and runs
    Jinja2, so it runs in a worker thread and the server answers other requests meanwhile."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.http = HttpServer(self.handle, name="console", limits=LIMITS, refusal=_refusal, spool=self.spool)
        self.sign_in = SignInLimiter()

    def spool(self, head: Request) -> tuple[Path, int] | None:
        """An upload's body goes to a file in the store, once its head proves it may send one;
        else it is refused before a byte of it is read (a wrong token counts as at sign-in)."""
        if head.path != "/artifacts/upload":
            return None
        if head.method != "PUT":
            raise RefuseBody(405, "an artifact is uploaded with PUT")
        console = self.console
        offered = head.headers.get("authorization", "").startswith("Bearer ")
        if offered and self.sign_in.refuse(head.peer) > 0:
            raise RefuseBody(429, "too many wrong tokens: wait a minute before the next try")
        proof = console.authorized(head.headers)
        if not proof:
            if offered:
                self.sign_in.failed(head.peer)
            raise RefuseBody(401, "sign in first")
        if console.config.public_key is None:
            raise RefuseBody(409, NO_UPLOADS)
        if not console.may_upload(head.headers, proof):
            raise RefuseBody(403, UPLOAD_EXPIRED)
        return console.upload_room()

    async def handle(self, request: Request) -> Response:
        return await asyncio.to_thread(self._answer, request)

    def _answer(self, request: Request) -> Response:
        console = self.console
        if request.path == "/login" and request.method in ("GET", "HEAD"):
            return _page(200, console.render("login", title="sign in"))
        if request.method not in ("GET", "HEAD", "POST") and request.path != "/artifacts/upload":
            return _page(405, b"", (("Allow", "GET, HEAD, POST"),))
        form = dict(urllib.parse.parse_qsl(request.body.decode("utf-8", "replace"), keep_blank_values=True))
        signing_in = request.method == "POST" and request.path == "/login"
        offered = signing_in or request.headers.get("authorization", "").startswith("Bearer ")
        if offered:
            wait_s = self.sign_in.refuse(request.peer)
            if wait_s > 0:
                return _page(429, console.render("login", title="sign in",
                                                 error="too many wrong tokens: wait a minute before the next try"),
                             (("Retry-After", str(max(1, round(wait_s)))),))
        if signing_in:
            if hmac.compare_digest(form.get("token", "").strip().encode(), console.config.token.encode()):
                name = " ".join(form.get("name", "").split())
                if name and not OPERATOR_NAME.match(name):
                    return _page(400, console.render("login", title="sign in", error=(
                        "name: letters, digits, spaces and . _ @ - only, at most 64")))
                cookies = [("Set-Cookie", f"{COOKIE}={console.session}; HttpOnly; SameSite=Strict; Path=/")]
                if name:
                    cookies.append(("Set-Cookie", console.operator_cookie(name)))
                return _page(303, b"", (("Location", "/"), *cookies))
            return self._unauthorized(request)
        proof = console.authorized(request.headers)
        if not proof:
            return self._unauthorized(request, offered=offered)
        if request.method in ("GET", "HEAD") and request.path.startswith("/static/"):
            script = SCRIPTS.get(request.path[len("/static/"):])
            if script is not None:
                return Response(200, script, "text/javascript; charset=utf-8", headers=HEADERS)
        if request.method in ("GET", "HEAD"):
            query = {k: v[-1] for k, v in request.query.items()}
            try:
                status, body = console.page(request.path, query)
            except EdgeAgentError as exc:
                status, body = 503, console.render("not_found", title="unavailable", what=str(exc))
            return _page(status, body)
        name = console.operator(request.headers) if proof == "cookie" else ""
        actor = (f"{name or 'an operator'} via the console from {request.peer}" if proof == "cookie"
                 else f"the console's API (Bearer token) from {request.peer}")
        if request.path == "/artifacts/upload":
            if request.method != "PUT":
                return _page(405, b"", (("Allow", "PUT"),))
            if not console.may_upload(request.headers, proof):
                return _refusal(403, UPLOAD_EXPIRED)
            status, said = console.upload(request.body_file, request.query.get("name", [""])[-1], actor)
            return _refusal(status, said)
        forms = {"/rollouts/new": console.new_rollout, "/identities": console.decide_identity,
                 "/config": console.change_layer, "/config/acknowledge": console.acknowledge}
        if (take := forms.get(request.path)) is not None:  # a page's form: the page again, or where to go next
            try:
                status, body, location = take(form, proof, actor)
            except EdgeAgentError as exc:
                return _page(503, console.render("not_found", title="unavailable", what=str(exc)))
            return _page(status, body, (("Location", location),) if location else ())
        if request.path.startswith("/devices/") and request.path.endswith("/logs"):
            if proof != "token" and not hmac.compare_digest(form.get("csrf", "").encode(), console.csrf.encode()):
                return _refusal(403, "the form's check value is not this console's: open the device's page again")
            return console.log_bundle(urllib.parse.unquote(request.path[len("/devices/"):-len("/logs")]),
                                      form.get("since", "1h"), actor)
        if request.path.startswith("/rollouts/") and request.path.endswith("/control"):
            try:
                status, body, location = console.control(request.path, form, proof, actor)
            except EdgeAgentError as exc:
                return _page(503, console.render("not_found", title="unavailable", what=str(exc)))
            return _page(status, body, (("Location", location),) if location else ())
        return _page(404, console.render("not_found", what=f"no form at {request.path}"))

    def _unauthorized(self, request: Request, *, offered: bool = True) -> Response:
        """401 and the sign-in form; a wrong token offered counts against its address."""
        if offered:
            self.sign_in.failed(request.peer)
        return _page(401, self.console.render("login", title="sign in"),
                     (("WWW-Authenticate", 'Bearer realm="edge-agent"'),))


class ConsoleServer:
    """The console on `address`: bound at once (an address in use is an `OSError` here), served
    by `serve_forever()` (or `serve_in_thread()`), ended by `shutdown()` from another thread."""

    def __init__(self, address: tuple[str, int], console: Console) -> None:
        self.console = console
        self._http = ConsoleHttp(console)
        self._socket = socket.create_server(address, backlog=self._http.http.backlog)
        self.server_address: tuple[str, int] = self._socket.getsockname()[:2]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    async def serve(self) -> None:
        """Serve until `shutdown()`."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._http.http.connection, sock=self._socket)
        try:
            await self._stop.wait()
        finally:
            server.close()
            await self._http.http.close()
            await server.wait_closed()

    def serve_forever(self) -> None:
        asyncio.run(self.serve())

    def serve_in_thread(self) -> threading.Thread:
        started = threading.Event()

        async def serving() -> None:
            task = asyncio.ensure_future(self.serve())
            await asyncio.sleep(0)
            started.set()
            await task

        self._thread = threading.Thread(target=lambda: asyncio.run(serving()), name="console", daemon=True)
        self._thread.start()
        started.wait(10)
        return self._thread

    def shutdown(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def server_close(self) -> None:
        self._socket.close()


__all__ = ["Console", "ConsoleConfig", "ConsoleServer", "SignInLimiter"]
