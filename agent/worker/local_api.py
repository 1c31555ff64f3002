"""The local API: how applications on the device hand the agent their messages.

HTTP/1.1 on a Unix socket (mode 0660, group `[local_api] group`: only that group's processes may
connect; the peer's credentials are checked again on accept), and optionally on a loopback TCP
port, served by the product's one HTTP layer (`agent.service.http`: its limits, timeouts and
connection bound).

    POST /v1/messages            JSON or msgpack: {"class", "payload" (any JSON value) or
                                 "payload_base64", "content_type", "key", "ttl", "app_id"} or
                                 {"messages": [that, ...]} (one transaction, all or none)
    POST /v1/messages/CLASS      the raw body is the payload (its Content-Type kept);
                                 ?key=K&ttl=1h&app_id=ID
    GET  /v1/status              connected, outbox depth per class, oldest pending age
    GET  /v1/config/NAME         a configuration target's applied release: {"version", "state",
                                 "drifted", "documents": {name: {"text"} or {"base64"}}, "changed"};
                                 ?version=V&wait=S (S <= 60) answers once the version is not V, or
                                 after S seconds with "changed": false (a long poll)
    GET  /v1/config/NAME/staged  ?wait=S: a release staged for the applications' verdict (a target
                                 with app_validate_s): {"review", "version", "documents"}, or
                                 {"review": null} when none came within S seconds
    POST /v1/config/NAME/verdict {"review", "accept", "reason"}: the first verdict decides; a veto's
                                 reason reaches the rollout's report

Answers: 202 {"id", "path", "duplicate"} (a batch: {"ids": [...], "path": "outbox", "messages":
[{"id", "path", "duplicate"}, ...]}) once the message is durable: the leader accepted it, or the
outbox holds it. `app_id` (1-128 of A-Z a-z 0-9 . _ : -) is the application's own name of the
message: sent again, it is answered `"duplicate": true` with the first answer's id and path and
not stored twice (`agent.worker.messages`), so a retry after a lost answer is safe.
400 {"error", "field"} for a wrong field, 413 for a body or payload too large, 429 with
Retry-After when the class is full under `reject`, 503 with Retry-After when the outbox cannot
store (a full disk). A bad request never stops the server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import grp
import json
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from agent.core.clock import Clock
from agent.core.config import TARGET_NAME
from agent.core.durations import parse_seconds
from agent.core.errors import ConfigError
from agent.core.peercred import peer_credentials
from agent.core.ratelog import RateLimitedLog
from agent.service.healthhttp import parse_listen
from agent.service.http import HttpServer, Limits, Request, Response
from agent.service.parts import PartBase
from agent.worker.messages import Accepted, MessageIntake, Refusal, Submission

if TYPE_CHECKING:
    from config_rollout.device.review import ConfigReviews

log = logging.getLogger(__name__)

HEAD_MAX = 16 * 1024
HEAD_TIMEOUT_S = 10.0  # a request head, from its first byte (and a new connection's first request)
IDLE_TIMEOUT_S = 15.0  # a kept-alive connection between requests (the client opens a new one)
BODY_TIMEOUT_S = 30.0  # a request body
_JSON_TYPES = ("application/json",)
_MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")

StatusReader = Callable[[], Awaitable[dict[str, Any]]]
#: A configuration target's view by name (None: no such target).
ConfigReader = Callable[[str], Awaitable["dict[str, Any] | None"]]
CONFIG_WAIT_MAX_S = 60.0
CONFIG_POLL_S = 1.0  # how often a long poll looks at the target again


class HttpError(Exception):
    def __init__(self, status: int, error: str, *, field: str | None = None,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.status = status
        self.error = error
        self.field = field
        self.headers = headers
        super().__init__(error)


def _peer_allowed(sock: socket.socket, gid: int | None) -> bool:
    """The connecting process runs as this agent's user, root, or a member of the socket's group
    (SO_PEERCRED, and its supplementary groups from /proc): checked again in case the socket's
    mode was widened by hand."""
    try:
        pid, uid, pgid = peer_credentials(sock)
    except OSError:
        return False
    if uid in (0, os.getuid()):
        return True
    if gid is None:
        return False
    if pgid == gid:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        # hidden from us (systemd's ProtectProc=invisible): the kernel let it open the 0660 socket,
        # which already took our user, the socket's group (supplementary too) or root
        return True
    for line in status.splitlines():
        if line.startswith("Groups:"):
            return str(gid) in line.split()[1:]
    return False


def _answers(path: Path) -> bool:
    """Someone accepts connections on the Unix socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


