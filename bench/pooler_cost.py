"""What the statement bound per transaction costs behind a transaction pooler.

One statement through ``run_statement`` (a primary-key read of ``jobs``), on
one pooled connection at a time, the variants interleaved statement by
statement so that a shared machine's drift hits them alike; median latency:

- ``direct``: a direct connection, the bound a startup parameter (oncely's
  default, ``ONCELY_DATABASE_POOLER=none``);
- ``direct_bound_per_transaction``: the same server, each statement in a
  transaction that sets ``SET LOCAL statement_timeout`` first (what
  ``ONCELY_DATABASE_POOLER=transaction`` does): the bound's own cost;
- ``pgbouncer_transaction``: that, through a PgBouncer in transaction mode
  (the deployment it is for), when ``--pgbouncer-url`` is given.

    .venv/bin/python bench/pooler_cost.py --database-url postgresql://…/db \\
        [--pgbouncer-url postgresql://…:6432/db]

Reads only; any migrated oncely database serves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from datetime import UTC, datetime
from typing import Literal

from psycopg_pool import AsyncConnectionPool

from oncely.bootstrap import postgres_pool
from oncely.settings import Settings
from oncely.sql.bounded import run_statement

READ = "SELECT status FROM jobs WHERE job_id = %s"


def pool_for(url: str, pooler: Literal["none", "transaction"]) -> AsyncConnectionPool:
    settings = Settings(database_url=url, database_pooler=pooler, pg_pool_min=1, pg_pool_max=1)
    return postgres_pool(url, settings)


async def measure(pools: dict[str, AsyncConnectionPool], statements: int) -> dict[str, float]:
    took: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(statements):
        for name, pool in pools.items():
            start = time.perf_counter()
            await run_statement(pool, READ, (uuid.uuid4(),), timeout_s=10)
            took[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(t) * 1e6, 1) for name, t in took.items()}


async def main(args: argparse.Namespace) -> None:
    pools = {
        "direct": pool_for(args.database_url, "none"),
        "direct_bound_per_transaction": pool_for(args.database_url, "transaction"),
    }
    if args.pgbouncer_url:
        pools["pgbouncer_transaction"] = pool_for(args.pgbouncer_url, "transaction")
    for pool in pools.values():
        await pool.open(wait=True)
    try:
        await measure(pools, 200)  # warm-up
        median_us = await measure(pools, args.statements)
    finally:
        for pool in pools.values():
            await pool.close()
    report = {
        "benchmark": "pooler_cost",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "statements_per_variant": args.statements,
        "median_statement_us": median_us,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--pgbouncer-url")
    parser.add_argument("--statements", type=int, default=3000)
    asyncio.run(main(parser.parse_args()))
