"""Signals and shutdown: a real SIGTERM to a real process, and the shutdown sequence's rules."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

from svc_notify import NotifyListener

from agent.core.clock import VirtualClock
from agent.service.signals import ServiceSignals, ShutdownSequence, install_signal_handlers

REPO = Path(__file__).resolve().parents[2]

# A small service: it accepts numbered items into a write buffer (printing "ack N" as soon as an
# item is accepted, like a group-committing store does), commits the buffer every 50 ms, and on
# SIGTERM runs its shutdown steps: stop intake, flush the buffer, close the database.
PROGRAM = textwrap.dedent(
    """
    import asyncio, sqlite3, sys
    from agent.core.clock import SystemClock
    from agent.service import ServiceRuntime, setup_logging

    async def main(db_path, hang):
        setup_logging("INFO", stream=sys.stderr)
        clock = SystemClock()
        conn = sqlite3.connect(db_path)
        conn.execute("CREATE TABLE IF NOT EXISTS items (n INTEGER PRIMARY KEY)")
        buffer, taking = [], [True]

        def flush():
            conn.executemany("INSERT INTO items VALUES (?)", [(n,) for n in buffer])
            conn.commit()
            buffer.clear()

        async def intake():
            n = 0
            while taking[0]:
                n += 1
                buffer.append(n)
                print("ack", n, flush=True)
                await clock.sleep(0.002)

        async def committer():
            while True:
                await clock.sleep(0.05)
                flush()

        runtime = ServiceRuntime(clock=clock)
        async with runtime:
            tasks = [asyncio.create_task(intake()), asyncio.create_task(committer())]

            async def stop_intake():
                taking[0] = False
                await tasks[0]
                tasks[1].cancel()
                if hang:
                    await asyncio.Event().wait()

            async def flush_and_close():
                flush()
                conn.close()
                print("closed", flush=True)

            runtime.shutdown.add("stop intake", stop_intake, timeout_s=60)
            runtime.shutdown.add("flush and close", flush_and_close)
            await clock.sleep(0.1)
            runtime.ready("running")
            await runtime.wait_stop()
        print("exit", runtime.failures, flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2] == "hang"))
    """
)


def _start(tmp_path: Path, notify: NotifyListener, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "service.py"
    script.write_text(PROGRAM)
    env = {**os.environ, **notify.env, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "items.db"), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_sigterm_stops_cleanly_after_stopping_and_loses_nothing_acknowledged(
    tmp_path: Path, notify_socket: NotifyListener
) -> None:
    proc = _start(tmp_path, notify_socket, "normal")
    try:
        first = notify_socket.wait_for("READY=1")
        assert first[-1] == "READY=1\nSTATUS=running"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    rest = notify_socket.drain()
    assert rest and rest[0].startswith("STOPPING=1")
    lines = out.splitlines()
    assert lines[-2:] == ["closed", "exit []"]
    acked = {int(line.split()[1]) for line in lines if line.startswith("ack ")}
    assert acked
    conn = sqlite3.connect(tmp_path / "items.db")
    stored = {n for (n,) in conn.execute("SELECT n FROM items")}
    conn.close()
    assert acked <= stored


def test_second_sigterm_during_a_hung_shutdown_exits_at_once(
    tmp_path: Path, notify_socket: NotifyListener
) -> None:
    proc = _start(tmp_path, notify_socket, "hang")
    try:
        notify_socket.wait_for("READY=1")
        proc.send_signal(signal.SIGTERM)
        stopping = notify_socket.receive()
        assert stopping.startswith("STOPPING=1")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM


async def test_sighup_sets_reload_and_sigint_sets_stop() -> None:
    signals = install_signal_handlers(force_exit_on_second=False)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.wait_for(signals.reload.wait(), 30)
        assert signals.take_reload() and not signals.take_reload()
        assert not signals.stop.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        assert await asyncio.wait_for(signals.wait_stop(), 30) == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)  # a second one is ignored when not forcing
        await asyncio.sleep(0)
    finally:
        signals.uninstall()


async def test_runtime_answers_sighup_with_reloading_then_ready(
    notify_socket: NotifyListener,
) -> None:
    from agent.service.runtime import ServiceRuntime

    reloaded = asyncio.Event()

    async def on_reload() -> None:
        reloaded.set()

    runtime = ServiceRuntime(clock=VirtualClock(), env=notify_socket.env, on_reload=on_reload)
    loop = asyncio.get_running_loop()
    notify_socket.sock.setblocking(False)
    async with runtime:
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.wait_for(reloaded.wait(), 30)
        first = await loop.sock_recv(notify_socket.sock, 256)
        assert first.startswith(b"RELOADING=1\nMONOTONIC_USEC=")
        assert await loop.sock_recv(notify_socket.sock, 256) == b"READY=1\nSTATUS=running"
        runtime.signals.request_stop()
        assert await runtime.wait_stop() is None
    assert (await loop.sock_recv(notify_socket.sock, 256)).startswith(b"STOPPING=1")


async def test_shutdown_steps_run_in_order_despite_failures_and_hangs() -> None:
    clock = VirtualClock()
    ran: list[str] = []

    async def ok(name: str) -> None:
        ran.append(name)

    async def broken() -> None:
        ran.append("broken")
        raise RuntimeError("disk on fire")

    async def hung() -> None:
        ran.append("hung")
        await asyncio.Event().wait()

    sequence = ShutdownSequence(clock=clock, step_timeout_s=5.0)
    sequence.add("stop intake", lambda: ok("stop intake"))
    sequence.add("broken", broken)
    sequence.add("hung", hung, timeout_s=3.0)
    sequence.add("close database", lambda: ok("close database"))
    assert sequence.names == ["stop intake", "broken", "hung", "close database"]
    run = asyncio.create_task(sequence.run())
    await clock.advance(3.0)
    failures = await asyncio.wait_for(run, 30)
    assert ran == ["stop intake", "broken", "hung", "close database"]
    assert [(f.name, f.reason) for f in failures] == [
        ("broken", "RuntimeError: disk on fire"),
        ("hung", "timed out after 3.0s"),
    ]
    assert await sequence.run() == []  # runs once


def test_request_stop_from_code_keeps_the_first_reason() -> None:
    signals = ServiceSignals(force_exit_on_second=False)
    signals.request_stop(signal.SIGTERM)
    signals.request_stop(signal.SIGINT)
    assert signals.stop_signal == signal.SIGTERM
