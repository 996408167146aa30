"""Workflow declarations and the job store's pieces, on real PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest
from pydantic import BaseModel

from oncely import App, Context, PermanentError, Workflow, email, webhook
from oncely.app import load_app
from oncely.effects import Email
from oncely.jobs.records import JobSpec
from oncely.journal import (
    Emitted,
    ForEvent,
    NewCheckpoint,
    Replay,
    RunStopped,
    Wait,
    Writes,
)


class Req(BaseModel):
    text: str


class Res(BaseModel):
    answer: str


async def step(request: Req, ctx: Context) -> Res:
    return Res(answer=request.text)


def declare(name: str = "echo", route: str = "/v1/echo", **extra) -> Workflow[Req, Res]:
    return Workflow(name=name, route=route, request=Req, result=Res, step=step, **extra)


async def test_runs_asked_together_share_one_query(jobs, checkpoints):
    """Deliveries load their jobs' runs in batches: one query for a burst."""
    stored_ids = [str(uuid.uuid4()) for _ in range(5)]
    for job_id in stored_ids:
        await jobs.accept(JobSpec(job_id, "acme", "summaries", {"text": "t", "notify": "a@x.io"}))
        assert await jobs.finish("summaries", job_id, {"summary": "s"}, None)
    missing_ids = [str(uuid.uuid4()) for _ in range(45)]
    asked = stored_ids + missing_ids + stored_ids[:1]  # a job asked about twice
    before = checkpoints._runs.flushes
    runs = await asyncio.gather(*(checkpoints.run_of(job_id) for job_id in asked))
    assert [None if r is None else r.status for r in runs] == ["done"] * 5 + [None] * 45 + ["done"]
    assert checkpoints._runs.flushes == before + 1
    assert await checkpoints.run_of(missing_ids[0]) is None
    assert checkpoints._runs.flushes == before + 2


def _reached(job_id: str, key: str = "model") -> Writes:
    """A model checkpoint reached, with an effect emitted before it."""
    effect = Emitted("ticket.triaged", {"job": job_id}, f"triaged:{job_id}")
    return Writes((NewCheckpoint(key, 1, "model", {"a": job_id}, None, (effect,)),))


async def test_writes_asked_together_share_one_statement_and_only_the_loser_replays(
    jobs, checkpoints, pool
):
    """Checkpoint writes of many runs go in one statement; a run whose key
    another delivery stored first replays alone, a job no longer running
    stops alone, and every other run's checkpoints and effects are written."""
    ids = [str(uuid.uuid4()) for _ in range(6)]
    for job_id in ids:
        await jobs.accept(JobSpec(job_id, "acme", "triage", {"subject": "s", "body": "b"}))
    lost, finished, *kept = ids
    await checkpoints.write("triage", lost, 0, _reached(lost, "model"))  # the winner's
    assert await jobs.finish("triage", finished, {"n": 1}, None)
    before = checkpoints._writes.flushes
    outcomes = await asyncio.gather(
        *(checkpoints.write("triage", job_id, 0, _reached(job_id)) for job_id in ids),
        return_exceptions=True,
    )
    assert checkpoints._writes.flushes == before + 1
    assert isinstance(outcomes[0], Replay) and isinstance(outcomes[1], RunStopped)
    assert outcomes[2:] == [None] * len(kept)
    async with pool.connection() as conn:
        stored = await (
            await conn.execute("SELECT job_id::text, key, value FROM checkpoints")
        ).fetchall()
        effects = await (await conn.execute("SELECT job_id::text FROM outbox")).fetchall()
    assert sorted(stored) == sorted((j, "model", f'{{"a":"{j}"}}') for j in [lost, *kept])
    assert sorted(e[0] for e in effects) == sorted([lost, *kept])


async def test_results_finished_together_share_one_statement_and_fail_alone(jobs, pool):
    """Finishes of many deliveries go in one statement: each stores its own
    result and effect; a job finished twice in the burst stores once; a
    result PostgreSQL refuses fails its own delivery, not the others."""
    ids = [str(uuid.uuid4()) for _ in range(5)]
    for job_id in ids:
        await jobs.accept(JobSpec(job_id, "acme", "triage", {"subject": "s", "body": "b"}))
    refused, *kept = ids

    def finish(job_id: str, result: dict[str, str]):
        effect = Emitted("ticket.triaged", {"job": job_id}, f"triaged:{job_id}")
        return jobs.finish("triage", job_id, result, None, Writes(emitted=(effect,)))

    before = jobs._finished.flushes
    outcomes = await asyncio.gather(
        finish(refused, {"n": "\u0000"}),  # jsonb holds no NUL
        *(finish(job_id, {"n": job_id}) for job_id in [*kept, kept[0]]),
        return_exceptions=True,
    )
    assert jobs._finished.flushes == before + 1
    assert isinstance(outcomes[0], psycopg.errors.DataError)
    assert outcomes[1:] == [True] * len(kept) + [False]
    async with pool.connection() as conn:
        results = await (await conn.execute("SELECT job_id::text, result FROM results")).fetchall()
        effects = await (await conn.execute("SELECT job_id::text FROM outbox")).fetchall()
        done = await (await conn.execute("SELECT job_id::text, status FROM jobs")).fetchall()
    assert sorted(results) == sorted((j, {"n": j}) for j in kept)
    assert sorted(e[0] for e in effects) == sorted(kept)
    assert dict(done) == {refused: "queued"} | dict.fromkeys(kept, "done")


