"""sd_notify against a real NOTIFY_SOCKET: readiness, status, stopping, the watchdog cadence."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from svc_notify import NotifyListener

from agent.core.clock import VirtualClock
from agent.service.sdnotify import (
    Notifier,
    Watchdog,
    notify_ready,
    notify_stopping,
    watchdog_timeout_s,
)


def test_unset_variable_is_a_no_op() -> None:
    notifier = Notifier(env={})
    assert not notifier.enabled
    assert notifier.ready("up") is False
    assert notifier.watchdog() is False
    assert notify_ready(env={}) is False


def test_ready_status_and_stopping_reach_the_socket(notify_socket: NotifyListener) -> None:
    assert notify_ready("opened database, actors started", env=notify_socket.env)
    assert notify_socket.receive() == "READY=1\nSTATUS=opened database, actors started"
    assert notify_stopping("flushing\noutbox", env=notify_socket.env)
    # a status is one line: newlines and runs of space collapse
    assert notify_socket.receive() == "STOPPING=1\nSTATUS=flushing outbox"


def test_abstract_namespace_socket(abstract_notify_socket: NotifyListener) -> None:
    assert abstract_notify_socket.address.startswith("@")
    notifier = Notifier(env=abstract_notify_socket.env)
    assert notifier.enabled
    assert notifier.ready()
    assert notifier.watchdog()
    assert abstract_notify_socket.drain() == ["READY=1", "WATCHDOG=1"]
    notifier.close()


def test_reloading_carries_monotonic_usec(notify_socket: NotifyListener) -> None:
    notifier = Notifier(env=notify_socket.env)
    before = time.monotonic_ns() // 1000
    assert notifier.reloading("re-reading config")
    lines = notify_socket.receive().split("\n")
    assert lines[0] == "RELOADING=1"
    key, value = lines[1].split("=")
    assert key == "MONOTONIC_USEC" and int(value) >= before
    assert lines[2] == "STATUS=re-reading config"
    assert notifier.extend_timeout(2.5)
    assert notify_socket.receive() == "EXTEND_TIMEOUT_USEC=2500000"
    notifier.close()


def test_malformed_assignment_is_refused(notify_socket: NotifyListener) -> None:
    notifier = Notifier(env=notify_socket.env)
    with pytest.raises(ValueError):
        notifier.notify("READY=1\nWATCHDOG=1")
    with pytest.raises(ValueError):
        notifier.notify("READY")
    notifier.close()


def test_unsupported_address_disables_notifications() -> None:
    assert not Notifier(env={"NOTIFY_SOCKET": "vsock:2:1234"}).enabled


def test_vanished_socket_is_reported_not_raised(tmp_path) -> None:
    notifier = Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.enabled
    assert notifier.ready() is False
    notifier.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
    ],
)
def test_watchdog_timeout_from_environment(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_timeout_s(env) == expected


async def test_watchdog_pings_at_half_the_interval_on_virtual_time(
    notify_socket: NotifyListener,
) -> None:
    clock = VirtualClock()
    env = {**notify_socket.env, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    watchdog = Watchdog(clock, env=env)
    assert watchdog.enabled and watchdog.interval_s == 15.0
    task = asyncio.create_task(watchdog.run())
    ping_times: list[float] = []
    for _ in range(61):
        await clock.settle()
        for message in notify_socket.drain():
            assert message == "WATCHDOG=1"
            ping_times.append(clock.monotonic())
        await clock.advance(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ping_times == [0.0, 15.0, 30.0, 45.0, 60.0]
    assert watchdog.pings == 5


async def test_watchdog_off_returns_at_once(notify_socket: NotifyListener) -> None:
    clock = VirtualClock()
    watchdog = Watchdog(clock, env=notify_socket.env)  # no WATCHDOG_USEC
    assert not watchdog.enabled
    await asyncio.wait_for(watchdog.run(), 5)
    assert notify_socket.drain() == []


async def test_watchdog_withholds_pings_while_a_subsystem_is_dead(
    notify_socket: NotifyListener,
) -> None:
    clock = VirtualClock()
    alive = True
    env = {**notify_socket.env, "WATCHDOG_USEC": "10000000"}
    watchdog = Watchdog(clock, env=env, alive=lambda: alive)
    task = asyncio.create_task(watchdog.run())
    await clock.advance(5.0)
    assert notify_socket.drain() == ["WATCHDOG=1", "WATCHDOG=1"]
    alive = False
    await clock.advance(10.0)
    assert notify_socket.drain() == []
    assert watchdog.withheld == 2
    alive = True
    await clock.advance(5.0)
    assert notify_socket.drain() == ["WATCHDOG=1"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_blocked_event_loop_stops_the_pings(notify_socket: NotifyListener) -> None:
    """The pings come from the event loop itself: while it is wedged, none are sent."""
    from agent.core.clock import SystemClock

    env = {**notify_socket.env, "WATCHDOG_USEC": "40000"}  # a ping every 20 ms
    watchdog = Watchdog(SystemClock(), env=env)
    task = asyncio.create_task(watchdog.run())
    loop = asyncio.get_running_loop()
    notify_socket.sock.setblocking(False)
    for _ in range(3):  # the pinger is running
        assert await loop.sock_recv(notify_socket.sock, 64) == b"WATCHDOG=1"
    notify_socket.drain()
    sent_before = watchdog.pings
    time.sleep(0.5)  # wedge the loop for 25 intervals
    assert notify_socket.drain() == []
    assert watchdog.pings == sent_before
    # once the loop runs again, so do the pings
    assert await loop.sock_recv(notify_socket.sock, 64) == b"WATCHDOG=1"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
