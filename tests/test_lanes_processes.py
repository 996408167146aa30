"""The cheaper lanes through real `oncely api`, `worker` and `relay`
processes (``--app tests.lanes_app:app``; docs/lanes.md): 200 jobs on the
batch lane answered through one or a few batches, each line submitted once
(the fake counts lines per ``custom_id``), every job done once with one
model checkpoint; a worker SIGKILLed between "gathered" and "created" and
between "created" and "recorded" (the app's fault-injection hook): no line
submitted twice, every job done. Both for OpenAI's Batches (``chat``) and
Anthropic's Message Batches (``anthropic``, whose batches keep no
metadata: adopted by size and time). A flex job whose flex tier has no
capacity answered at the standard tier once."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from oncely.api.auth import create_api_key
from oncely.fakes.llm import FakeLLMServer
from oncely.llm.lines import line_id
from tests.lanes_app import KILL
from tests.processes import Deployment, post, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

APP = "tests.lanes_app:app"
MODEL = "gpt-fake"


@pytest.fixture
async def model() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer(batch_delay_s=0.5) as server:
        yield server


@pytest.fixture
def env(redis, redis_url, database_url, model, tmp_path) -> dict[str, str]:
    """The processes' settings, on a flushed Redis database (``redis``)."""
    return {
        "ONCELY_APP": APP,
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_LLM_BASE_URL": model.url,
        "ONCELY_LLM_MODEL": MODEL,
        "ONCELY_LOG_FORMAT": "json",
        "ONCELY_BLOCK_MS": "50",
        "ONCELY_CLAIM_IDLE_MS": "1500",
        "ONCELY_RECONCILE_AFTER_S": "2",
        # A waiting job looks again within a second or two.
        "ONCELY_REDELIVERY_BASE_S": "1",
        "ONCELY_REDELIVERY_MAX_S": "2",
        "ONCELY_BATCH_GATHER_S": "1",
        "ONCELY_BATCH_POLL_S": "0.3",
        "ONCELY_BATCH_LEASE_S": "3",
        # Standard-tier retries fast (the flex test's fallback).
        "ONCELY_LLM_BACKOFF_BASE_S": "0.01",
        "ONCELY_LLM_BACKOFF_MAX_S": "0.05",
        "ONCELY_LLM_RETRY_AFTER_MAX_S": "0.05",
        "ONCELY_LLM_MAX_ATTEMPTS": "2",
        "ONCELY_WEBHOOK_SECRET": "whsec_" + "c2VjcmV0LWZvci10ZXN0cy1vbmx5LTEyMzQ1Njc4",
    }


# The primary model per dialect (ONCELY_LLM_MODEL).
MODELS = {"chat": MODEL, "anthropic": "anthropic:claude-fake"}


async def rows(pool: Any, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params)
        return [tuple(r) for r in await cur.fetchall()]


async def done_jobs(pool: Any, kind: str) -> int:
    [(n,)] = await rows(pool, "SELECT count(*) FROM jobs WHERE kind = %s AND status = 'done'", kind)
    return int(n)


async def model_checkpoints(pool: Any) -> dict[str, int]:
    """Each job's stored model checkpoints: rows, or kept with its result."""
    found = await rows(
        pool,
        "SELECT job_id::text, count(*) FROM ("
        " SELECT job_id, key FROM checkpoints WHERE kind = 'model' AND status = 'done'"
        " UNION SELECT r.job_id, s.key FROM results r,"
        "  jsonb_to_recordset(r.steps) AS s (key text, kind text) WHERE s.kind = 'model'"
        ") k GROUP BY job_id",
    )
    return {job: int(n) for job, n in found}


async def post_all(
    client: httpx.AsyncClient, route: str, texts: list[str], prefix: str
) -> list[str]:
    sem = asyncio.Semaphore(20)

    async def one(i: int, text: str) -> str:
        async with sem:
            return await post(client, route, {"text": text}, f"{prefix}-lane-job-{i:05d}")

    return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))


@pytest.mark.parametrize("dialect", ["chat", "anthropic"])
async def test_200_batch_jobs_go_through_a_few_batches_each_line_once(
    pool, model, env, tmp_path, dialect: str
) -> None:
    key = await create_api_key(pool, "acme")
    d = Deployment({**env, "ONCELY_LLM_MODEL": MODELS[dialect]}, tmp_path)
    with d:
        async with d.client(key, within_s=90, timeout=30) as client:
            texts = [f"Ticket {i} of the backlog. Classify it." for i in range(200)]
            job_ids = await post_all(client, "/v1/digest", texts, "digest")

            async def all_done() -> bool:
                return await done_jobs(pool, "digest") == 200

            await wait_for(all_done, within_s=300, what="200 batch jobs done")
            job = (await client.get(f"/v1/digest/{job_ids[7]}")).json()

            async def ledger_rows() -> list[tuple[Any, ...]]:
                return await rows(
                    pool,
                    "SELECT lane, dialect, outcome, count(*) FROM model_calls GROUP BY 1, 2, 3",
                )

            async def written() -> bool:
                return await ledger_rows() == [("batch", dialect, "ok", 200)]

            # The ledger writes every quarter second: one row per line.
            await wait_for(written, within_s=60, what="a batch-lane ledger row per job")

    stats = model.batches.stats()
    assert job["result"]["summary"].startswith("Ticket 7 of the backlog.")
    assert 1 <= stats["created"] <= 10, stats["created"]
    assert sorted(stats["lines"]) == sorted(line_id(j, "model", dialect) for j in job_ids)
    assert set(stats["lines"].values()) == {1}  # each line submitted once
    # Answered in batches of the dialect's API, no call of its own.
    assert model.stats().dialects == {dialect: 200}
    assert await model_checkpoints(pool) == dict.fromkeys(job_ids, 1)


