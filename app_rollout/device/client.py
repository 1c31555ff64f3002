"""The agent's side of the application helper: each step a request on its socket, run in a thread."""

from __future__ import annotations

from pathlib import Path

import msgspec

from agent.core.clock import Clock
from agent.core.tasks import in_thread
from agent.service.helper_socket import HelperConnection, HelperUnreachable
from app_rollout.device.helper import (
    HELPER,
    MAX_FRAME,
    AppHelper,
    AppRecord,
    AppReply,
    AppRequest,
    decode_reply,
    encode,
)
from app_rollout.errors import AppInstallError


def _hint(exc: OSError) -> str:
    if isinstance(exc, PermissionError):
        return "is the agent's user in the socket's group (edge-agent-apps)?"
    return "is edge-agent-apps.socket enabled? (systemctl enable --now edge-agent-apps.socket)"


class AppHelperClient:
    """Asks the application helper on `socket_path`; a refusal is an `AppInstallError` saying why."""

    def __init__(self, socket_path: str | Path, *, clock: Clock, timeout_s: float = 300.0) -> None:
        self.clock = clock
        self._conn = HelperConnection(socket_path, helper=HELPER, max_frame=MAX_FRAME, timeout_s=timeout_s,
                                      hint=_hint)
        self.known: dict[str, AppRecord] | None = None  # the helper's records, as its last answer gave them
        self.root = ""  # where the helper keeps the versions (its describe says)

    def _call(self, request: AppRequest) -> AppReply:
        try:
            reply = decode_reply(self._conn.call(encode(request)))
        except (HelperUnreachable, msgspec.DecodeError) as exc:
            self._conn.close()
            raise AppInstallError(str(exc)) from None
        return self.take(request, reply)

    def take(self, request: AppRequest, reply: AppReply) -> AppReply:
        """`reply`'s records kept; a refusal raised."""
        if reply.ok or reply.apps:
            self.known = dict(reply.apps)
        if reply.root:
            self.root = reply.root
        if not reply.ok:
            raise AppInstallError(f"the application helper refused {request.op}"
                                  f"{' ' + request.name if request.name else ''}: {reply.error}")
        return reply

    def call(self, op: str, name: str = "", **fields: object) -> AppReply:
        """`ask` in this thread (`doctor`)."""
        return self._call(msgspec.convert({"op": op, "name": name, **fields}, type=AppRequest))

    async def ask(self, op: str, name: str = "", **fields: object) -> AppReply:
        request = msgspec.convert({"op": op, "name": name, **fields}, type=AppRequest)
        return await in_thread(self.clock, self._call, request)

    async def records(self) -> dict[str, AppRecord]:
        return (await self.ask("describe")).apps

    def close(self) -> None:
        self._conn.close()


class InProcessHelper(AppHelperClient):
    """The helper asked in this process (the simulator's devices: each its own `AppHelper` on
    its own files, their service manager simulated)."""

    def __init__(self, helper: AppHelper, *, clock: Clock) -> None:
        self.clock = clock
        self.helper = helper
        self.known = None
        self.root = ""

    async def ask(self, op: str, name: str = "", **fields: object) -> AppReply:
        request = msgspec.convert({"op": op, "name": name, **fields}, type=AppRequest)
        return self.take(request, await self.helper.handle(encode(request), 0))

    def close(self) -> None:
        pass


__all__ = ["AppHelperClient", "InProcessHelper"]
