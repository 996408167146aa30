"""How many PostgreSQL connections does a busy worker use? (docs/production.md,
"Connection budget")

One ``oncely worker`` (``ONCELY_WORKER_CONCURRENCY`` at its default, 64)
drains ``--jobs`` summaries jobs loaded as the API leaves them, once per
``--pool-max``; meanwhile ``pg_stat_activity`` is sampled every 10 ms: the
most connections the worker held, and the most at once running a statement
(``active``). With the throughput of each pool size, that says how large a
pool a worker needs. The database is emptied (``fresh_state``) before every
run: give one of its own.

    .venv/bin/python -m bench.pool_budget --database-url postgresql://…/pools \\
        --redis-url redis://127.0.0.1:6379/13 --pool-max 20,8,4 --jobs 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import psycopg
from redis.asyncio import Redis

from bench.harness import jobs
from bench.harness.servers import count, fresh_state, migrated
from oncely.fakes.llm import FakeLLMServer

SAMPLE_S = 0.01
HELD = """
SELECT count(*), count(*) FILTER (WHERE state = 'active')
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> ALL(%s)
  AND backend_type = 'client backend'
"""


async def one_run(
    database_url: str, redis_url: str, pool_max: int, n: int, sleep_s: float
) -> dict[str, Any]:
    redis = Redis.from_url(redis_url, decode_responses=True)
    db = await migrated(database_url)
    await fresh_state(redis, db)
    async with FakeLLMServer() as model:
        await jobs.preload(redis, db, n, sleep_s=sleep_s)
        env = {
            **os.environ,
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_REDIS_URL": redis_url,
            "ONCELY_LLM_BASE_URL": model.url,
            "ONCELY_SENDER_URL": "http://127.0.0.1:9/unused",
            "ONCELY_PG_POOL_MAX": str(pool_max),
            "ONCELY_LOG_LEVEL": "WARNING",
        }
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "oncely", "worker", "--workflow", "summaries"),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            sampler = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
            ours = [sampler.info.backend_pid, db.info.backend_pid]
            most = most_active = 0
            started = time.monotonic()
            done = 0
            while done < n and proc.returncode is None and time.monotonic() - started < 300:
                row = await (await sampler.execute(HELD, (ours,))).fetchone()
                assert row is not None
                most, most_active = max(most, row[0]), max(most_active, row[1])
                done = await count(db, jobs.DONE)
                await asyncio.sleep(SAMPLE_S)
            elapsed = time.monotonic() - started
            await sampler.close()
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
    await db.close()
    await redis.aclose()
    return {
        "pool_max": pool_max,
        "jobs": n,
        "done": done,
        "model_sleep_s": sleep_s,
        "seconds": round(elapsed, 2),
        "jobs_per_s": round(done / elapsed, 1),
        "most_connections": most,
        "most_active": most_active,
    }


async def run(args: argparse.Namespace) -> None:
    for size in (int(x) for x in args.pool_max.split(",")):
        report = await one_run(args.database_url, args.redis_url, size, args.jobs, args.sleep_s)
        print(json.dumps(report), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database-url", required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--pool-max", default="20,8,4")
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--sleep-s", type=float, default=0.0, help="the fake model's answer time")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
