"""run(): uvloop when installed and wanted, plain asyncio otherwise."""

from __future__ import annotations

import asyncio
import importlib

import pytest

from agent.actors import Actor, ActorSystem, Context, run, uvloop_factory


class Echo(Actor):
    async def receive(self, message: object, ctx: Context) -> object:
        return message


async def _main() -> tuple[str, object]:
    async with ActorSystem() as system:
        ref = system.spawn(Echo(), name="echo")
        reply = await ref.ask("hello", timeout_s=5.0)
    return type(asyncio.get_running_loop()).__module__, reply


def test_run_uses_uvloop_when_installed_and_asked() -> None:
    pytest.importorskip("uvloop")
    module, reply = run(_main())
    assert module.startswith("uvloop") and reply == "hello"


def test_run_without_uvloop_uses_asyncio() -> None:
    module, reply = run(_main(), use_uvloop=False)
    assert module.startswith("asyncio") and reply == "hello"


def test_run_falls_back_when_uvloop_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_uvloop(name: str, package: str | None = None) -> object:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_uvloop)
    assert uvloop_factory() is None
    module, reply = run(_main())
    assert module.startswith("asyncio") and reply == "hello"
