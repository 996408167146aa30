"""Shared helpers for tests that run jobs through a worker or the API."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from aiohttp import web
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
from oncely.usage.calls import Call, CallSite
from oncely.usage.ledger import Ledger


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
    """The rows ``sql`` answers, none for a statement that returns none
    (``args`` its parameters; none: ``%`` is a literal)."""
    async with pool.connection() as conn:
        cur = await conn.execute(sql, args or None)
        return list(await cur.fetchall()) if cur.description else []


async def scalar(pool: AsyncConnectionPool, sql: str, *args: Any) -> Any:
    """The first column of the first row ``sql`` answers, or None."""
    found = await rows(pool, sql, *args)
    return found[0][0] if found else None


async def all_done(pool: AsyncConnectionPool, ids: list[str]) -> bool:
    """Whether every job of ``ids`` is done."""
    done = await scalar(
        pool, "SELECT count(*) FROM jobs WHERE status = 'done' AND job_id = ANY(%s::uuid[])", ids
    )
    return bool(done == len(ids))


async def count(pool: AsyncConnectionPool, sql: str, *args: Any) -> int:
    """The number the count ``sql`` answers."""
    return int(await scalar(pool, sql, *args))


async def pending(stream: Stream) -> int:
    info: Any = await stream.redis.xpending(stream.stream, stream.group)
    return int(info["pending"])


async def job_status(pool: AsyncConnectionPool, job_id: str) -> str:
    status = await scalar(pool, "SELECT status FROM jobs WHERE job_id = %s", job_id)
    assert status is not None, f"no job {job_id}"
    return str(status)


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


@asynccontextmanager
async def posts_served(
    path: str, handle: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> AsyncIterator[str]:
    """A local HTTP server (on a free port) whose ``path`` answers POSTs with
    ``handle``, for senders to call: its URL."""
    app = web.Application()
    app.router.add_post(path, handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}{path}"
    finally:
        await runner.cleanup()


def mailbox_lines(mailbox: Path) -> list[dict[str, Any]]:
    """What the fake mail server wrote to ``mailbox``: a message or event a line."""
    if not mailbox.exists():
        return []
    return [json.loads(line) for line in mailbox.read_text().splitlines()]


def webhook_events(mailbox: Path, topic: str | None = None) -> list[dict[str, Any]]:
    """The webhook events in ``mailbox`` (of type ``topic``, if named)."""
    events = [line for line in mailbox_lines(mailbox) if line["kind"] == "event"]
    return [e for e in events if topic is None or e["type"] == topic]


@asynccontextmanager
async def service_running(service: Any, stop_within_s: float = 10.0) -> AsyncIterator[None]:
    """``service`` (a worker, a relay: ``run()``/``stop()``) running its loop
    in a task; stopped, and waited for, at the end."""
    loop = asyncio.create_task(service.run())
    try:
        yield
    finally:
        service.stop()
        await asyncio.wait_for(loop, stop_within_s)


async def record_cached_calls(
    ledger: Ledger, site: CallSite, prompt_tokens: int, calls: list[tuple[str, str, int, int]]
) -> int:
    """Each of ``calls`` (model, dialect, cached tokens read, cached tokens
    written) in the ledger as one answered call of ``prompt_tokens``, priced
    by the ledger's prices: how many rows it wrote."""
    prices = ledger.prices
    for model, dialect, read, written in calls:
        cost = prices.cost(model, prompt_tokens, 100, read, written)
        saved = prices.cache_saved(model, prompt_tokens, read, written)
        ledger.record(
            Call(
                site,
                "model",
                model,
                1,
                "ok",
                prompt_tokens,
                100,
                10,
                cost,
                cached_tokens=read,
                cache_write_tokens=written,
                dialect=dialect,
                cache_saved_usd=saved,
            )
        )
    return await ledger.flush()


async def failed_outbox_row(
    pool: AsyncConnectionPool, topic: str, dedupe_key: str, attempts: int, last_error: str
) -> int:
    """A row of the outbox the relay gave up on: its id."""
    row_id = await scalar(
        pool,
        "INSERT INTO outbox (topic, dedupe_key, payload, attempts, last_error, failed_at)"
        " VALUES (%s, %s, '{}', %s, %s, now()) RETURNING id",
        topic,
        dedupe_key,
        attempts,
        last_error,
    )
    return int(row_id)


@contextmanager
def own_folder(prefix: str) -> Iterator[Path]:
    """A folder for embedded servers, outside pytest's temporary directory:
    a pytest session started meanwhile (another checkout's ``make test``)
    resets that directory to its owner's only, and the embedded PostgreSQL
    runs as a user of its own, which then can no longer reach its data."""
    own = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield own
    finally:
        shutil.rmtree(own, ignore_errors=True)
