"""Dead letters can be listed and replayed; a replayed job ends done once."""

from __future__ import annotations

import asyncio
from typing import Any

from oncely.jobs import dead_letters
from tests.helpers import count, drain, job_status, make_worker, pending, submit


async def test_dead_letter_replay_runs_the_job_to_done(pool, redis, jobs, summary_job, fake_llm):
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    job_id = await submit(pool, stream, "Refused once, then fine. [[fake:400*1]]")
    worker = make_worker(stream, summary_job, pool)
    await drain(worker)
    assert await job_status(pool, job_id) == "dead"
    [letter] = await dead_letters.list_dead(jobs, "summaries")
    assert letter.job_id == job_id
    assert letter.reason == "permanent"
    assert letter.deliveries == 1
    assert "400" in letter.last_error

    replayed = await dead_letters.replay(jobs, "summaries", letter.dead_id)
    assert replayed is not None and replayed.job_id == job_id
    assert await job_status(pool, job_id) == "queued"
    assert await dead_letters.list_dead(jobs, "summaries") == []
    await drain(worker)
    assert await job_status(pool, job_id) == "done"
    assert fake_llm.stats().total == 2
    assert await count(pool, "SELECT count(*) FROM outbox") == 1
    assert await pending(stream) == 0


async def test_replay_of_an_unknown_id_changes_nothing(pool, redis, jobs):
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    assert await dead_letters.replay(jobs, "summaries", "1-0") is None
    assert (
        await dead_letters.replay(jobs, "summaries", "00000000-0000-4000-8000-000000000000") is None
    )
    info: Any = await redis.xlen(stream.stream)
    assert info == 0


async def test_replay_all_empties_the_dead_stream(pool, redis, jobs, summary_job, fake_llm):
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    ids = [await submit(pool, stream, f"Refused {i}. [[fake:400*1]]") for i in range(3)]
    await drain(make_worker(stream, summary_job, pool))
    assert len(await dead_letters.list_dead(jobs, "summaries")) == 3
    assert sorted(await dead_letters.replay_all(jobs, "summaries")) == sorted(ids)
    assert await dead_letters.list_dead(jobs, "summaries") == []
    assert await redis.xlen(stream.stream) == 6
    assert await redis.xlen(stream.dead) == 0  # the mirror follows the record


async def test_dead_letters_come_from_postgresql_and_survive_redis_losing_its_data(
    pool, redis, jobs, summary_job, fake_llm
):
    """Redis forgets everything (a restart without persistence): the dead
    letters are still listed and replayed, from the job rows."""
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    ids = [await submit(pool, stream, f"Refused {i}. [[fake:400*1]]") for i in range(2)]
    worker = make_worker(stream, summary_job, pool)
    await drain(worker)
    await redis.flushdb()
    await stream.ensure_group()
    letters = await dead_letters.list_dead(jobs, "summaries")
    assert sorted(d.job_id for d in letters) == sorted(ids)
    assert {d.reason for d in letters} == {"permanent"} and all(
        "400" in d.last_error for d in letters
    )
    assert sorted(await dead_letters.replay_all(jobs, "summaries")) == sorted(ids)
    await drain(worker)
    assert [await job_status(pool, i) for i in ids] == ["done", "done"]


async def test_replay_all_replays_each_job_once_even_if_it_dies_again(
    pool, redis, jobs, summary_job, fake_llm
):
    """A worker serving the workflow may kill a replayed job again before
    the replay is over: it stays dead, and the replay ends."""
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    ids = [await submit(pool, stream, f"Refused {i}. [[fake:400*1]]") for i in range(3)]
    await drain(make_worker(stream, summary_job, pool))

    class DyingAgain(type(jobs)):  # type: ignore[misc]
        async def replay(self, job: Any) -> None:
            await super().replay(job)
            await self.mark_dead(job.job_id, "permanent: refused again")

    again = DyingAgain(pool, jobs.streams)
    replayed = await asyncio.wait_for(dead_letters.replay_all(again, "summaries"), timeout=60)
    assert sorted(replayed) == sorted(ids)
    assert [await job_status(pool, i) for i in ids] == ["dead"] * 3
    assert await count(pool, "SELECT count(*) FROM jobs") == 3


async def test_a_job_of_a_workflow_the_app_lacks_is_refused_before_anything_changes(
    pool, stream, redis
) -> None:
    """An operator's replay or rewind run with another app: refused, and
    the job stays dead, its checkpoints where they were."""
    import uuid

    import pytest

    from oncely.builtin.triage import triage
    from oncely.errors import NotInApp
    from oncely.jobs.checkpoints import Checkpoints
    from oncely.jobs.store import Jobs
    from oncely.queue.stream import Stream

    job_id = await submit(pool, stream, "Dead already.")
    async with pool.connection() as conn:
        await conn.execute("UPDATE jobs SET status = 'dead' WHERE job_id = %s", (job_id,))
    other = Jobs(pool, {"triage": Stream(redis, triage.keys)})
    with pytest.raises(NotInApp, match="'summaries'"):
        await dead_letters.replay(other, None, job_id)
    with pytest.raises(NotInApp):
        await Checkpoints(other).rewind(uuid.UUID(job_id), "model")
    assert await job_status(pool, job_id) == "dead"
