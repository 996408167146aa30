"""A job's deliveries in PostgreSQL: every delivery that reports back has a
row (the successful one written by the statement that stores the result),
a killed one leaves a gap that Redis still counts, and operators see them
in ``oncely jobs show`` (and on the console's job page, tests/test_console.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from oncely.bootstrap import connect_llm, step_config
from oncely.builtin.summaries import summaries
from oncely.errors import TransientError
from oncely.jobs.handler import WorkflowHandler
from oncely.jobs.records import DeliveryReport
from oncely.jobs.store import Jobs
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.stream import Stream
from oncely.queue.worker import Worker
from oncely.settings import Settings
from tests.helpers import drain, job_status, make_worker, pending, submit
from tests.processes import oncely, wait_for

# Redelivered within milliseconds, so a test waits on state, not on backoffs.
FAST = {"redelivery_base_s": 0.01, "redelivery_max_s": 0.02}


@asynccontextmanager
async def one_call_per_delivery(
    pool: Any, jobs: Jobs, worker_settings: Settings
) -> AsyncIterator[WorkflowHandler]:
    """The summaries handler on the fake model with one model attempt per
    delivery: a 503 fails the delivery (no in-process retry) and the job is
    redelivered."""
    settings = worker_settings.model_copy(update={"llm_max_attempts": 1})
    llm = connect_llm(settings)
    try:
        yield WorkflowHandler(summaries, jobs, llm, step_config(settings), OutboxWakeUp(pool))
    finally:
        await llm.aclose()


async def run_until(pool: Any, worker: Worker, job_id: str, status: str) -> None:
    """The worker's own rounds (``run_once``), due redeliveries put back
    between them, until the job has ``status`` and nothing is pending."""

    async def settled() -> bool:
        await worker.stream.promote_due()
        await drain(worker)
        return await job_status(pool, job_id) == status and not await pending(worker.stream)

    await wait_for(settled, what=f"job {status}")


async def deliveries(pool: Any, job_id: str) -> list[tuple[Any, ...]]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT delivery, outcome, error, model_calls, consumer FROM job_deliveries"
            " WHERE job_id = %s ORDER BY id",
            (job_id,),
        )
        return await cur.fetchall()


async def flaky_job_done(pool: Any, jobs: Jobs, worker_settings: Settings) -> tuple[str, str]:
    """A summaries job whose model answers 503 twice, then a summary, run by a
    real worker to done; (its id, the worker's consumer name)."""
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    job_id = await submit(pool, stream, "Unavailable twice, then fine. [[fake:503*2]]")
    async with one_call_per_delivery(pool, jobs, worker_settings) as handler:
        worker = make_worker(stream, handler, pool, **FAST)
        await run_until(pool, worker, job_id, "done")
    return job_id, worker.consumer


async def test_503_twice_then_done_is_three_deliveries_the_last_written_with_the_result(
    pool, jobs, worker_settings, fake_llm
):
    job_id, consumer = await flaky_job_done(pool, jobs, worker_settings)

    rows = await deliveries(pool, job_id)
    assert [(r[0], r[1]) for r in rows] == [(1, "retry"), (2, "retry"), (3, "done")]
    for number, _, error, _, _ in rows[:2]:
        assert error is not None and "503" in error, (number, error)
    assert rows[2][2] is None
    assert [r[3] for r in rows] == [1, 1, 1], "one model call per delivery"
    assert {r[4] for r in rows} == {consumer}
    assert fake_llm.stats(contains="Unavailable twice").prompts[0].count == 3
    # The done row was written by the statement that stored the result: one
    # transaction (the handler's statements autocommit, so one statement)
    # wrote the result, the outbox row, the job's done and the delivery.
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT r.xmin::text, o.xmin::text, j.xmin::text, d.xmin::text"
            "  FROM results r JOIN outbox o USING (job_id) JOIN jobs j USING (job_id)"
            "  JOIN job_deliveries d USING (job_id)"
            " WHERE job_id = %s AND d.outcome = 'done'",
            (job_id,),
        )
        [xmins] = await cur.fetchall()
    assert len(set(xmins)) == 1, xmins


async def test_a_permanent_failure_is_one_dead_delivery(pool, stream, summary_job, fake_llm):
    await stream.ensure_group()
    job_id = await submit(pool, stream, "Refused for good. [[fake:400*1]]")
    await run_until(pool, make_worker(stream, summary_job, pool, **FAST), job_id, "dead")

    [(number, outcome, error, model_calls, _)] = await deliveries(pool, job_id)
    assert (number, outcome, model_calls) == (1, "dead", 1)
    assert error.startswith("permanent: ") and "400" in error
    assert fake_llm.stats(contains="Refused for good").prompts[0].count == 1