async def test_a_wait_blocked_by_an_events_lock_sees_the_event_once_it_commits(
    jobs, checkpoints, pool
):
    """The wait is one statement that locks the job's row before it reads
    the job's events: an event whose transaction held the lock and
    committed while the wait waited for it ends the wait at once, rather
    than leaving the job waiting for an event it already has."""
    job_id = str(uuid.uuid4())
    await jobs.accept(JobSpec(job_id, "acme", "triage", {"subject": "s", "body": "b"}))
    wait = Wait("wait", 1, "wait", 60.0, ForEvent("go"))
    async with pool.connection() as event_side:
        async with event_side.transaction():
            await event_side.execute(
                "SELECT 1 FROM jobs WHERE job_id = %s FOR NO KEY UPDATE", (job_id,)
            )
            await event_side.execute(
                "INSERT INTO job_events (job_id, name, payload, fingerprint)"
                " VALUES (%s, 'go', '{\"ok\": 1}', 'f')",
                (job_id,),
            )
            waiting = asyncio.ensure_future(
                checkpoints.start_wait("triage", job_id, 0, Writes(), wait)
            )
            async with pool.connection() as probe:
                for _ in range(400):
                    cur = await probe.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database()"
                    )
                    if (await cur.fetchone())[0]:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the wait never queued behind the event's lock")
        outcome = await waiting
    assert outcome is not None and (outcome.status, outcome.value) == ("done", {"ok": 1})
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT status FROM jobs")).fetchone()
        stored = await (await conn.execute("SELECT key, status FROM checkpoints")).fetchall()
    assert row == ("queued",) and stored == [("wait", "done")]


async def test_finish_writes_result_rows_and_done_once(jobs, pool):
    """The second delivery's finish writes nothing: not the result, not its rows."""
    job_id = str(uuid.uuid4())
    await jobs.accept(JobSpec(job_id, "acme", "triage", {"subject": "s", "body": "b"}))
    wf = load_app("oncely.builtin:app")["triage"]
    ctx = Context(wf, job_id, "acme", model=None, delivery=1)  # type: ignore[arg-type]
    ctx.emit("ticket.triaged", {"n": 1}, dedupe_key=f"ticket_triaged:{job_id}")
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "model_calls": 1}
    emitted = Writes(emitted=ctx.emitted)
    assert await jobs.finish("triage", job_id, {"n": 1}, usage, emitted) is True
    assert await jobs.finish("triage", job_id, {"n": 2}, usage, emitted) is False
    async with pool.connection() as conn:
        rows = await (await conn.execute("SELECT result, usage FROM results")).fetchall()
        outbox = await (
            await conn.execute("SELECT topic, dedupe_key, workflow, job_id::text FROM outbox")
        ).fetchall()
        status = await (await conn.execute("SELECT status FROM jobs")).fetchone()
    assert rows == [({"n": 1}, usage)]
    assert outbox == [("ticket.triaged", f"ticket_triaged:{job_id}", "triage", job_id)]
    assert status == ("done",)


def test_emit_defaults_the_dedupe_key_to_topic_and_job():
    wf = declare(effects=[webhook("echo.done")])
    ctx = Context(wf, "job-1", "acme", model=None, delivery=1)  # type: ignore[arg-type]
    ctx.emit("echo.done", Res(answer="a"))
    [row] = ctx.emitted
    assert (row.topic, row.dedupe_key, dict(row.payload)) == (
        "echo.done",
        "echo.done:job-1",
        {"answer": "a"},
    )


def test_emit_refuses_an_undeclared_topic_and_a_repeated_key():
    wf = declare(effects=[webhook("echo.done")])
    ctx = Context(wf, "job-1", "acme", model=None, delivery=1)  # type: ignore[arg-type]
    with pytest.raises(PermanentError, match="does not declare"):
        ctx.emit("echo.other", {})
    ctx.emit("echo.done", {})
    with pytest.raises(PermanentError, match="twice"):
        ctx.emit("echo.done", {})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "Bad Name"}, "workflow name"),
        ({"route": "v1/no-slash"}, "route"),
        ({"effects": [webhook("t"), webhook("t")]}, "topic twice"),
    ],
)
def test_bad_declarations_fail_at_import_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        declare(**kwargs)


def test_an_app_refuses_clashing_names_routes_and_topics():
    render = lambda payload: Email("a@x.io", "s", "t")  # noqa: E731
    with pytest.raises(ValueError, match="twice"):
        App([declare(), declare()])
    with pytest.raises(ValueError, match="share a route"):
        App([declare(), declare(name="other")])
    with pytest.raises(
        ValueError, match=r"both declare topic .t.: a topic is one workflow.s.*own topic"
    ):
        App(
            [
                declare(effects=[email("t", render)]),
                declare(name="other", route="/v1/other", effects=[webhook("t")]),
            ]
        )


def test_load_app_explains_what_is_wrong():
    assert load_app("oncely.builtin:app").names == ["summaries", "triage"]
    with pytest.raises(ValueError, match="module:attribute"):
        load_app("oncely.builtin")
    with pytest.raises(ValueError, match="cannot import"):
        load_app("no_such_module_here:app")
    with pytest.raises(ValueError, match="not an oncely App"):
        load_app("oncely.builtin:summaries")
