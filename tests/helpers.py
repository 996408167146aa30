"""Shared helpers for tests that run jobs through a worker or the API."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel
from redis.asyncio import Redis

from oncely.app import App
from oncely.bootstrap import Resources, http_api, standalone_app
from oncely.builtin import app as builtin_app
from oncely.jobs.records import JobSpec
from oncely.jobs.store import Jobs
from oncely.journal import Journal
from oncely.llm.base import LLM
from oncely.llm.model import Model, ModelRoute
from oncely.queue.stream import Stream
from oncely.queue.worker import Worker, WorkerConfig
from oncely.retry import Deadline, RetryPolicy
from oncely.settings import Settings
from oncely.usage.calls import CallSite


# The refund tool's arguments and what its webhook answers, as the agent and
# framework tests declare them (no docstrings: they would enter the tools'
# JSON schemas).
class RefundArgs(BaseModel):
    order_id: str
    cents: int


class Refunded(BaseModel):
    ok: bool
    id: str


def asgi_app(
    settings: Settings, redis: Redis, pool: AsyncConnectionPool, app: App | None = None
) -> FastAPI:
    """The standalone API of ``app`` (default: the built-in one) on open clients."""
    resources = Resources(settings, redis, pool)
    return standalone_app(http_api(app or builtin_app, settings, resources=resources), settings)


def make_worker(
    stream: Stream, handler: Callable[..., Awaitable[str]], pool: AsyncConnectionPool, **cfg: Any
) -> Worker:
    config = WorkerConfig(**{"block_ms": 10, "claim_idle_ms": 60_000, **cfg})
    jobs = Jobs(pool, {})
    return Worker(
        stream,
        handler,
        config,
        workflow="summaries",
        on_dead=jobs.mark_dead,
        on_failed=jobs.record_deliveries,
    )


async def submit(
    pool: AsyncConnectionPool, stream: Stream, text: str, job_id: str = "", tenant: str = "acme"
) -> str:
    """A summaries job accepted the way the API accepts it: row, then message."""
    job_id = job_id or str(uuid.uuid4())
    payload = {"text": text, "notify": "ada@example.com"}
    await Jobs(pool, {"summaries": stream}).accept(JobSpec(job_id, tenant, "summaries", payload))
    return job_id


async def rows(pool: AsyncConnectionPool, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """The rows ``sql`` answers (``args`` its parameters; none: ``%`` is a
    literal)."""
    async with pool.connection() as conn:
        return list(await (await conn.execute(sql, args or None)).fetchall())


async def scalar(pool: AsyncConnectionPool, sql: str, *args: Any) -> Any:
    """The first column of the first row ``sql`` answers, or None."""
    found = await rows(pool, sql, *args)
    return found[0][0] if found else None


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


def delivery_model(
    llm: LLM,
    model_name: str,
    workflow: str,
    policy: RetryPolicy,
    route: ModelRoute | None = None,
    *,
    deadline_s: float = 30.0,
    journal: Journal | None = None,
    job: str | None = None,
    tenant: str = "acme",
) -> Model:
    """A delivery's model as a worker builds it: ``llm`` (``model_name``, the
    primary) under ``policy``, its calls on the route and ledger of ``route``,
    labelled with ``workflow``, ``job`` and ``tenant``."""
    return Model(
        llm,
        policy=policy,
        deadline=Deadline.after(deadline_s),
        workflow=workflow,
        model_name=model_name,
        journal=journal,
        route=route,
        site=CallSite(workflow, job, tenant),
    )