@pytest.mark.parametrize("dialect", ["chat", "anthropic"])
@pytest.mark.parametrize("point", ["gathered", "created"])
async def test_a_worker_killed_between_storing_and_recording_a_batch_sends_no_line_twice(
    pool, model, env, tmp_path, point: str, dialect: str
) -> None:
    """Killed after the lines' batch id is stored but before the batch is
    created (``gathered``), or after it is created but before its id is
    recorded (``created``): the next worker creates it once, or adopts it
    (by its metadata; an Anthropic batch, by its size and time)."""
    key = await create_api_key(pool, "acme")
    env = {**env, "ONCELY_LLM_MODEL": MODELS[dialect]}
    d = Deployment({**env, KILL: point}, tmp_path)
    with d:
        async with d.client(key, within_s=90, timeout=30) as client:
            texts = [f"Order {i}. Summarise it." for i in range(20)]
            job_ids = await post_all(client, "/v1/digest", texts, f"kill-{point}")
            killed = d.workers[0]

            async def died() -> bool:
                return killed.poll() is not None

            # Polled, not waited on: the fake model answers in this loop.
            await wait_for(died, within_s=120, what="the worker killed at its hook")
            assert killed.returncode == -signal.SIGKILL
            created_before = model.batches.stats()["created"]
            assert created_before == (1 if point == "created" else 0)
            d.env = env  # the next worker is not killed
            d.workers.append(d.start_worker())

            async def all_done() -> bool:
                return await done_jobs(pool, "digest") == 20

            await wait_for(all_done, within_s=180, what="every job done")

    stats = model.batches.stats()
    assert set(stats["lines"]) == {line_id(j, "model", dialect) for j in job_ids}
    assert set(stats["lines"].values()) == {1}  # no line submitted twice
    assert stats["created"] == 1  # created once: by the second worker, or adopted
    assert await model_checkpoints(pool) == dict.fromkeys(job_ids, 1)


async def test_a_flex_job_without_flex_capacity_is_answered_at_the_standard_tier_once(
    pool, model, env, tmp_path
) -> None:
    key = await create_api_key(pool, "acme")
    d = Deployment(env, tmp_path)
    with d:
        async with d.client(key, within_s=90, timeout=30) as client:
            job_id = await post(
                client,
                "/v1/nightly",
                {"text": "A nightly digest. [[fake:busy]]"},
                "flex-lane-job-0001",
            )

            async def done() -> bool:
                return await done_jobs(pool, "nightly") == 1

            await wait_for(done, within_s=120, what="the flex job done")
            job = (await client.get(f"/v1/nightly/{job_id}")).json()

    assert job["result"]["summary"].startswith("A nightly digest.")
    # Its flex attempts (ONCELY_LLM_MAX_ATTEMPTS: 2) met no capacity, then
    # the standard tier answered once.
    assert model.stats().tiers == {"flex": 2, "default": 1}
    [prompt] = model.stats().prompts
    assert prompt.billed == 1
    lanes = await rows(
        pool, "SELECT lane, outcome FROM model_calls WHERE job_id = %s ORDER BY id", job_id
    )
    assert lanes == [("flex", "retryable"), ("flex", "retryable"), ("standard", "ok")]


async def test_failed_lines_an_expired_batch_and_a_cancelled_job_through_real_processes(
    pool, model, env, tmp_path
) -> None:
    """A line that failed with 400 kills its job; one that failed with 503
    goes in the next batch; a line whose batch expired goes once more; a
    job cancelled before its line was gathered never has it sent."""
    key = await create_api_key(pool, "acme")
    # Lines gathered 3 s after the first waits: time to cancel one.
    d = Deployment({**env, "ONCELY_BATCH_GATHER_S": "3"}, tmp_path)
    with d:
        async with d.client(key, within_s=90, timeout=30) as client:
            texts = {
                "bad": "A bad request. [[fake:400]]",
                "flaky": "A server error once. [[fake:503*1]]",
                "late": "An expiring batch once. [[fake:expire*1]]",
                "cancelled": "Cancelled before its batch.",
            }
            jobs = {
                name: await post(client, "/v1/digest", {"text": text}, f"mixed-lane-job-{name}")
                for name, text in texts.items()
            }
            custom_ids = {name: line_id(job, "model", "chat") for name, job in jobs.items()}

            async def cancelled_line_stored() -> bool:
                found = await rows(
                    pool, "SELECT 1 FROM batch_lines WHERE custom_id = %s", custom_ids["cancelled"]
                )
                return bool(found)

            await wait_for(cancelled_line_stored, within_s=60, what="the line's intent stored")
            r = await client.post(f"/v1/digest/{jobs['cancelled']}/cancel")
            assert r.status_code == 202, r.text

            async def ended() -> bool:
                found = await rows(
                    pool,
                    "SELECT count(*) FROM jobs WHERE job_id = ANY(%s::uuid[])"
                    " AND status IN ('done', 'dead', 'cancelled')",
                    list(jobs.values()),
                )
                return found == [(4,)]

            await wait_for(ended, within_s=180, what="every job ended")
            statuses = {
                name: (await client.get(f"/v1/digest/{job}")).json()["status"]
                for name, job in jobs.items()
            }

    assert statuses == {"bad": "dead", "flaky": "done", "late": "done", "cancelled": "cancelled"}
    lines = model.batches.stats()["lines"]
    assert lines == {
        custom_ids["bad"]: 1,
        custom_ids["flaky"]: 2,  # failed with 503, sent again
        custom_ids["late"]: 2,  # its batch expired, sent again
    }
    [(line_status,)] = await rows(
        pool, "SELECT status FROM batch_lines WHERE custom_id = %s", custom_ids["cancelled"]
    )
    assert line_status == "dropped"
