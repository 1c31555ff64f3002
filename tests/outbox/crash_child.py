"""Child process for test_crash.py: enqueues and relays until it is killed.

    python crash_child.py DB DELIVERED_LOG RUN produce|drain

`produce`: prints "ready", then four producers enqueue messages in a loop, printing
"<row_id> <msg_id>" (flushed) only after `enqueue` returned; meanwhile a relay delivers to an
in-process receiver that appends the msg_id to DELIVERED_LOG and fsyncs before returning. About
one delivery in six fails with Transient, so attempts grow and must survive the kills.
`drain`: no producers; relays until nothing is pending, then exits 0.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.core.clock import SystemClock  # noqa: E402
from agent.core.errors import Transient  # noqa: E402
from agent.core.gate import Gate  # noqa: E402
from agent.outbox.relay import Relay  # noqa: E402
from agent.outbox.retry import RetryPolicy  # noqa: E402
from agent.outbox.store import OutboxStore  # noqa: E402
from agent.outbox.types import OutboxMessage, OutboxRow  # noqa: E402

MAX_ATTEMPTS = 10_000


async def main(db: str, log_path: str, run: int, mode: str) -> int:
    clock = SystemClock()
    rng = random.Random(run)
    store = await OutboxStore.open(db, clock=clock, max_attempts=MAX_ATTEMPTS)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    async def deliver(row: OutboxRow) -> None:
        if rng.random() < 1 / 6:
            raise Transient("flaky receiver")
        os.write(fd, f"{row.msg_id}\n".encode())
        os.fsync(fd)

    relay = Relay(
        store,
        deliver,
        clock=clock,
        ready=Gate(is_open=True),
        partitions=2,
        retry=RetryPolicy(base_s=0.005, cap_s=0.05, transient_floor_s=0.002),
        rng=rng,
        reconnect_jitter_s=0.0,
    )
    out = sys.stdout

    async def produce(worker: int) -> None:
        i = 0
        while True:
            msg_id = f"r{run}-w{worker}-{i}"
            result = await store.enqueue(
                OutboxMessage(
                    msg_id=msg_id,
                    owner="crash",
                    receiver=f"dev{(worker * 7 + i) % 13}",
                    kind="telemetry",
                    payload=os.urandom(64),
                )
            )
            out.write(f"{result.row_id} {msg_id}\n")
            out.flush()
            i += 1

    async with relay:
        if mode == "drain":
            while (await store.stats()).pending > 0:
                await asyncio.sleep(0.02)
            await relay.stop()
            await store.close()
            return 0
        out.write("ready\n")
        out.flush()
        await asyncio.gather(*(produce(w) for w in range(4)))
    return 1


if __name__ == "__main__":
    db, log_path, run, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    sys.exit(asyncio.run(main(db, log_path, run, mode)))
