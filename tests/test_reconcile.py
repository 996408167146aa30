"""The reconciler re-enqueues exactly the queued jobs whose message is gone."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from oncely.jobs.reconcile import Reconciler
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query


@pytest.fixture
async def stream(jobs) -> Stream:
    s = jobs.streams["summaries"]
    await s.ensure_group()
    return s


async def accept(pool, stream: Stream | None, *, age_s: float) -> str:
    """A job row aged ``age_s``; with a stream entry unless ``stream`` is None."""
    job_id = str(uuid.uuid4())
    payload = {"text": "t", "notify": "ada@example.com"}
    async with pool.connection() as conn:
        await conn.execute(query("insert_job"), (job_id, "acme", "summaries", Jsonb(payload)))
        await conn.execute(
            "UPDATE jobs SET created_at = now() - make_interval(secs => %s) WHERE job_id = %s",
            (age_s, job_id),
        )
    if stream is not None:
        await stream.enqueue(JobMessage.new(job_id, "acme", payload))
    return job_id


async def stream_job_ids(stream: Stream) -> list[str]:
    entries: Any = await stream.redis.xrange(stream.stream)
    return [fields["job_id"] for _, fields in entries]


async def test_only_old_queued_jobs_without_a_message_are_requeued(pool, stream, jobs):
    waiting = await accept(pool, stream, age_s=600)  # old, but its message exists
    lost = await accept(pool, None, age_s=600)  # API died before XADD
    fresh = await accept(pool, None, age_s=1)  # too young to tell
    reconciler = Reconciler(jobs, "summaries", after_s=300)
    assert await reconciler.run_once() == 1
    assert sorted(await stream_job_ids(stream)) == sorted([waiting, lost])
    assert fresh not in await stream_job_ids(stream)


async def test_jobs_are_requeued_after_redis_lost_its_data(pool, stream, jobs, redis):
    ids = [await accept(pool, stream, age_s=600) for _ in range(3)]
    await redis.flushdb()  # Redis restarted without persistence
    await stream.ensure_group()
    assert await Reconciler(jobs, "summaries", after_s=300).run_once() == 3
    assert sorted(await stream_job_ids(stream)) == sorted(ids)


async def test_trimmed_entry_still_in_the_index_counts_as_lost(pool, stream, jobs, redis):
    job_id = await accept(pool, stream, age_s=600)
    [entry_id] = [e for e, _ in await redis.xrange(stream.stream)]
    await redis.xdel(stream.stream, entry_id)
    assert await redis.hget(stream.index, job_id) == entry_id
    assert await Reconciler(jobs, "summaries", after_s=300).run_once() == 1
    assert await stream_job_ids(stream) == [job_id]


async def test_done_and_dead_jobs_are_never_requeued(pool, stream, jobs):
    done = await accept(pool, None, age_s=600)
    dead = await accept(pool, None, age_s=600)
    async with pool.connection() as conn:
        await conn.execute("UPDATE jobs SET status = 'done' WHERE job_id = %s", (done,))
        await conn.execute(
            query("mark_job_dead"),
            {"error": "permanent: 400", "job_id": dead, "generation": None},
        )
    assert await Reconciler(jobs, "summaries", after_s=300).run_once() == 0


async def test_one_pass_at_a_time_across_processes(pool, stream, jobs, redis):
    await accept(pool, None, age_s=600)
    first = Reconciler(jobs, "summaries", after_s=300)
    second = Reconciler(jobs, "summaries", after_s=300)
    assert await first.run_once() == 1
    assert await second.run_once() == 0, "the lock is held for the pass interval"
    assert await redis.pttl(stream.keys.reconcile_lock) > 0
    assert len(await stream_job_ids(stream)) == 1


async def test_each_workflow_is_reconciled_into_its_own_stream(pool, jobs, redis):
    """Redis lost its data with jobs of both workflows queued: each comes back
    into its own stream, and only into it."""
    accepted = {}
    for kind, payload in (
        ("summaries", {"text": "t", "notify": "ada@example.com"}),
        ("triage", {"subject": "s", "body": "b"}),
    ):
        job_id = str(uuid.uuid4())
        async with pool.connection() as conn:
            await conn.execute(query("insert_job"), (job_id, "acme", kind, Jsonb(payload)))
            await conn.execute(
                "UPDATE jobs SET created_at = now() - interval '10 min' WHERE job_id = %s",
                (job_id,),
            )
        await jobs.streams[kind].enqueue(JobMessage.new(job_id, "acme", payload))
        accepted[kind] = job_id
    await redis.flushdb()  # what FLUSHALL does to this database
    for kind in accepted:
        await jobs.streams[kind].ensure_group()
        assert await Reconciler(jobs, kind, after_s=300).run_once() == 1
    for kind, job_id in accepted.items():
        assert await stream_job_ids(jobs.streams[kind]) == [job_id]


async def test_a_job_waiting_out_its_backoff_is_not_requeued(pool, stream, jobs, redis):
    job_id = await accept(pool, stream, age_s=600)
    [(entry_id, _)] = await redis.xrange(stream.stream)
    await stream.read_new("c1", 10, 10)
    assert await stream.defer("c1", entry_id, job_id, 60.0, {"job_id": job_id})
    assert await redis.xlen(stream.stream) == 1  # acknowledged, not yet trimmed
    await redis.xdel(stream.stream, entry_id)
    assert await Reconciler(jobs, "summaries", after_s=300).run_once() == 0
    await redis.zrem(stream.keys.delayed, job_id)  # the delayed copy lost too
    await redis.delete(stream.keys.reconcile_lock)  # the next pass's turn
    assert await Reconciler(jobs, "summaries", after_s=0.1).run_once() == 1


async def test_a_backlog_still_in_the_stream_cannot_hide_a_lost_job_behind_it(
    pool, stream, jobs, redis
):
    """Pages walk past jobs whose messages wait in line: the lost one, older
    than the threshold but behind a page of waiting ones, is found on the
    next pass."""
    waiting = [await accept(pool, stream, age_s=900 - i) for i in range(5)]
    lost = await accept(pool, None, age_s=600)
    reconciler = Reconciler(jobs, "summaries", after_s=300, batch=3)
    found = 0
    for _ in range(3):
        await redis.delete(stream.keys.reconcile_lock)  # the next pass's turn
        found += await reconciler.run_once()
    assert found == 1
    assert sorted(await stream_job_ids(stream)) == sorted([*waiting, lost])


def test_a_lost_job_is_back_within_a_minute_by_default() -> None:
    """The default itself (a pass every half of it: back within 1.5 × it),
    whatever this machine's environment sets."""
    from oncely.settings import Settings

    assert Settings.model_fields["reconcile_after_s"].default * 1.5 <= 60
