"""A client of the worker's local API for Python applications on the device (stdlib only).

    from agent.client import Client

    agent = Client.from_config("/etc/edge-agent/worker.toml")   # or Client("/run/edge-agent/api.sock")
    agent.send("telemetry", {"t": 21.5})                          # returns once the message is durable
    agent.send("state", {"door": "open"}, key="door")             # an overwrite class: newest per key
    agent.send("events", b"\\x01\\x02", content_type="application/octet-stream", ttl="1h")

`AsyncClient` is the same for asyncio. A refusal raises `LocalApiError` with the HTTP status,
the wrong field and, for a full class (429), `retry_after_s`; an agent that is not there raises
`AgentUnavailable`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

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


def _request(cls: str, payload: bytes | JsonValue, *, key: str | None, ttl: float | str | None,
             content_type: str | None) -> tuple[str, bytes, str]:
    """(path, body, content type) of one message."""
    if isinstance(payload, bytes | bytearray | memoryview):
        query = {k: str(v) for k, v in (("key", key), ("ttl", ttl)) if v is not None}
        path = f"/v1/messages/{quote(cls, safe='')}" + (f"?{urlencode(query)}" if query else "")
        return path, bytes(payload), content_type or "application/octet-stream"
    doc: dict[str, Any] = {"class": cls, "payload": payload}
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


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Client:
    """Synchronous; one connection, reused across calls (HTTP/1.1 keep-alive)."""

    def __init__(self, socket_path: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = str(socket_path)
        self._timeout_s = timeout_s
        self._conn: _UnixConnection | None = None

    @classmethod
    def from_config(cls, config_path: str | Path, **kwargs: float) -> Client:
        return cls(local_api_socket(load_config(config_path)), **kwargs)

    def send(self, cls: str, payload: bytes | JsonValue, *, key: str | None = None, ttl: float | str | None = None,
             content_type: str | None = None) -> str:
        """Hand over one message; returns its id once the agent holds it durably."""
        path, body, ctype = _request(cls, payload, key=key, ttl=ttl, content_type=content_type)
        return str(self._call("POST", path, body, ctype)["id"])

    def send_many(self, messages: Sequence[Mapping[str, Any]]) -> list[str]:
        """Several messages (each {"class", "payload", ...}) in one transaction, all or none."""
        body = json.dumps({"messages": list(messages)}).encode()
        return [str(i) for i in self._call("POST", "/v1/messages", body, "application/json")["ids"]]

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status", b"", "")

    def _call(self, method: str, path: str, body: bytes, ctype: str) -> dict[str, Any]:
        for attempt in (1, 2):  # a kept-alive connection the agent closed meanwhile: once more, anew
            if self._conn is None:
                self._conn = _UnixConnection(self.socket_path, self._timeout_s)
            headers = {"Content-Type": ctype} if ctype else {}
            try:
                self._conn.request(method, path, body=body, headers=headers)
                response = self._conn.getresponse()
                data = response.read()
            except (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError) as exc:
                self.close()
                if attempt == 2:
                    raise AgentUnavailable(f"{self.socket_path}: {exc}") from None
                continue
            except OSError as exc:
                self.close()
                raise AgentUnavailable(f"{self.socket_path}: {exc.strerror or exc}") from None
            if response.getheader("connection", "").lower() == "close":
                self.close()
            return _answer(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

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
                   ttl: float | str | None = None, content_type: str | None = None) -> str:
        path, body, ctype = _request(cls, payload, key=key, ttl=ttl, content_type=content_type)
        return str((await self._call("POST", path, body, ctype))["id"])

    async def send_many(self, messages: Sequence[Mapping[str, Any]]) -> list[str]:
        body = json.dumps({"messages": list(messages)}).encode()
        return [str(i) for i in (await self._call("POST", "/v1/messages", body, "application/json"))["ids"]]

    async def status(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/status", b"", "")

    async def _call(self, method: str, path: str, body: bytes, ctype: str) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(self._exchange(method, path, body, ctype), self._timeout_s)
        except TimeoutError:
            raise AgentUnavailable(f"{self.socket_path}: no answer within {self._timeout_s}s") from None

    async def _exchange(self, method: str, path: str, body: bytes, ctype: str) -> dict[str, Any]:
        try:
            reader, writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError as exc:
            raise AgentUnavailable(f"{self.socket_path}: {exc.strerror or exc}") from None
        try:
            head = [f"{method} {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}",
                    "Connection: close"]
            if ctype:
                head.append(f"Content-Type: {ctype}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            data = await reader.readexactly(int(headers.get("content-length", "0")))
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            raise AgentUnavailable(f"{self.socket_path}: {exc}") from None
        finally:
            writer.close()
        return _answer(status, headers, data)


__all__ = ["AgentUnavailable", "AsyncClient", "Client", "LocalApiError"]
