"""Workflow declarations and the job store's pieces, on real PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from pydantic import BaseModel

from oncely import App, Context, PermanentError, Workflow, email, webhook
from oncely.app import load_app
from oncely.effects import Email
from oncely.jobs.records import JobSpec
from oncely.journal import Writes


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
    with pytest.raises(ValueError, match="share"):
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