async def test_a_killed_delivery_has_no_row_its_number_is_skipped_and_redis_counts_it(
    pool, jobs, summary_job
):
    """A worker that read the job and died never reports; while the entry is
    pending, its whereabouts say so, and the next delivery is number 2."""
    stream: Stream = jobs.streams["summaries"]
    await stream.ensure_group()
    job_id = await submit(pool, stream, "Its first worker dies.")
    assert len(await stream.read_new("killed-worker", 10, 10)) == 1  # then it is gone

    now = await stream.whereabouts(job_id)
    assert (now.state, now.consumer, now.entry_deliveries, now.delivery) == (
        "in_flight",
        "killed-worker",
        1,
        1,
    )
    worker = make_worker(stream, summary_job, pool, claim_idle_ms=200, **FAST)
    await run_until(pool, worker, job_id, "done")

    assert [(r[0], r[1]) for r in await deliveries(pool, job_id)] == [(2, "done")]
    assert (await stream.whereabouts(job_id)).state == "none"


async def test_a_delivery_stopped_by_shutdown_is_cancelled_and_left_pending(
    pool, stream, summary_job, fake_llm
):
    await stream.ensure_group()
    job_id = await submit(pool, stream, "Slow. [[fake:sleep=30]]")
    worker = make_worker(stream, summary_job, pool, shutdown_grace_s=0.05, **FAST)
    task = asyncio.create_task(worker.run())

    async def calling() -> bool:
        return fake_llm.stats().in_flight == 1

    await wait_for(calling, what="the model call in flight")
    worker.stop()
    await task

    [(number, outcome, error, _, consumer)] = await deliveries(pool, job_id)
    assert (number, outcome, consumer) == (1, "cancelled", worker.consumer)
    assert "grace" in error
    assert await pending(stream) == 1, "the entry stays for another worker"
    assert await job_status(pool, job_id) == "queued"


async def test_a_delivery_past_its_bound_is_cancelled_and_redelivered(
    pool, stream, summary_job, fake_llm
):
    await stream.ensure_group()
    job_id = await submit(pool, stream, "Too slow once. [[fake:hang*1]]")
    # Below the model's own 2 s timeout (the hang is cut off by the bound,
    # not retried), with room for the second delivery on a busy machine.
    worker = make_worker(stream, summary_job, pool, handler_timeout_s=1.5, **FAST)
    await run_until(pool, worker, job_id, "done")

    rows = await deliveries(pool, job_id)
    assert [(r[0], r[1]) for r in rows] == [(1, "cancelled"), (2, "done")]
    assert "still running after 1.5 s" in rows[0][2]


@pytest.mark.slow
async def test_jobs_show_prints_the_deliveries_and_exits_3_for_an_unknown_job(
    pool, jobs, worker_settings, fake_llm, redis_url, database_url
):
    job_id, _ = await flaky_job_done(pool, jobs, worker_settings)
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url}

    shown = await asyncio.to_thread(oncely, "jobs", "show", job_id, "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert (view["job_id"], view["workflow"], view["status"]) == (job_id, "summaries", "done")
    assert [(d["delivery"], d["outcome"]) for d in view["deliveries"]] == [
        (1, "retry"),
        (2, "retry"),
        (3, "done"),
    ]
    assert "503" in view["deliveries"][0]["error"]
    assert view["message"]["state"] == "none"
    assert [r["topic"] for r in view["outbox"]] == ["email.summary_ready"]

    table = await asyncio.to_thread(
        oncely, "jobs", "show", job_id, "--workflow", "summaries", env=env
    )
    assert table.returncode == 0, table.stderr
    assert job_id in table.stdout and "retry" in table.stdout

    unknown = str(uuid.uuid4())
    missing = await asyncio.to_thread(oncely, "jobs", "show", unknown, env=env)
    assert missing.returncode == 3
    assert f"no job {unknown}" in missing.stderr
    elsewhere = await asyncio.to_thread(oncely, "jobs", "show", job_id, "-w", "triage", env=env)
    assert elsewhere.returncode == 3
    bad = await asyncio.to_thread(oncely, "jobs", "show", "not-a-uuid", env=env)
    assert bad.returncode == 2 and "not a job id" in bad.stderr


async def test_a_history_that_cannot_be_written_is_logged_and_the_job_still_redelivered(
    pool, jobs, stream
):
    await stream.ensure_group()
    job_id = await submit(pool, stream, "Fails once; its history cannot be written.")

    async def fails(message: Any, delivery: Any) -> str:
        raise TransientError("provider unavailable")

    async def history_down(reports: list[DeliveryReport]) -> None:
        raise psycopg.OperationalError("PostgreSQL is away")

    worker = make_worker(stream, fails, pool, **FAST)
    worker.on_failed = history_down
    with capture_logs() as logs:
        await drain(worker)

    assert await stream.redis.hget(stream.index, job_id) == "delayed"
    [event] = [e for e in logs if e["event"] == "job.delivery_not_recorded"]
    assert (event["outcome"], event["jobs"]) == ("retry", 1)
    assert await deliveries(pool, job_id) == []
