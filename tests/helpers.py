"""Shared helpers for tests that run jobs through a worker."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.queue.stream import JobMessage, Stream
from oncely.queue.worker import Worker, WorkerConfig
from oncely.sql import query
from oncely.workflow import mark_dead


def make_worker(
    stream: Stream, handler: Callable[..., Awaitable[str]], pool: AsyncConnectionPool, **cfg: Any
) -> Worker:
    config = WorkerConfig(**{"block_ms": 10, "claim_idle_ms": 60_000, **cfg})

    async def on_dead(job_id: str, reason: str) -> None:
        await mark_dead(pool, job_id, reason)

    return Worker(stream, handler, config, on_dead=on_dead)


async def submit(pool: AsyncConnectionPool, stream: Stream, text: str, job_id: str = "") -> str:
    job_id = job_id or str(uuid.uuid4())
    payload = {"text": text, "notify": "ada@example.com"}
    async with pool.connection() as conn:
        await conn.execute(query("insert_job"), (job_id, "acme", Jsonb(payload)))
    await stream.enqueue(JobMessage.new(job_id, "acme", payload))
    return job_id


async def count(pool: AsyncConnectionPool, sql: str, *args: Any) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute(sql, args)
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def pending(stream: Stream) -> int:
    info: Any = await stream.redis.xpending(stream.stream, stream.group)
    return int(info["pending"])


async def job_status(pool: AsyncConnectionPool, job_id: str) -> str:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status FROM jobs WHERE job_id = %s", (job_id,))
        row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def drain(worker: Worker, rounds: int = 1) -> None:
    for _ in range(rounds):
        await worker.run_once()
        await worker.wait_idle()
