"""Summaries jobs for the worker's benchmarks: loaded the way the API leaves
them (a ``jobs`` row, then the stream entry), waited for, and checked."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from redis.asyncio import Redis

from bench.harness.fakes import FakeModel
from bench.harness.servers import count
from oncely.builtin.summaries import dedupe_key, summaries
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query

TENANT = "bench"
POLL_S = 0.02
READY_POLL_S = 0.005
DONE = "SELECT count(*) FROM jobs WHERE status = 'done'"


def ticket(i: int) -> str:
    return (
        f"Ticket {i}: the customer reports that invoice {1000 + i} was charged twice. "
        "Support refunded the second charge and apologised. The customer confirmed "
        "the refund arrived and closed the ticket."
    )


async def preload(
    redis: Redis,
    db: psycopg.AsyncConnection[Any],
    jobs: int,
    sleep_s: float = 0.0,
    first: int = 0,
) -> list[str]:
    """``jobs`` rows and stream entries, tickets ``first`` on (the model takes
    ``sleep_s`` for each); their job ids."""
    directive = f" [[fake:sleep={sleep_s:g}]]" if sleep_s else ""
    messages = [
        JobMessage.new(
            str(uuid.uuid4()),
            TENANT,
            {"text": f"{ticket(i)}{directive}", "notify": f"user{i}@example.com"},
        )
        for i in range(first, first + jobs)
    ]
    async with db.cursor() as cur:
        rows = [(m.job_id, m.tenant, summaries.name, Jsonb(m.payload)) for m in messages]
        await cur.executemany(query("insert_job"), rows)
    await db.execute("ANALYZE jobs")
    stream = Stream(redis, summaries.keys)
    await stream.ensure_group()
    for i in range(0, jobs, 50):
        await asyncio.gather(*(stream.enqueue(m) for m in messages[i : i + 50]))
    with contextlib.suppress(psycopg.Error):  # CHECKPOINT needs rights a given server may deny
        await db.execute("CHECKPOINT")
    return [m.job_id for m in messages]


async def first_delivery(redis: Redis, proc: subprocess.Popen[bytes], within_s: float) -> None:
    """Until the group's last-delivered id moves: the consumer is up and reading."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.poll() is None:
        groups: Any = await redis.xinfo_groups(summaries.keys.stream)
        if groups and str(groups[0]["last-delivered-id"]) != "0-0":
            return
        await asyncio.sleep(READY_POLL_S)
    raise RuntimeError("the consumer never read the stream")


async def all_done(
    db: psycopg.AsyncConnection[Any], proc: subprocess.Popen[bytes], jobs: int, within_s: float
) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.poll() is None:
        if await count(db, DONE) >= jobs:
            return
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"{await count(db, DONE)}/{jobs} jobs done when the wait ended")


async def pending(redis: Redis) -> int:
    summary: Any = await redis.xpending(summaries.keys.stream, summaries.keys.group)
    return int(summary["pending"])


async def settled(redis: Redis, within_s: float = 5.0) -> int:
    """Pending entries once acknowledgements caught up (or the wait ended)."""
    deadline = time.monotonic() + within_s
    while (left := await pending(redis)) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return left


async def checks(
    redis: Redis, db: psycopg.AsyncConnection[Any], model: FakeModel, job_ids: list[str]
) -> dict[str, Any]:
    """Every job done once, one result and one outbox row (its dedupe key)
    each, nothing pending, one billed model call per job; ``ok`` if all hold."""
    n = len(job_ids)
    keys = {str(r[0]) for r in await (await db.execute("SELECT dedupe_key FROM outbox")).fetchall()}
    calls = await model.calls()
    billed = [int(p["billed"]) for p in calls["prompts"]]
    c: dict[str, Any] = {
        "jobs": n,
        "done": await count(db, DONE),
        "results": await count(db, "SELECT count(DISTINCT job_id) FROM results"),
        "result_rows": await count(db, "SELECT count(*) FROM results"),
        "outbox": await count(db, "SELECT count(*) FROM outbox"),
        "pending_after_done": await settled(redis),
        "model_calls": int(calls["total"]),
        "prompts_billed_once": sum(1 for b in billed if b == 1),
    }
    if any((calls.get("background") or {}).values()):
        # Background responses: creates, polls (GETs) and streams by id.
        c["background"] = calls["background"]
    c["ok"] = (
        c["done"] == c["results"] == c["result_rows"] == c["outbox"] == n
        and keys == {dedupe_key(j) for j in job_ids}
        and c["pending_after_done"] == 0
        and c["model_calls"] == c["prompts_billed_once"] == n
    )
    return c
