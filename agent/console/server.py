"""The console's HTTP server: pages, the token, the controls.

Every request needs the token: `Authorization: Bearer TOKEN`, or the session cookie a browser
gets by signing in with it on `/login` (HttpOnly, SameSite=Strict; it is an HMAC of the token,
not the token). Without either, 401 and the sign-in form. A control is a POST from the
confirmation page and carries a CSRF value derived from the token the same way. Requests are
small: a body over 4 KiB is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import http.server
import logging
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import msgspec

from agent.console import data
from agent.core.durations import ago
from agent.core.errors import ConfigError, EdgeAgentError, RolloutError
from agent.leader.fleet_view import DeviceFilter
from agent.leader.reject_view import printable

log = logging.getLogger(__name__)

COOKIE = "ea_console"
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


@dataclass(frozen=True, slots=True)
class ConsoleConfig:
    db: Path
    outbox: Path
    token: str


def _ago(ms: int | None) -> str:
    return ago(int(time.time() * 1000), ms)


def _preview(head: bytes) -> str:
    return printable(head, 32)


class Console:
    """The pages, rendered from the database on each request."""

    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.env = jinja2.Environment(loader=jinja2.PackageLoader("agent.console", "templates"), autoescape=True,
                                      undefined=jinja2.StrictUndefined)
        self.env.globals.update(ago=_ago, preview=_preview, db=str(config.db))
        key = config.token.encode()
        self.session = hmac.new(key, b"edge-agent console session", hashlib.sha256).hexdigest()
        self.csrf = hmac.new(key, b"edge-agent console csrf", hashlib.sha256).hexdigest()

    def render(self, name: str, **values: Any) -> bytes:
        values.setdefault("title", name)
        values.setdefault("refresh", None)
        values.setdefault("message", "")
        values.setdefault("error", "")
        return self.env.get_template(f"{name}.html").render(**values).encode()

    def authorized(self, headers: Any) -> bool:
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].strip().encode(), self.config.token.encode()):
            return True
        for part in headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE and hmac.compare_digest(value.encode(), self.session.encode()):
                return True
        return False

    # -- pages ------------------------------------------------------------------------------
    def page(self, path: str, query: dict[str, str]) -> tuple[int, bytes]:
        message, error = query.get("message", ""), query.get("error", "")
        if path == "/":
            return 200, self._fleet(query, message)
        if path.startswith("/devices/"):
            device_id = urllib.parse.unquote(path[len("/devices/"):])
            detail = data.device(self.config.db, device_id)
            if detail is None:
                return 404, self.render("not_found", what=f"no device {device_id!r}")
            sample = {k: v for k, v in msgspec.structs.asdict(detail.sample).items() if v is not None} \
                if detail.sample else {}
            return 200, self.render("device", title=device_id, x=detail, sample=sample, refresh=REFRESH_S)
        if path == "/rollouts":
            return 200, self.render("rollouts", title="rollouts", rollouts=data.rollouts(self.config.db),
                                    refresh=REFRESH_S, message=message)
        if path.startswith("/rollouts/") and path.endswith("/confirm"):
            rollout_id = urllib.parse.unquote(path[len("/rollouts/"):-len("/confirm")])
            action = query.get("action", "")
            if action not in CONTROL_HELP:
                return 400, self.render("not_found", what=f"no control {action!r}")
            return 200, self.render("confirm", title=f"{action} {rollout_id}", rollout_id=rollout_id, action=action,
                                    help=CONTROL_HELP[action], csrf=self.csrf)
        if path.startswith("/rollouts/"):
            rollout_id = urllib.parse.unquote(path[len("/rollouts/"):])
            found = data.rollout(self.config.db, rollout_id)
            if found is None:
                return 404, self.render("not_found", what=f"no rollout {rollout_id!r}")
            described, actions = found
            return 200, self.render("rollout", title=rollout_id, r=described, actions=actions, refresh=REFRESH_S,
                                    message=message, error=error)
        if path == "/dead-letters":
            total, rows = data.dead_letters(self.config.outbox)
            return 200, self.render("dead", title="dead letters", total=total, rows=rows,
                                    outbox=str(self.config.outbox), refresh=REFRESH_S)
        if path == "/rejects":
            return 200, self.render("rejects", title="rejects", x=data.rejects(self.config.db, query.get("device")),
                                    refresh=REFRESH_S)
        return 404, self.render("not_found", what=f"no page {path}")

    def _fleet(self, query: dict[str, str], message: str) -> bytes:
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

        return self.render("fleet", title="fleet", s=fleet.summary, page=fleet.page, f=flt, state=state, link=link,
                           per_page=data.PAGE, refresh=REFRESH_S, message=message)

    def control(self, path: str, form: dict[str, str], bearer: bool) -> str:
        """A POST to /rollouts/ID/control: where to send the browser next."""
        rollout_id = urllib.parse.unquote(path[len("/rollouts/"):-len("/control")])
        back = f"/rollouts/{urllib.parse.quote(rollout_id, safe='')}"
        if not bearer and not hmac.compare_digest(form.get("csrf", "").encode(), self.csrf.encode()):
            return back + "?" + urllib.parse.urlencode({"error": "the form has expired: open the control again"})
        action = form.get("action", "")
        try:
            control_id = data.control(self.config.db, rollout_id, action)
        except (RolloutError, ConfigError) as exc:
            return back + "?" + urllib.parse.urlencode({"error": str(exc)})
        log.info("control queued", extra={"kv": {"rollout": rollout_id, "action": action, "control": control_id}})
        return back + "?" + urllib.parse.urlencode(
            {"message": f"{action} queued as control {control_id}: the leader applies it on its next tick"})


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ConsoleServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _redirect(self, where: str, headers: dict[str, str] | None = None) -> None:
        self._send(303, b"", {"Location": where, **(headers or {})})

    def _form(self) -> dict[str, str] | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if not 0 <= length <= MAX_BODY:
            return None
        body = self.rfile.read(length).decode("utf-8", "replace")
        return dict(urllib.parse.parse_qsl(body, keep_blank_values=True))

    def _unauthorized(self) -> None:
        console = self.server.console
        self._send(401, console.render("login", title="sign in"), {"WWW-Authenticate": 'Bearer realm="edge-agent"'})

    def do_GET(self) -> None:
        console = self.server.console
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/login":
            self._send(200, console.render("login", title="sign in"))
            return
        if not console.authorized(self.headers):
            self._unauthorized()
            return
        query = dict(urllib.parse.parse_qsl(url.query))
        try:
            status, body = console.page(url.path, query)
        except EdgeAgentError as exc:
            status, body = 503, console.render("not_found", title="unavailable", what=str(exc))
        self._send(status, body)

    do_HEAD = do_GET

    def do_POST(self) -> None:
        console = self.server.console
        url = urllib.parse.urlsplit(self.path)
        form = self._form()
        if form is None:
            self._send(413, b"request too large")
            return
        if url.path == "/login":
            if hmac.compare_digest(form.get("token", "").strip().encode(), console.config.token.encode()):
                self._redirect("/", {"Set-Cookie": f"{COOKIE}={console.session}; HttpOnly; SameSite=Strict; Path=/"})
            else:
                self._unauthorized()
            return
        if not console.authorized(self.headers):
            self._unauthorized()
            return
        if url.path.startswith("/rollouts/") and url.path.endswith("/control"):
            bearer = self.headers.get("Authorization", "").startswith("Bearer ")
            try:
                self._redirect(console.control(url.path, form, bearer))
            except EdgeAgentError as exc:
                self._send(503, console.render("not_found", title="unavailable", what=str(exc)))
            return
        self._send(404, console.render("not_found", what=f"no form at {url.path}"))


class ConsoleServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], console: Console) -> None:
        self.console = console
        super().__init__(address, _Handler)

    def serve_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="console", daemon=True)
        thread.start()
        return thread


__all__ = ["Console", "ConsoleConfig", "ConsoleServer"]
