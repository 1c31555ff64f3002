#!/usr/bin/env python3
"""Actor throughput: tell + process through one actor vs a bare asyncio.Queue, same run.

    python scripts/bench_actors.py [--messages N] [--rounds R] [--no-uvloop]

Both sides do the same work per message (count it, signal at the last one), on the same event
loop, with a bound of N so neither side refuses or drops. A producer enqueues N messages,
yielding to the loop every 1,000, and the clock stops when the consumer has taken the last one.
The best of R rounds is kept for each side. A sequential ask round trip rate is reported too.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.actors import Actor, ActorSystem, Context, run  # noqa: E402

_YIELD_EVERY = 1_000


class _Counter(Actor):
    def __init__(self, target: int, done: asyncio.Event) -> None:
        self.count = 0
        self.target = target
        self.done = done

    async def receive(self, message: object, ctx: Context) -> object:
        self.count += 1
        if self.count == self.target:
            self.done.set()
        return message


async def _queue_round(n: int) -> float:
    queue: asyncio.Queue[int] = asyncio.Queue(maxsize=n)
    done = asyncio.Event()

    async def consume() -> None:
        count = 0
        while True:
            await queue.get()
            count += 1
            if count == n:
                done.set()
                return

    consumer = asyncio.create_task(consume(), name="bench-queue-consumer")
    await asyncio.sleep(0)
    start = time.perf_counter()
    for i in range(n):
        queue.put_nowait(i)
        if i % _YIELD_EVERY == _YIELD_EVERY - 1:
            await asyncio.sleep(0)
    await done.wait()
    elapsed = time.perf_counter() - start
    await consumer
    return elapsed


async def _actor_round(n: int) -> float:
    done = asyncio.Event()
    async with ActorSystem(name="bench") as system:
        ref = system.spawn(_Counter(n, done), name="counter", capacity=n)
        await asyncio.sleep(0)
        start = time.perf_counter()
        for i in range(n):
            ref.tell(i)
            if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)
        await done.wait()
        elapsed = time.perf_counter() - start
    return elapsed


async def _ask_round(n: int) -> float:
    async with ActorSystem(name="bench-ask") as system:
        ref = system.spawn(_Counter(-1, asyncio.Event()), name="echo", capacity=16)
        start = time.perf_counter()
        for i in range(n):
            await ref.ask(i, timeout_s=10.0)
        return time.perf_counter() - start


async def _bench(n: int, rounds: int) -> dict[str, object]:
    queue_s = min([await _queue_round(n) for _ in range(rounds)])
    actor_s = min([await _actor_round(n) for _ in range(rounds)])
    asks = max(1, n // 10)
    ask_s = min([await _ask_round(asks) for _ in range(rounds)])
    queue_rate = n / queue_s
    actor_rate = n / actor_s
    return {
        "bench": "actors",
        "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "python": platform.python_version(),
        "messages": n,
        "rounds": rounds,
        "actor_tell_msgs_per_s": round(actor_rate),
        "queue_baseline_msgs_per_s": round(queue_rate),
        "actor_vs_queue_ratio": round(actor_rate / queue_rate, 3),
        "ask_round_trips_per_s": round(asks / ask_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best is kept")
    parser.add_argument("--no-uvloop", action="store_true", help="use asyncio's own loop")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.rounds < 1:
        parser.error("--messages and --rounds must be >= 1")
    result = run(_bench(args.messages, args.rounds), use_uvloop=not args.no_uvloop)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