class LocalApi(PartBase):
    """`LocalApi(intake, status, socket_path=..., ...)`; `start()` / `stop()`. A part of the worker
    (`agent.service.parts`): started after it, stopped before it (no new messages while stopping)."""

    name = "local API"

    def __init__(self, intake: MessageIntake, status: StatusReader, *, clock: Clock, socket_path: Path | None,
                 group: str = "edge-agent", listen: str = "", max_body_bytes: int = 4 * 1024 * 1024,
                 max_batch: int = 500, max_connections: int = 32, configs: ConfigReader | None = None,
                 reviews: ConfigReviews | None = None, pointer: Path | None = None) -> None:
        self._intake = intake
        self._configs = configs
        self._reviews = reviews
        self._status = status
        self._clock = clock
        self._refusals = RateLimitedLog(log, clock, 60.0)  # undecodable bodies: one line a minute
        self.socket_path = socket_path
        # where a client outside the unit looks (DATA_DIR/api.sock): a link to the socket when it
        # listens elsewhere (systemd's RUNTIME_DIRECTORY, which only the unit knows)
        self.pointer = pointer
        self._group = group
        self._address = parse_listen(listen, key="local_api.listen") if listen else None
        self._max_batch = max_batch
        self._http = HttpServer(self._handle, name="local API", admit=self._admit,
                                refusal=lambda status, reason: _json(status, {"error": reason}), limits=Limits(
            max_head_bytes=HEAD_MAX, max_body_bytes=max_body_bytes, head_timeout_s=HEAD_TIMEOUT_S,
            body_timeout_s=BODY_TIMEOUT_S, idle_timeout_s=IDLE_TIMEOUT_S, max_connections=max_connections))
        self._servers: list[asyncio.Server] = []
        self._gid: int | None = None
        self._refused = 0  # requests this API refused (4xx of its own)
        self.refused_peers = 0

    @property
    def requests(self) -> int:
        return self._http.stats.requests

    @property
    def bad_requests(self) -> int:
        """Requests refused as wrong: by the HTTP layer (malformed, too large) or by the API."""
        return self._http.stats.bad_requests + self._refused

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        for server in self._servers:
            for sock in server.sockets:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    name = sock.getsockname()
                    return str(name[0]), int(name[1])
        return None

    async def start(self) -> None:
        if self.socket_path is not None:
            await self._start_unix(self.socket_path)
        if self._address is not None:
            host, port = self._address
            try:
                self._servers.append(await asyncio.start_server(
                    self._http.connection, host, port, reuse_address=True, backlog=self._http.backlog))
            except OSError as exc:
                raise ConfigError("config", "local_api.listen",
                                  f"cannot listen on {host}:{port}: {exc.strerror}") from exc

    async def _start_unix(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():  # the link a start under systemd left to its runtime socket
                path.unlink()
            if path.is_socket() or path.exists():
                if not path.is_socket():
                    raise ConfigError("config", "local_api.socket", f"{path} exists and is not a socket")
                if _answers(path):
                    raise ConfigError("config", "local_api.socket",
                                      f"another agent listens on {path}: give this one its own socket")
                path.unlink()  # a socket left by an agent that died
            # Bound under the process's own umask (the service's 0027: no moment with access for
            # others), then opened to the group. Never a umask of its own around the bind: the
            # umask is the whole process's, and every thread and task creating a folder
            # meanwhile would take it (a board's updater made its state folder 0660 that way).
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(str(path))
                os.chmod(path, 0o660)
            except OSError:
                sock.close()
                raise
            server = await asyncio.start_unix_server(self._http.connection, sock=sock, backlog=self._http.backlog)
        except OSError as exc:
            raise ConfigError("config", "local_api.socket", f"cannot listen on {path}: {exc.strerror or exc}") from exc
        self._servers.append(server)
        try:
            self._gid = grp.getgrnam(self._group).gr_gid
            if os.stat(path).st_gid != self._gid:  # (the unit's own group already: its filter refuses chown)
                os.chown(path, -1, self._gid)
        except KeyError:
            log.warning("local API: no group %r on this system; only this agent's user may use %s", self._group, path)
        except OSError as exc:
            log.warning("local API: cannot give %s to group %r: %s", path, self._group, exc.strerror)
        if self.pointer is not None and self.pointer != path:
            self._point_to(path, self.pointer)
        log.info("local API listening", extra={"kv": {"socket": str(path), "group": self._group}})

    @staticmethod
    def _point_to(path: Path, pointer: Path) -> None:
        """`pointer` made a link to `path` (renamed over: an old socket or link goes at once)."""
        link = pointer.with_name(f".{pointer.name}.link")
        try:
            link.unlink(missing_ok=True)
            os.symlink(path, link)
            os.replace(link, pointer)
        except OSError as exc:
            log.warning("local API: cannot link %s to %s (a client outside the unit names the socket itself): %s",
                        pointer, path, exc.strerror or exc)

    async def stop(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
        await self._http.close()
        for server in servers:
            await server.wait_closed()
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                if self.socket_path.is_socket():
                    self.socket_path.unlink()

    # -- connections -------------------------------------------------------------------------
    def _admit(self, writer: asyncio.StreamWriter) -> Response | None:
        """A peer on the Unix socket must be this agent's user, root or in the API's group."""
        sock = writer.get_extra_info("socket")
        if sock is None or sock.family != socket.AF_UNIX or _peer_allowed(sock, self._gid):
            return None
        self.refused_peers += 1
        return _json(403, {"error": "not a member of the local API's group"})

    async def serve(self, request: Request) -> Response:
        """One request, answered as on the socket: the HTTP layer's handler (and a simulated
        device's application's way in)."""
        return await self._handle(request)

    async def _handle(self, request: Request) -> Response:
        try:
            status, body, headers = await self._route(request)
        except HttpError as exc:
            self._refused += 1
            status, body, headers = exc.status, _error_body(exc), exc.headers
        return _json(status, body, headers)

    # -- the API -----------------------------------------------------------------------------
    async def _route(self, req: Request) -> tuple[int, dict[str, Any], tuple[tuple[str, str], ...]]:
        if req.path == "/v1/status":
            if req.method not in ("GET", "HEAD"):
                raise HttpError(405, "GET only", headers=(("Allow", "GET"),))
            return 200, await self._status(), ()
        if req.path == "/v1/messages" or req.path.startswith("/v1/messages/"):
            if req.method != "POST":
                raise HttpError(405, "POST only", headers=(("Allow", "POST"),))
            try:
                if req.path == "/v1/messages":
                    return await self._post_messages(req)
                return await self._post_raw(req, req.path.removeprefix("/v1/messages/"))
            except Refusal as exc:
                headers = (("Retry-After", str(exc.retry_after_s)),) if exc.retry_after_s else ()
                raise HttpError(exc.status, exc.detail, field=exc.field, headers=headers) from None
        if req.path.startswith("/v1/config/"):
            name, _, step = req.path.removeprefix("/v1/config/").partition("/")
            if step == "verdict":
                if req.method != "POST":
                    raise HttpError(405, "POST only", headers=(("Allow", "POST"),))
                return 200, self._verdict(req, name), ()
            if req.method not in ("GET", "HEAD"):
                raise HttpError(405, "GET only", headers=(("Allow", "GET"),))
            if step == "staged":
                return 200, await self._staged(req, name), ()
            if not step:
                return 200, await self._config(req, name), ()
        raise HttpError(404, f"no such endpoint {req.path[:80]!r} (POST /v1/messages, GET /v1/status,"
                             " GET /v1/config/NAME, GET /v1/config/NAME/staged, POST /v1/config/NAME/verdict)")

    def _review_board(self, name: str) -> ConfigReviews:
        if self._reviews is None or self._configs is None:
            raise HttpError(404, "this device declares no configuration targets ([config_targets])")
        if not re.fullmatch(TARGET_NAME, name):
            raise HttpError(400, "a target's name is 1-64 of a-z 0-9 _ . -", field="name")
        return self._reviews

    async def _staged(self, req: Request, name: str) -> dict[str, Any]:
        """The release staged for the target's applications to judge ({"review": null} when none
        is, after waiting up to ?wait=S for one)."""
        board = self._review_board(name)
        if await self._configs(name) is None:  # type: ignore[misc]
            raise HttpError(404, f"no configuration target {name!r} on this device")
        review = await board.wait_pending(name, _wait_s(_one(req.query, "wait")))
        return review.view() if review is not None else {"review": None}

    def _verdict(self, req: Request, name: str) -> dict[str, Any]:
        """{"review", "accept", "reason"}: the first verdict on a staged release decides."""
        from config_rollout.device.review import REASON_MAX

        board = self._review_board(name)
        try:
            doc = json.loads(req.body)
        except ValueError:
            raise HttpError(400, "the body is not JSON") from None
        if not isinstance(doc, dict):
            raise HttpError(400, 'give {"review": ID, "accept": true|false, "reason": TEXT}')
        review, accept, reason = doc.get("review"), doc.get("accept"), doc.get("reason", "")
        if not isinstance(review, str) or not 1 <= len(review) <= 64:
            raise HttpError(400, "review: the id GET /v1/config/NAME/staged gave", field="review")
        if not isinstance(accept, bool):
            raise HttpError(400, "accept: true or false", field="accept")
        if not isinstance(reason, str) or len(reason) > REASON_MAX:
            raise HttpError(400, f"reason: text of at most {REASON_MAX} characters", field="reason")
        if not board.answer(name, review, accept=accept, reason=reason):
            raise HttpError(409, f"no open review {review!r} of {name}: another verdict came first, or its time ran"
                                 " out")
        log.info("config %s: an application %s the staged release%s", name, "accepted" if accept else "vetoed",
                 f" ({reason[:200]})" if reason else "")
        return {"recorded": True}

    async def _config(self, req: Request, name: str) -> dict[str, Any]:
        """A target's view; with ?version=V&wait=S, once it is not V (or S seconds passed)."""
        if self._configs is None:
            raise HttpError(404, "this device declares no configuration targets ([config_targets])")
        if not re.fullmatch(TARGET_NAME, name):
            raise HttpError(400, "a target's name is 1-64 of a-z 0-9 _ . -", field="name")
        known = _one(req.query, "version")
        wait_s = _wait_s(_one(req.query, "wait"))
        view = await self._configs(name)
        if view is None:
            raise HttpError(404, f"no configuration target {name!r} on this device")
        deadline = self._clock.monotonic() + wait_s
        while known is not None and view["version"] == known and self._clock.monotonic() < deadline:
            await self._clock.sleep(min(CONFIG_POLL_S, deadline - self._clock.monotonic()))
            view = await self._configs(name) or view
        return {**view, "changed": known is None or view["version"] != known}

    def _log_refusal(self, exc: HttpError) -> HttpError:
        """A body an application could not have meant: logged (once a minute), then answered."""
        self._refusals.log(logging.WARNING, "body", f"local API: refused a request: {exc.error}"[:300])
        return exc

    async def _post_raw(self, req: Request, cls: str) -> tuple[int, dict[str, Any], tuple[tuple[str, str], ...]]:
        sub = Submission(cls=cls, payload=req.body,
                         content_type=req.headers.get("content-type", "application/octet-stream"),
                         key=_one(req.query, "key"), ttl_s=_ttl(_one(req.query, "ttl"), "ttl"),
                         app_id=_one(req.query, "app_id"))
        return _accepted(await self._intake.submit(sub))

    async def _post_messages(self, req: Request) -> tuple[int, dict[str, Any], tuple[tuple[str, str], ...]]:
        ctype = req.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        try:
            if ctype in _JSON_TYPES:
                doc = json.loads(req.body, parse_constant=_no_constant, parse_float=_finite)
            elif ctype in _MSGPACK_TYPES:
                doc = msgspec.msgpack.decode(req.body)
            else:
                raise HttpError(415, f"Content-Type {ctype!r}: send application/json or application/msgpack,"
                                     " or POST the raw payload to /v1/messages/CLASS")
        except RecursionError:
            raise self._log_refusal(HttpError(400, f"body is not valid {ctype}: nested too deeply")) from None
        except (ValueError, msgspec.DecodeError) as exc:
            raise self._log_refusal(HttpError(400, f"body is not valid {ctype}: {exc}")) from None
        if not isinstance(doc, dict):
            raise HttpError(400, "body must be an object")
        if "messages" in doc:
            items = doc["messages"]
            if not isinstance(items, list) or not items:
                raise HttpError(400, "must be a non-empty list", field="messages")
            if len(items) > self._max_batch:
                raise HttpError(413, f"{len(items)} messages, over local_api.max_batch {self._max_batch}",
                                field="messages")
            subs = [_submission(item, f"messages.{i}.") for i, item in enumerate(items)]
            done = await self._intake.submit_many(subs)
            return 202, {"ids": [a.msg_id for a in done], "path": "outbox",
                         "messages": [_answer(a) for a in done]}, ()
        return _accepted(await self._intake.submit(_submission(doc, "")))


def _json(status: int, body: dict[str, Any], headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, (json.dumps(body, sort_keys=True) + "\n").encode(), "application/json", headers=headers)


def _answer(done: Accepted) -> dict[str, Any]:
    return {"id": done.msg_id, "path": done.path, "duplicate": done.duplicate}


def _accepted(done: Accepted) -> tuple[int, dict[str, Any], tuple[tuple[str, str], ...]]:
    return 202, _answer(done), ()


def _error_body(exc: HttpError) -> dict[str, Any]:
    body: dict[str, Any] = {"error": exc.error}
    if exc.field:
        body["field"] = exc.field
    return body


def _wait_s(text: str | None) -> float:
    """A long poll's ?wait=S, at most CONFIG_WAIT_MAX_S."""
    try:
        return min(CONFIG_WAIT_MAX_S, max(0.0, float(text))) if text else 0.0
    except ValueError:
        raise HttpError(400, f"wait: {(text or '')[:20]!r} is not a number of seconds", field="wait") from None


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[-1] if values else None


def _ttl(value: object, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise HttpError(400, "must be seconds or a duration such as 1h", field=field)
    if isinstance(value, int | float):
        return float(value)
    try:
        return parse_seconds(str(value))
    except ValueError as exc:
        raise HttpError(400, str(exc), field=field) from None


_FIELDS = {"class", "payload", "payload_base64", "content_type", "key", "ttl", "app_id"}


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:40]} is not a JSON number (out of range)")
    return value


def _json_payload(value: object, field: str) -> bytes:
    """A JSON payload as it is stored and forwarded: valid UTF-8, finite numbers only."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:
        raise HttpError(400, "not valid Unicode (a lone surrogate)", field=field) from None
    except ValueError:  # a NaN or an infinity (from msgpack: JSON has neither)
        raise HttpError(400, "NaN or Infinity is not a JSON number", field=field) from None
    except RecursionError:
        raise HttpError(400, "nested too deeply", field=field) from None


def _text(item: dict[str, Any], name: str, prefix: str) -> str | None:
    """A string field of a message, or None; 400 naming it when it is not a valid UTF-8 string."""
    value = item.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise HttpError(400, "must be a string", field=f"{prefix}{name}")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise HttpError(400, "not valid Unicode (a lone surrogate)", field=f"{prefix}{name}") from None
    return value


def _submission(item: object, prefix: str) -> Submission:
    """One message object of a request body."""
    if not isinstance(item, dict):
        raise HttpError(400, "must be an object", field=prefix.rstrip(".") or None)
    unknown = sorted(set(item) - _FIELDS)
    if unknown:
        raise HttpError(400, f"unknown field (the fields are {', '.join(sorted(_FIELDS))})",
                        field=f"{prefix}{unknown[0]}")
    cls = item.get("class")
    if not isinstance(cls, str) or not cls:
        raise HttpError(400, "required, a class name", field=f"{prefix}class")
    key = _text(item, "key", prefix)
    ctype = _text(item, "content_type", prefix)
    app_id = _text(item, "app_id", prefix)
    if "payload_base64" in item:
        if "payload" in item:
            raise HttpError(400, "give payload or payload_base64, not both", field=f"{prefix}payload")
        raw = item["payload_base64"]
        if not isinstance(raw, str):
            raise HttpError(400, "must be a base64 string", field=f"{prefix}payload_base64")
        try:
            payload = base64.b64decode(raw, validate=True)
        except ValueError:
            raise HttpError(400, "not valid base64", field=f"{prefix}payload_base64") from None
        ctype = ctype or "application/octet-stream"
    elif "payload" in item:
        value = item["payload"]
        if isinstance(value, bytes):  # msgpack bin
            payload, ctype = value, ctype or "application/octet-stream"
        else:
            payload = _json_payload(value, f"{prefix}payload")
            ctype = ctype or "application/json"
    else:
        raise HttpError(400, "required (or payload_base64)", field=f"{prefix}payload")
    return Submission(cls=cls, payload=payload, content_type=ctype, key=key,
                      ttl_s=_ttl(item.get("ttl"), f"{prefix}ttl"), app_id=app_id)


__all__ = ["LocalApi"]
