"""A client of the worker's local API for Python applications on the device (h11 frames HTTP, as
the agent's own servers do; nothing else beyond the standard library).

    from agent.client import Client

    agent = Client.from_config("/etc/edge-agent/worker.toml")   # or Client("/run/edge-agent/api.sock")
    agent.send("telemetry", {"t": 21.5})                          # returns once the message is durable
    agent.send("state", {"door": "open"}, key="door")             # an overwrite class: newest per key
    agent.send("events", b"\\x01\\x02", content_type="application/octet-stream", ttl="1h")

    agent.config("app")["documents"]["app.toml"]["text"]           # a configuration target's documents
    for view in agent.watch_config("app"): ...                    # each version applied, as it comes
    staged = agent.staged_config("app")                           # a release waiting for our verdict
    agent.judge_config("app", staged["review"], accept=False, reason="port 80 is taken")

`AsyncClient` is the same for asyncio. A refusal raises `LocalApiError` with the HTTP status,
the wrong field and, for a full class (429), `retry_after_s`; an agent that is not there raises
`AgentUnavailable`.

Every message is named (`app_id`: given, or made here, one per call): a POST whose answer was
lost (the connection broke, the agent restarted) is sent again under the same name, and the
agent answers the copy as the duplicate it is instead of storing it twice. A POST is never sent
again without its name. `submit` returns the whole answer (`Receipt`); `send` its id.
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote, urlencode

import h11

from agent.core.config import load_config, local_api_socket

JsonValue = Any  # whatever json.dumps takes
DEFAULT_TIMEOUT_S = 30.0


class LocalApiError(Exception):
    """The agent refused a request: `status` (400, 413, 429, 503...), `field`, `retry_after_s`."""

    def __init__(self, status: int, error: str, field: str | None = None, retry_after_s: float | None = None) -> None:
        self.status = status
        self.error = error
        self.field = field
        self.retry_after_s = retry_after_s
        super().__init__(f"{status}: {field + ': ' if field else ''}{error}")


class AgentUnavailable(Exception):
    """No agent answers on the socket (not running, no permission, wrong path)."""


class Receipt(NamedTuple):
    """The agent's answer to one message: its `id`, the `path` that took it ("direct": the leader
    holds it; "outbox": this device's outbox does), whether it was a `duplicate` of one taken
    before under the same `app_id` (then id and path are the first one's)."""

    id: str
    path: str
    duplicate: bool
    app_id: str


def new_app_id() -> str:
    """A name for one message, unique without coordination (what `send` uses when given none)."""
    return uuid.uuid4().hex


def _request(cls: str, payload: bytes | JsonValue, *, key: str | None, ttl: float | str | None,
             content_type: str | None, app_id: str) -> tuple[str, bytes, str]:
    """(path, body, content type) of one message."""
    if isinstance(payload, bytes | bytearray | memoryview):
        query = {k: str(v) for k, v in (("key", key), ("ttl", ttl), ("app_id", app_id)) if v is not None}
        path = f"/v1/messages/{quote(cls, safe='')}" + (f"?{urlencode(query)}" if query else "")
        return path, bytes(payload), content_type or "application/octet-stream"
    doc: dict[str, Any] = {"class": cls, "payload": payload, "app_id": app_id}
    if key is not None:
        doc["key"] = key
    if ttl is not None:
        doc["ttl"] = ttl
    if content_type is not None:
        doc["content_type"] = content_type
    return "/v1/messages", json.dumps(doc).encode(), "application/json"


def _answer(status: int, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        doc = {"error": body[:200].decode("utf-8", "replace")}
    if status >= 400:
        retry = headers.get("retry-after")
        raise LocalApiError(status, str(doc.get("error", "")), doc.get("field"),
                            float(retry) if retry and retry.isdigit() else None)
    return dict(doc)


def _receipt(doc: Mapping[str, Any], app_id: str) -> Receipt:
    return Receipt(str(doc["id"]), str(doc.get("path", "")), bool(doc.get("duplicate", False)), app_id)


def _named(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The batch's messages, each with an app_id (made here when it has none)."""
    return [{**m, "app_id": m.get("app_id") or new_app_id()} for m in messages]


class _Exchange:
    """One request and its response on an h11 connection, sans I/O: `request()` gives the bytes
    to send, `feed()` takes what came back until it returns (status, headers, body)."""

    def __init__(self, conn: h11.Connection) -> None:
        self._conn = conn
        self._status = 0
        self._headers: dict[str, str] = {}
        self._body = bytearray()

    def request(self, method: str, path: str, body: bytes, ctype: str, *, close: bool) -> bytes:
        conn = self._conn
        headers = [("Host", "localhost"), ("Content-Length", str(len(body)))]
        if ctype:
            headers.append(("Content-Type", ctype))
        if close:
            headers.append(("Connection", "close"))
        out = conn.send(h11.Request(method=method, target=path, headers=headers)) or b""
        if body:
            out += conn.send(h11.Data(data=body)) or b""
        return out + (conn.send(h11.EndOfMessage()) or b"")

    def feed(self, data: bytes) -> tuple[int, dict[str, str], bytes] | None:
        conn = self._conn
        conn.receive_data(data)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                return None
            if isinstance(event, h11.Response):
                self._status = event.status_code
                self._headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return self._status, self._headers, bytes(self._body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the agent closed the connection before it answered")


def _config_path(name: str, *, version: str | None = None, wait_s: float | None = None, step: str = "") -> str:
    query = {**({"version": version} if version is not None else {}), **({"wait": f"{wait_s:g}"} if wait_s else {})}
    return f"/v1/config/{quote(name, safe='')}" + (f"/{step}" if step else "") + (
        f"?{urlencode(query)}" if query else "")


def _verdict(review: str, accept: bool, reason: str) -> bytes:
    return json.dumps({"review": review, "accept": accept, "reason": reason}).encode()


class Client:
    """Synchronous; one connection, reused across calls (HTTP/1.1 keep-alive)."""

    def __init__(self, socket_path: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = str(socket_path)
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._conn: h11.Connection | None = None

    @classmethod
    def from_config(cls, config_path: str | Path, **kwargs: float) -> Client:
        return cls(local_api_socket(load_config(config_path)), **kwargs)

    def send(self, cls: str, payload: bytes | JsonValue, *, key: str | None = None, ttl: float | str | None = None,
             content_type: str | None = None, app_id: str | None = None) -> str:
        """Hand over one message; returns its id once the agent holds it durably."""
        return self.submit(cls, payload, key=key, ttl=ttl, content_type=content_type, app_id=app_id).id

    def submit(self, cls: str, payload: bytes | JsonValue, *, key: str | None = None,
               ttl: float | str | None = None, content_type: str | None = None,
               app_id: str | None = None) -> Receipt:
        """`send`, answering the whole `Receipt`. `app_id`: the message's name (made when None);
        give the same one to send the same message again after an `AgentUnavailable`."""
        name = app_id or new_app_id()
        path, body, ctype = _request(cls, payload, key=key, ttl=ttl, content_type=content_type, app_id=name)
        return _receipt(self._call("POST", path, body, ctype), name)

    def send_many(self, messages: Sequence[Mapping[str, Any]]) -> list[str]:
        """Several messages (each {"class", "payload", ...}) in one transaction, all or none."""
        body = json.dumps({"messages": _named(messages)}).encode()
        return [str(i) for i in self._call("POST", "/v1/messages", body, "application/json")["ids"]]

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status", b"", "")

    def config(self, name: str) -> dict[str, Any]:
        """A configuration target's applied release: version, state, drift, documents."""
        return self._call("GET", _config_path(name), b"", "")

    def watch_config(self, name: str, *, version: str | None = None, wait_s: float = 30.0) -> Iterator[dict[str, Any]]:
        """Each version of the target as it is applied: the current one first (unless it is
        `version`), then every change, by long polls of `wait_s` (at most 60)."""
        while True:
            view = self._call("GET", _config_path(name, version=version, wait_s=wait_s), b"", "",
                              timeout_s=wait_s + self._timeout_s)
            if view.get("changed"):
                version = str(view["version"])
                yield view

    def staged_config(self, name: str, *, wait_s: float = 30.0) -> dict[str, Any] | None:
        """A release of the target staged for the applications' verdict (a target with
        `app_validate_s`): {"review", "version", "documents"}; None when none came within
        `wait_s` (at most 60)."""
        view = self._call("GET", _config_path(name, wait_s=wait_s, step="staged"), b"", "",
                          timeout_s=wait_s + self._timeout_s)
        return view if view.get("review") else None

    def judge_config(self, name: str, review: str, *, accept: bool, reason: str = "") -> None:
        """Accept or veto a staged release (`reason` reaches the rollout's report); the first
        verdict decides. `LocalApiError` 409 when the review is over."""
        self._call("POST", _config_path(name, step="verdict"), _verdict(review, accept, reason), "application/json")

    def _connect(self) -> tuple[socket.socket, h11.Connection]:
        if self._sock is None or self._conn is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            try:
                sock.connect(self.socket_path)
            except OSError:
                sock.close()
                raise
            self._sock, self._conn = sock, h11.Connection(h11.CLIENT)
        return self._sock, self._conn

    def _call(self, method: str, path: str, body: bytes, ctype: str, *,
              timeout_s: float | None = None) -> dict[str, Any]:
        """One request. A kept-alive connection the agent closed meanwhile is tried once more on
        a new one: safe, as every request here is a GET or a POST whose messages are all named."""
        for attempt in (1, 2):
            try:
                sock, conn = self._connect()
                sock.settimeout(timeout_s or self._timeout_s)
                exchange = _Exchange(conn)
                sock.sendall(exchange.request(method, path, body, ctype, close=False))
                answer = None
                while answer is None:
                    answer = exchange.feed(sock.recv(65536))
            except (ConnectionError, h11.ProtocolError) as exc:
                self.close()
                if attempt == 2:
                    raise AgentUnavailable(f"{self.socket_path}: {exc}") from None
                continue
            except OSError as exc:
                self.close()
                raise AgentUnavailable(f"{self.socket_path}: {exc.strerror or exc}") from None
            status, headers, data = answer
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
            else:
                self.close()
            return _answer(status, headers, data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The same for asyncio: one request per connection."""

    def __init__(self, socket_path: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = str(socket_path)
        self._timeout_s = timeout_s

    @classmethod
    def from_config(cls, config_path: str | Path, **kwargs: float) -> AsyncClient:
        return cls(local_api_socket(load_config(config_path)), **kwargs)

    async def send(self, cls: str, payload: bytes | JsonValue, *, key: str | None = None,
                   ttl: float | str | None = None, content_type: str | None = None, app_id: str | None = None) -> str:
        return (await self.submit(cls, payload, key=key, ttl=ttl, content_type=content_type, app_id=app_id)).id

    async def submit(self, cls: str, payload: bytes | JsonValue, *, key: str | None = None,
                     ttl: float | str | None = None, content_type: str | None = None,
                     app_id: str | None = None) -> Receipt:
        name = app_id or new_app_id()
        path, body, ctype = _request(cls, payload, key=key, ttl=ttl, content_type=content_type, app_id=name)
        return _receipt(await self._call("POST", path, body, ctype), name)

    async def send_many(self, messages: Sequence[Mapping[str, Any]]) -> list[str]:
        body = json.dumps({"messages": _named(messages)}).encode()
        return [str(i) for i in (await self._call("POST", "/v1/messages", body, "application/json"))["ids"]]

    async def status(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/status", b"", "")

    async def config(self, name: str) -> dict[str, Any]:
        return await self._call("GET", _config_path(name), b"", "")

    async def watch_config(self, name: str, *, version: str | None = None,
                           wait_s: float = 30.0) -> AsyncIterator[dict[str, Any]]:
        """As `Client.watch_config`."""
        while True:
            view = await self._call("GET", _config_path(name, version=version, wait_s=wait_s), b"", "",
                                    timeout_s=wait_s + self._timeout_s)
            if view.get("changed"):
                version = str(view["version"])
                yield view

    async def staged_config(self, name: str, *, wait_s: float = 30.0) -> dict[str, Any] | None:
        """As `Client.staged_config`."""
        view = await self._call("GET", _config_path(name, wait_s=wait_s, step="staged"), b"", "",
                                timeout_s=wait_s + self._timeout_s)
        return view if view.get("review") else None

    async def judge_config(self, name: str, review: str, *, accept: bool, reason: str = "") -> None:
        """As `Client.judge_config`."""
        await self._call("POST", _config_path(name, step="verdict"), _verdict(review, accept, reason),
                         "application/json")

    async def _call(self, method: str, path: str, body: bytes, ctype: str, *,
                    timeout_s: float | None = None) -> dict[str, Any]:
        limit = timeout_s or self._timeout_s
        try:
            return await asyncio.wait_for(self._exchange(method, path, body, ctype), limit)
        except TimeoutError:
            raise AgentUnavailable(f"{self.socket_path}: no answer within {limit}s") from None

    async def _exchange(self, method: str, path: str, body: bytes, ctype: str) -> dict[str, Any]:
        try:
            reader, writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError as exc:
            raise AgentUnavailable(f"{self.socket_path}: {exc.strerror or exc}") from None
        try:
            exchange = _Exchange(h11.Connection(h11.CLIENT))
            writer.write(exchange.request(method, path, body, ctype, close=True))
            await writer.drain()
            answer = None
            while answer is None:
                answer = exchange.feed(await reader.read(65536))
        except (ConnectionError, h11.ProtocolError) as exc:
            raise AgentUnavailable(f"{self.socket_path}: {exc}") from None
        finally:
            writer.close()
        return _answer(*answer)


__all__ = ["AgentUnavailable", "AsyncClient", "Client", "LocalApiError", "Receipt", "new_app_id"]
