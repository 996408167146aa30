"""Dead letters can be listed and replayed; a replayed job ends done once."""

from __future__ import annotations

from typing import Any

from oncely.queue.dead import list_dead, replay, replay_all
from oncely.queue.stream import Stream
from tests.helpers import count, drain, job_status, make_worker, pending, submit


async def test_dead_letter_replay_runs_the_job_to_done(pool, redis, summary_job, fake_llm):
    stream = Stream(redis)
    await stream.ensure_group()
    job_id = await submit(pool, stream, "Refused once, then fine. [[fake:400*1]]")
    worker = make_worker(stream, summary_job, pool)
    await drain(worker)
    assert await job_status(pool, job_id) == "dead"
    [letter] = await list_dead(stream)
    assert letter.job_id == job_id
    assert letter.reason == "permanent"
    assert letter.deliveries == 1
    assert "400" in letter.last_error

    assert await replay(pool, stream, letter.dead_id) == job_id
    assert await job_status(pool, job_id) == "queued"
    assert await list_dead(stream) == []
    await drain(worker)
    assert await job_status(pool, job_id) == "done"
    assert fake_llm.stats().total == 2
    assert await count(pool, "SELECT count(*) FROM outbox") == 1
    assert await pending(stream) == 0


async def test_replay_of_an_unknown_id_changes_nothing(pool, redis):
    stream = Stream(redis)
    await stream.ensure_group()
    assert await replay(pool, stream, "1-0") is None
    info: Any = await redis.xlen(stream.stream)
    assert info == 0


async def test_replay_all_empties_the_dead_stream(pool, redis, summary_job, fake_llm):
    stream = Stream(redis)
    await stream.ensure_group()
    ids = [await submit(pool, stream, f"Refused {i}. [[fake:400*1]]") for i in range(3)]
    await drain(make_worker(stream, summary_job, pool))
    assert len(await list_dead(stream)) == 3
    assert sorted(await replay_all(pool, stream)) == sorted(ids)
    assert await list_dead(stream) == []
    assert await redis.xlen(stream.stream) == 6
