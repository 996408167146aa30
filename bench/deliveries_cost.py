"""What recording the successful delivery costs the worker's happy path.

``finish_job`` as it is (result + outbox row + job done + the delivery's
``job_deliveries`` row, one statement) against the same statement without
the delivery CTE, on one database, interleaved so that a shared machine's
drift hits both alike:

- ``sequential``: one connection, one statement at a time, the two variants
  alternating job by job; median latency per statement;
- ``concurrent``: blocks of jobs finished by 20 connections at once (the
  worker's default pool), the variants alternating block by block; median
  throughput per block.

    .venv/bin/python bench/deliveries_cost.py --database-url postgresql://…/db

The given database is DROPPED and created again (its name is the URL's), and
dropped at the end; never point it at data you keep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import conninfo
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.sql import query
from oncely.sql.migrate import migrate

CONNECTIONS = 20
NEW = query("finish_job")
# The statement before job deliveries: the same, without the delivery CTE.
OLD = NEW.split("), delivery AS (")[0] + "\n)\nSELECT count(*) AS stored FROM result\n"


def params(job_id: str, with_delivery: bool) -> dict[str, Any]:
    p: dict[str, Any] = {
        "job_id": job_id,
        "workflow": "summaries",
        "result": Jsonb({"summary": "s" * 200}),
        "usage": Jsonb({"prompt_tokens": 50, "completion_tokens": 20, "model_calls": 1}),
        "topics": ["email.summary_ready"],
        "dedupe_keys": [f"summary_ready:{job_id}"],
        "payloads": [Jsonb({"job_id": job_id, "to": "ada@example.com"})],
        "trace_context": None,
    }
    if with_delivery:
        p |= {
            "delivery": 1,
            "consumer": "bench-1-abcdef",
            "started_at": datetime.now(UTC),
            "model_calls": 1,
        }
    return p


async def new_jobs(pool: AsyncConnectionPool, n: int) -> list[str]:
    ids = [str(uuid.uuid4()) for _ in range(n)]
    async with pool.connection() as conn, conn.cursor() as cur:
        await cur.executemany(
            "INSERT INTO jobs (job_id, tenant, kind, payload) VALUES (%s, 'b', 'summaries', '{}')",
            [(i,) for i in ids],
        )
    return ids


async def sequential(pool: AsyncConnectionPool, rounds: int, n: int) -> dict[str, float]:
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        ids = await new_jobs(pool, n)
        async with pool.connection() as conn:
            for k, job_id in enumerate(ids):
                new = (k + r) % 2 == 0
                started = time.perf_counter()
                await conn.execute(NEW if new else OLD, params(job_id, new))
                times[new].append(time.perf_counter() - started)
    before, after = (statistics.median(times[v]) * 1000 for v in (False, True))
    return {
        "old_ms": round(before, 3),
        "new_ms": round(after, 3),
        "ratio": round(after / before, 3),
    }


async def _finisher(pool: AsyncConnectionPool, queue: Iterator[str], new: bool) -> None:
    """Finish jobs from the shared ``queue`` until it is empty, on one connection."""
    async with pool.connection() as conn:
        for job_id in queue:
            await conn.execute(NEW if new else OLD, params(job_id, new))


async def concurrent(pool: AsyncConnectionPool, blocks: int, n: int) -> dict[str, Any]:
    rates: dict[bool, list[float]] = {False: [], True: []}
    for b in range(blocks * 2):
        new = b % 2 == 1
        ids = await new_jobs(pool, n)
        queue = iter(ids)
        started = time.perf_counter()
        await asyncio.gather(*(_finisher(pool, queue, new) for _ in range(CONNECTIONS)))
        rates[new].append(n / (time.perf_counter() - started))
    before, after = (statistics.median(rates[v]) for v in (False, True))
    return {
        "old_jobs_per_s": round(before),
        "new_jobs_per_s": round(after),
        "ratio": round(after / before, 3),
        "blocks_old": [round(x) for x in rates[False]],
        "blocks_new": [round(x) for x in rates[True]],
    }


async def main(args: argparse.Namespace) -> None:
    params_ = conninfo.conninfo_to_dict(args.database_url)
    name = str(params_["dbname"])
    admin = conninfo.make_conninfo(**{**params_, "dbname": "postgres"})  # type: ignore[arg-type]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        await migrate(args.database_url)
        async with AsyncConnectionPool(
            args.database_url,
            min_size=CONNECTIONS,
            max_size=CONNECTIONS,
            kwargs={"autocommit": True},
        ) as pool:
            report = {
                "sequential": await sequential(pool, args.rounds, args.jobs),
                "concurrent": await concurrent(pool, args.rounds, args.jobs),
            }
        print(json.dumps(report, indent=2))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def cli() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database-url", required=True, help="DROPPED, created, dropped again")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--jobs", type=int, default=2000, help="jobs per round or block")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(cli()))
