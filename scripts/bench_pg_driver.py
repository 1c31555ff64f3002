"""Which PostgreSQL driver the leader should use: asyncpg or psycopg 3 (with its pool), on the
leader's hottest write, against SQLite doing the same in the same run.

    python scripts/bench_pg_driver.py [--devices N] [--batch B] [--rounds R] [--connections C]

Needs Debian's `postgresql` (the server binaries under /usr/lib/postgresql/*/bin) and the two
drivers in the interpreter that runs it (`pip install asyncpg "psycopg[binary,pool]"`); it starts
its own cluster in a temporary folder on a free loopback port (`initdb` runs as the `postgres`
user when run as root) and removes it at the end.

- heartbeats: N devices' heartbeats in batches of B, R rounds (each round a newer seq), applied
  as one conditional upsert a batch (`INSERT ... SELECT FROM unnest(...) ON CONFLICT (id) DO
  UPDATE ... WHERE excluded.seq > devices.seq`, one transaction a batch): rows per second, the
  client's CPU per row and the server's CPU per row (the cluster's processes, from psutil);
  SQLite runs the same statement shape (executemany, synchronous NORMAL, WAL) as the baseline.
- connections: C connections opened and closed one after another (the cost of a leader's
  reconnect), and C acquisitions from a pool of 4 (psycopg_pool; asyncpg's own pool).

The last line is JSON. Measured on this 2-core machine (PostgreSQL 15, asyncpg 0.32, psycopg 3.3.9
with its binary libpq build; 5,000 devices, batches of 500, 10 rounds): asyncpg 112-134k rows/s at
1.4 us of client CPU and 5.6-7.0 us of server CPU a row; psycopg 68-75k rows/s at 6.0-7.1 us client
and 6.8-7.4 us server (its list-to-array adaptation is Python); SQLite 315-391k rows/s at 2.5-3.0
us in process. Opening a connection: asyncpg 5.7-6.0 ms, psycopg 2.6-3.4 ms; a pooled query
0.27-0.43 ms both. Wheels: both ship manylinux aarch64 wheels for CPython 3.11; neither ships an
armv7 wheel on PyPI (psycopg's pure-Python build runs on Debian's libpq5 there; asyncpg needs a
C compiler).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import psutil

UPSERT_PG = ("INSERT INTO devices (id, seq, at_ms, sample) SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[],"
             " $4::bytea[]) ON CONFLICT (id) DO UPDATE SET seq = excluded.seq, at_ms = excluded.at_ms,"
             " sample = excluded.sample WHERE excluded.seq > devices.seq")
UPSERT_SQLITE = ("INSERT INTO devices (id, seq, at_ms, sample) VALUES (?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET"
                 " seq = excluded.seq, at_ms = excluded.at_ms, sample = excluded.sample"
                 " WHERE excluded.seq > devices.seq")
SCHEMA = "CREATE TABLE devices (id TEXT PRIMARY KEY, seq BIGINT NOT NULL, at_ms BIGINT NOT NULL, sample BYTEA)"
SAMPLE = bytes(range(64))  # a heartbeat's system sample, about its encoded size


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def cluster() -> Iterator[tuple[str, list[int]]]:
    """A throwaway PostgreSQL cluster: (its URL, the pids of its processes once started)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise SystemExit("no PostgreSQL server here: apt-get install postgresql")
    bindir = Path(found[-1]).parent
    work = Path(tempfile.mkdtemp(prefix="ea-pg-"))
    as_postgres: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root
        shutil.chown(work, "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    data = work / "data"
    subprocess.run([*as_postgres, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "ea"],
                   check=True, capture_output=True)
    subprocess.run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l", str(work / "pg.log"), "-o",
                    f"-p {port} -k {work} -c listen_addresses=127.0.0.1 -c synchronous_commit=on", "start"],
                   check=True, capture_output=True)
    try:
        postmaster = int((data / "postmaster.pid").read_text().split()[0])
        subprocess.run([str(bindir / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "ea", "-d", "postgres",
                        "-c", "CREATE DATABASE ea"], check=True, capture_output=True)
        yield f"postgresql://ea@127.0.0.1:{port}/ea", [postmaster]
    finally:
        subprocess.run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"],
                       capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def server_cpu(postmaster: int) -> float:
    """CPU seconds of the cluster's processes so far (the postmaster and its children)."""
    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(postmaster)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system + times.children_user + times.children_system
    return total


def batches(devices: int, batch: int, rounds: int) -> list[tuple[list[str], list[int], list[int], list[bytes]]]:
    out = []
    for r in range(rounds):
        for start in range(0, devices, batch):
            ids = [f"pi-{n:06d}" for n in range(start, min(devices, start + batch))]
            out.append((ids, [r + 1] * len(ids), [1_800_000_000_000 + r] * len(ids), [SAMPLE] * len(ids)))
    return out


def bench_sqlite(work: list) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        conn = sqlite3.connect(Path(tmp) / "leader.db", isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(SCHEMA.replace("BYTEA", "BLOB").replace("BIGINT", "INTEGER"))

        cpu0, wall0 = time.process_time(), time.perf_counter()
        for ids, seqs, ats, samples in work:
            conn.execute("BEGIN")
            conn.executemany(UPSERT_SQLITE, zip(ids, seqs, ats, samples, strict=True))
            conn.execute("COMMIT")
        result = _figures(work, time.perf_counter() - wall0, time.process_time() - cpu0, 0.0)
        conn.close()
    return result


async def bench_asyncpg(url: str, work: list, postmaster: int, connections: int) -> dict[str, object]:
    import asyncpg

    conn = await asyncpg.connect(url)
    await conn.execute("DROP TABLE IF EXISTS devices")
    await conn.execute(SCHEMA)

    async def upsert(ids: list[str], seqs: list[int], ats: list[int], samples: list[bytes]) -> None:
        await conn.execute(UPSERT_PG, ids, seqs, ats, samples)

    heartbeats = await timed_batches(work, postmaster, upsert)
    await conn.close()

    async def connect() -> None:
        await (await asyncpg.connect(url)).close()

    pool = await asyncpg.create_pool(url, min_size=4, max_size=4)

    async def pooled() -> None:
        async with pool.acquire() as c:
            await c.execute("SELECT 1")

    result = {**heartbeats, "connect_ms": round(await per_call_ms(connections, connect), 2),
              "pool_query_ms": round(await per_call_ms(connections, pooled), 3), "version": asyncpg.__version__}
    await pool.close()
    return result


async def bench_psycopg(url: str, work: list, postmaster: int, connections: int) -> dict[str, object]:
    import psycopg
    import psycopg_pool

    upsert = UPSERT_PG.replace("$1", "%s").replace("$2", "%s").replace("$3", "%s").replace("$4", "%s")
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    await conn.execute("DROP TABLE IF EXISTS devices")
    await conn.execute(SCHEMA)

    async def apply(ids: list[str], seqs: list[int], ats: list[int], samples: list[bytes]) -> None:
        await conn.execute(upsert, (ids, seqs, ats, samples), prepare=True, binary=True)

    heartbeats = await timed_batches(work, postmaster, apply)
    await conn.close()

    async def connect() -> None:
        await (await psycopg.AsyncConnection.connect(url)).close()

    pool = psycopg_pool.AsyncConnectionPool(url, min_size=4, max_size=4, open=False)
    await pool.open(wait=True)

    async def pooled() -> None:
        async with pool.connection() as c:
            await c.execute("SELECT 1")

    result = {**heartbeats, "connect_ms": round(await per_call_ms(connections, connect), 2),
              "pool_query_ms": round(await per_call_ms(connections, pooled), 3), "version": psycopg.__version__,
              "libpq": psycopg.pq.__impl__}
    await pool.close()
    return result


async def timed_batches(work: list, postmaster: int,
                        apply: Callable[[list[str], list[int], list[int], list[bytes]], Awaitable[None]],
                        ) -> dict[str, float]:
    """Every batch through `apply`, timed: rows a second, the client's and the server's CPU a row."""
    cpu0, wall0, srv0 = time.process_time(), time.perf_counter(), server_cpu(postmaster)
    for ids, seqs, ats, samples in work:
        await apply(ids, seqs, ats, samples)
    return _figures(work, time.perf_counter() - wall0, time.process_time() - cpu0, server_cpu(postmaster) - srv0)


async def per_call_ms(count: int, call: Callable[[], Awaitable[None]]) -> float:
    """Milliseconds a call of `call`, over `count` calls one after another."""
    t0 = time.perf_counter()
    for _ in range(count):
        await call()
    return (time.perf_counter() - t0) / count * 1000


def _figures(work: list, wall: float, cpu: float, srv: float) -> dict[str, float]:
    rows = sum(len(b[0]) for b in work)
    return {"rows_per_s": round(rows / wall), "client_cpu_us_per_row": round(cpu / rows * 1e6, 2),
            "server_cpu_us_per_row": round(srv / rows * 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=50)
    args = parser.parse_args()
    work = batches(args.devices, args.batch, args.rounds)
    result: dict[str, object] = {"devices": args.devices, "batch": args.batch, "rounds": args.rounds,
                                 "baseline_sqlite": bench_sqlite(work)}
    with cluster() as (url, pids):
        result["asyncpg"] = asyncio.run(bench_asyncpg(url, work, pids[0], args.connections))
        result["psycopg"] = asyncio.run(bench_psycopg(url, work, pids[0], args.connections))
    base = result["baseline_sqlite"]
    assert isinstance(base, dict)
    for name in ("asyncpg", "psycopg"):
        figures = result[name]
        assert isinstance(figures, dict)
        figures["rows_per_s_vs_sqlite"] = round(figures["rows_per_s"] / base["rows_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
