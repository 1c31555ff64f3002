"""ServiceRuntime: the bundle `edge-agent run` uses (notify, watchdog, endpoint, shutdown)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest
from promparse import parse
from svc_notify import NotifyListener

from agent.core.clock import VirtualClock
from agent.core.errors import ConfigError
from agent.service.runtime import ServiceRuntime


async def http_get(address: tuple[str, int], path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def test_lifecycle_ready_watchdog_endpoint_and_ordered_shutdown(
    notify_socket: NotifyListener,
) -> None:
    clock = VirtualClock()
    env = {**notify_socket.env, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    steps: list[str] = []

    async def step(name: str) -> None:
        steps.append(name)

    async def healthy():
        return True, "fine"

    runtime = ServiceRuntime(clock=clock, metrics_listen="127.0.0.1:0", env=env)
    async with runtime:
        runtime.add_check("database", healthy)
        runtime.shutdown.add("stop intake", lambda: step("stop intake"))
        runtime.shutdown.add("close outbox", lambda: step("close outbox"))
        assert runtime.ready("worker pi-0001 running")
        await clock.advance(15.0)
        address = runtime.health.address
        assert address is not None
        status, body = await http_get(address, "/metrics")
        assert status == 200
        assert "process_resident_memory_bytes" in parse(body.decode())
        assert (await http_get(address, "/healthz"))[0] == 200
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(runtime.wait_stop(), 30) == signal.SIGTERM
        assert steps == []
    assert steps == ["stop intake", "close outbox"]
    assert runtime.failures == []
    assert runtime.health.address is None  # the endpoint is closed
    messages = notify_socket.drain()
    assert messages[0] == "READY=1\nSTATUS=worker pi-0001 running"
    assert messages.count("WATCHDOG=1") == 2  # at 0 s and 15 s of the clock
    assert messages[-1].startswith("STOPPING=1")


async def test_a_failed_start_leaves_no_signal_handlers_behind(
    notify_socket: NotifyListener,
) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        runtime = ServiceRuntime(clock=VirtualClock(), metrics_listen=f"127.0.0.1:{port}",
                                 env=notify_socket.env)
        with pytest.raises(ConfigError, match="metrics.listen"):
            await runtime.__aenter__()
    finally:
        busy.close()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        assert not loop.remove_signal_handler(signum)


async def test_a_stopped_actor_fails_healthz_and_withholds_the_watchdog(notify_socket: NotifyListener) -> None:
    """An actor the supervisor gave up on must not sit behind a healthy /healthz: the check
    fails and the watchdog pings stop, so systemd restarts the agent."""
    from agent.actors import Actor, ActorSystem, Context
    from agent.actors.actor import RestartPolicy

    class Fragile(Actor):
        async def receive(self, message: object, ctx: Context) -> None:
            raise RuntimeError("poisoned message")

    clock = VirtualClock()
    env = {**notify_socket.env, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    system = ActorSystem(clock=clock, name="agent")
    await system.start()
    ref = system.spawn(Fragile(), name="intake", restart=RestartPolicy(max_restarts=0))
    runtime = ServiceRuntime(clock=clock, metrics_listen="127.0.0.1:0", env=env, install_signals=False)
    async with runtime:
        runtime.add_liveness("actors", system.problem, up="all actors running")
        runtime.ready("running")
        address = runtime.health.address
        assert address is not None
        assert (await http_get(address, "/healthz"))[0] == 200
        ref.tell("boom")
        while not system.failures:
            await clock.advance(1.0)
        status, body = await http_get(address, "/healthz")
        assert status == 503 and b"actor 'intake' stopped after 0 restarts" in body
        pings = notify_socket.drain().count("WATCHDOG=1")
        await clock.advance(60.0)
        assert notify_socket.drain().count("WATCHDOG=1") == 0 < pings  # withheld from now on
        assert runtime.watchdog.withheld > 0
    await system.stop()


async def test_an_actor_stuck_on_one_message_fails_healthz_until_it_moves(notify_socket: NotifyListener) -> None:
    """Not stopped but wedged (a receive() that never returns): past its stall_s the agent is
    as good as dead, and systemd must restart it."""
    from agent.actors import Actor, ActorSystem, Context

    release = asyncio.Event()

    class Wedged(Actor):
        async def receive(self, message: object, ctx: Context) -> None:
            await release.wait()

    clock = VirtualClock()
    env = {**notify_socket.env, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    system = ActorSystem(clock=clock, name="agent")
    await system.start()
    ref = system.spawn(Wedged(), name="leader", stall_s=120.0)
    runtime = ServiceRuntime(clock=clock, metrics_listen="127.0.0.1:0", env=env, install_signals=False)
    async with runtime:
        runtime.add_liveness("actors", system.problem, up="all actors running")
        runtime.ready("running")
        address = runtime.health.address
        assert address is not None
        ref.tell("stuck")
        await clock.advance(100.0)  # busy, within its stall_s
        assert (await http_get(address, "/healthz"))[0] == 200
        await clock.advance(30.0)
        status, body = await http_get(address, "/healthz")
        assert status == 503 and b"actor 'leader' stuck on one message for 130s (stall_s 120)" in body
        notify_socket.drain()
        await clock.advance(60.0)
        assert notify_socket.drain().count("WATCHDOG=1") == 0  # withheld while it is stuck
        release.set()
        await asyncio.sleep(0)
        assert system.problem() is None
        assert (await http_get(address, "/healthz"))[0] == 200
    await system.stop()
