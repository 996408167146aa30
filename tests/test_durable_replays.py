"""Replays of step functions that are more than a straight line: branches
under asyncio.gather and TaskGroup, checkpoints inside a step's work, a
failure the step catches, branches left running, text PostgreSQL's jsonb
refuses, and a job cancelled then rewound. Each test failed before the fix
it guards (a review found them); real Redis, PostgreSQL and the fake model.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from structlog.testing import capture_logs

from oncely import Context, PermanentError, TransientError
from tests.durable import (
    Harness,
    Said,
    Text,
    cancel_mid_call,
    drain,
    one_off,
    pending,
    pending_is,
    redeliver_until,
    until_async,
)
from tests.helpers import service_running
from tests.steps_app import Approval


async def finished(h: Harness, job_id: str) -> bool:
    return await h.status(job_id) in ("done", "dead")


async def run_to_its_end(h: Harness, workflow: str) -> str:
    """A job of ``workflow`` (a one-off), redelivered at once after each
    failed run until it ends: its id."""
    worker = h.worker(workflow, redelivery_base_s=0.01, redelivery_max_s=0.01)
    job_id = await h.submit(f"/v1/{workflow}", {"text": "x"})
    await redeliver_until(h, worker, workflow, lambda: finished(h, job_id))
    return job_id


async def keys(h: Harness, job_id: str) -> list[tuple[str, str]]:
    """The job's checkpoints in order (rows, and those kept with the result)."""
    return [(c.key, c.status) for c in await h.checkpoints.of_job(uuid.UUID(job_id))]


async def replayed(
    custom: Any, name: str, body: Callable[[Text, Context], Awaitable[str]], **settings: Any
) -> tuple[Harness, str, list[int]]:
    """A one-off ``name`` whose step says what ``body`` returns and fails
    once after it (the redelivery replays it), run to its end with
    ``settings``: the harness, the job, and one entry a run."""
    runs: list[int] = []

    async def step(request: Text, ctx: Context) -> Said:
        runs.append(1)
        said = await body(request, ctx)
        if len(runs) == 1:
            raise TransientError("redelivered")
        return Said(said=said)

    h = await custom(one_off(name, step))
    if settings:
        h.settings = h.settings.model_copy(update=settings)
    return h, await run_to_its_end(h, name), runs


async def gathered(
    custom: Any, name: str, branch: Callable[[Context, str], Awaitable[Any]], *tags: str
) -> tuple[Harness, str, Any]:
    """A one-off ``name`` whose step gathers ``branch`` over ``tags`` and
    fails once after the gather, run to its end (done): the harness, the
    job and what the branches said."""

    async def body(request: Text, ctx: Context) -> str:
        return json.dumps(await asyncio.gather(*(branch(ctx, tag) for tag in tags)))

    h, job_id, _ = await replayed(custom, name, body)
    assert await h.status(job_id) == "done"
    return h, job_id, json.loads((await h.get(f"/v1/{name}", job_id))["result"]["said"])


async def test_gathered_branches_each_replay_their_own_answers(custom):
    """Two branches of two model calls each: however they interleave, a
    replay gives each branch the answers to its own prompts, and no call is
    paid for twice."""

    async def branch(ctx: Context, tag: str) -> list[str]:
        a = await ctx.model.complete(f"first call of branch {tag}")
        b = await ctx.model.complete(f"second call of branch {tag}")
        return [a, b]

    h, job_id, said = await gathered(custom, "par", branch, "xray", "yankee")
    assert [[p.split()[0] + p.split()[-1] for p in b] for b in said] == [
        ["firstxray", "secondxray"],
        ["firstyankee", "secondyankee"],
    ]
    assert sorted(k for k, _ in await keys(h, job_id)) == [
        "[1]/model",
        "[1]/model#2",
        "[2]/model",
        "[2]/model#2",
    ]
    assert h.fake.stats().total == 4


async def test_branches_of_a_step_and_a_model_call_replay(custom):
    """Each branch a step then a model call: the replay gives each its own."""

    async def branch(ctx: Context, tag: str) -> str:
        order = await ctx.step("fetch", lambda: f"order {tag}")
        return await ctx.model.complete(f"summarise {order}")

    h, _, said = await gathered(custom, "par2", branch, "a1", "b2")
    assert ["a1" in said[0], "b2" in said[1]] == [True, True]
    assert h.fake.stats().total == 2


async def test_a_model_call_inside_a_step_is_that_steps_own(custom):
    """The inner call is keyed under the step (``enrich/model``): a replay
    that finds the step stored skips it, and the next call gets its own
    answer."""

    async def body(request: Text, ctx: Context) -> str:
        async def enrich() -> str:
            return await ctx.model.complete(f"enrich {request.text}")

        enriched = await ctx.step("enrich", enrich)
        return await ctx.model.complete(f"final {enriched}")

    h, job_id, _ = await replayed(custom, "nested", body)
    assert await h.status(job_id) == "done"
    assert (await h.get("/v1/nested", job_id))["result"]["said"].startswith("final")
    assert [k for k, _ in await keys(h, job_id)] == ["enrich", "enrich/model", "model"]
    assert h.fake.stats().total == 2


async def test_a_model_call_that_timed_out_and_was_caught_is_not_paid_again(custom):
    """The model hangs past its attempts; the step catches the failure and
    goes on. The failed call is a checkpoint: the replay raises it again
    instead of calling the model again."""

    async def body(request: Text, ctx: Context) -> str:
        try:
            return await ctx.model.complete(f"hangs: {request.text} [[fake:hang]]")
        except TransientError:
            return "no answer"

    # Two attempts of a fifth of a second each, well inside the job's budget.
    h, job_id, runs = await replayed(custom, "hung", body, llm_timeout_s=0.2, llm_max_attempts=2)
    assert (await h.get("/v1/hung", job_id))["result"] == {"said": "no answer"}
    assert len(runs) == 2
    assert await keys(h, job_id) == [("model", "failed")]
    calls = h.calls("hangs:")
    assert calls == 2  # both attempts, in the first delivery
    # The replay made none: every call was in the first run's delivery.
    [(spent,)] = await h.rows(
        "SELECT sum(model_calls) FROM job_deliveries WHERE job_id = %s", job_id
    )
    assert spent == calls


async def test_a_failure_the_step_caught_replays_as_it_happened(custom):
    """The lookup fails twice, and the step goes on to try again: the
    failures are kept, so a replay takes the same path and pays for nothing
    again."""
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) <= 2:
            raise PermanentError("404 the order is not there yet")
        return "order"

    async def body(request: Text, ctx: Context) -> str:
        order = None
        for _ in range(3):
            try:
                order = await ctx.step("lookup", flaky)
                break
            except PermanentError:
                continue
        return await ctx.model.complete(f"about {order}")

    h, job_id, runs = await replayed(custom, "caught", body)
    assert await h.status(job_id) == "done"
    assert await keys(h, job_id) == [
        ("lookup", "failed"),
        ("lookup#2", "failed"),
        ("lookup#3", "done"),
        ("model", "done"),
    ]
    assert len(calls) == 3 and len(runs) == 2
    assert h.calls("about") == 1
    [(value,)] = await h.rows(
        "SELECT value FROM checkpoints WHERE job_id = %s AND key = 'lookup'", job_id
    )
    assert json.loads(value) == {
        "error": "PermanentError",
        "message": "404 the order is not there yet",
        "transient": False,
    }


async def test_a_failure_that_ends_the_run_is_not_kept(custom):
    """Not caught, the step's transient failure ends the delivery; the next
    one tries the work again (and it succeeds)."""
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) <= 4:  # the first delivery's four attempts
            raise TransientError("busy")
        return "fine"

    async def step(request: Text, ctx: Context) -> Said:
        return Said(said=await ctx.step("lookup", flaky))

    h = await custom(one_off("ends", step))
    job_id = await run_to_its_end(h, "ends")
    assert await h.status(job_id) == "done"
    assert await keys(h, job_id) == [("lookup", "done")]
    assert len(calls) == 5


async def test_a_key_asked_for_out_of_its_place_is_nondeterministic_at_once(custom):
    """Stored in one order, asked for in another: dead before paying."""
    version = {"n": 1}

    async def step(request: Text, ctx: Context) -> Said:
        if version["n"] == 1:
            await ctx.step("a", lambda: 1)
            await ctx.step("b", lambda: 2)
            raise TransientError("deploy")
        await ctx.step("b", lambda: 2)
        said = await ctx.model.complete("never paid")
        return Said(said=said)

    h = await custom(one_off("order", step))
    worker = h.worker("order", redelivery_base_s=0.01, redelivery_max_s=0.01)
    job_id = await h.submit("/v1/order", {"text": "x"})
    await drain(worker)
    version["n"] = 2
    await redeliver_until(h, worker, "order", lambda: finished(h, job_id))
    assert (await h.get("/v1/order", job_id))["error"] == "nondeterministic"
    assert h.calls("never paid") == 0


async def test_a_wait_inside_a_taskgroup_is_acknowledged(custom):
    async def step(request: Text, ctx: Context) -> Said:
        async with asyncio.TaskGroup() as tg:
            side = tg.create_task(ctx.step("lookup", lambda: "found"))
            approval = tg.create_task(ctx.wait_for_event("approval", Approval, timeout=60))
        return Said(said=f"{side.result()} {approval.result()}")

    h = await custom(one_off("tg", step, events={"approval": Approval}))
    worker = h.worker("tg")
    job_id = await h.submit("/v1/tg", {"text": "x"})
    await drain(worker)
    assert await h.status(job_id) == "waiting"
    assert await pending(h, "tg") == 0
    r = await h.send_event("/v1/tg", job_id, "approval", {"approved": True, "by": "tg"})
    assert r.status_code == 202
    await drain(worker)
    assert await h.status(job_id) == "done"
    assert (await h.get("/v1/tg", job_id))["result"]["said"].startswith("found approved=True")


async def test_an_effect_one_branch_emits_while_another_stores_its_wait_is_sent_once(custom):
    """Against PostgreSQL (tests/test_journal.py has it in process): the
    event is there already, so the wait stores a done checkpoint; while that
    statement waits on a lock the test holds, the other branch emits. That
    effect rides with the result: each effect one outbox row."""
    b_emitted = asyncio.Event()

    async def emits_meanwhile(ctx: Context) -> None:
        await asyncio.sleep(0.3)  # the wait's statement is stuck behind the lock
        ctx.emit("gathered.said", {"job_id": ctx.job_id, "branch": "b"})
        b_emitted.set()

    async def step(request: Text, ctx: Context) -> Said:
        ctx.emit("gathered.early", {"job_id": ctx.job_id})
        approval, _ = await asyncio.gather(
            ctx.wait_for_event("approval", Approval, timeout=60), emits_meanwhile(ctx)
        )
        return Said(said=f"approved={approval.approved}")

    h = await custom(one_off("gathered", step, events={"approval": Approval}))
    worker = h.worker("gathered")
    job_id = await h.submit("/v1/gathered", {"text": "x"})
    r = await h.send_event("/v1/gathered", job_id, "approval", {"approved": True, "by": "b"})
    assert r.status_code == 202
    async with await psycopg.AsyncConnection.connect(h.settings.database_url) as lock:
        await lock.execute("SELECT 1 FROM jobs WHERE job_id = %s FOR UPDATE", (job_id,))
        run = asyncio.create_task(drain(worker))
        await asyncio.wait_for(b_emitted.wait(), 30)
        stuck = await lock.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        assert (await stuck.fetchone()) == (1,), "the wait's statement waited on the lock"
        await lock.rollback()
    await asyncio.wait_for(run, 30)
    assert await h.status(job_id) == "done"
    assert sorted(await h.outbox(job_id)) == ["gathered.early", "gathered.said"]
    [key] = await h.keys(job_id)
    assert key.endswith("approval")


async def test_a_transient_error_inside_a_taskgroup_is_redelivered_not_dead(custom):
    tries: list[int] = []

    async def flaky() -> str:
        tries.append(1)
        if len(tries) <= 4:
            raise TransientError("busy")
        return "y"

    async def step(request: Text, ctx: Context) -> Said:
        async with asyncio.TaskGroup() as tg:
            a = tg.create_task(ctx.step("a", lambda: "x"))
            b = tg.create_task(ctx.step("b", flaky))
        return Said(said=f"{a.result()} {b.result()}")

    h = await custom(one_off("tg2", step))
    worker = h.worker("tg2", redelivery_base_s=0.01, redelivery_max_s=0.01)
    job_id = await h.submit("/v1/tg2", {"text": "x"})
    await drain(worker)
    assert await h.status(job_id) == "queued"  # deferred, not dead
    await redeliver_until(h, worker, "tg2", lambda: finished(h, job_id))
    assert (await h.get("/v1/tg2", job_id))["result"] == {"said": "x y"}


async def test_a_branch_left_running_by_a_failed_gather_keeps_what_it_paid_for(custom):
    runs: list[int] = []

    async def fails() -> None:
        await asyncio.sleep(0.1)
        raise TransientError("the other branch failed")

    async def step(request: Text, ctx: Context) -> Said:
        runs.append(1)
        said, _ = await asyncio.gather(
            ctx.model.complete("slow sibling [[fake:sleep=1]]"),
            ctx.step("other", fails) if len(runs) == 1 else ctx.step("other", lambda: None),
        )
        return Said(said=said)

    h = await custom(one_off("orphan", step))
    job_id = await run_to_its_end(h, "orphan")
    assert await h.status(job_id) == "done"
    assert h.calls("slow sibling") == 1


async def test_a_model_answer_holding_nul_is_kept(custom):
    async def step(request: Text, ctx: Context) -> Said:
        answer = await ctx.model.complete("tell me \x00 something")
        second = await ctx.model.complete("and then")  # the first is written as a row first
        return Said(said=answer.replace("\x00", "") + second)

    h = await custom(one_off("nul", step))
    job_id = await h.submit("/v1/nul", {"text": "x"})
    await drain(h.worker("nul"))
    assert await h.status(job_id) == "done"
    [(value,)] = await h.rows(
        "SELECT value FROM checkpoints WHERE job_id = %s AND key = 'model'", job_id
    )
    assert "\\u0000" in value and "\x00" not in value
    assert json.loads(value).count("\x00") == 1


def test_checkpoint_values_are_json_text_postgresql_can_store():
    from oncely.jobs.rows import json_text

    assert json_text({"a": "ünï \x00"}) == '{"a":"ünï \\u0000"}'
    assert json_text("half \ud800") == '"half \\ud800"'  # escaped: not UTF-8 as it is
    assert json.loads(json_text({"a": "x\x00\ud800"})) == {"a": "x\x00\ud800"}


async def test_a_cancelled_job_rewound_runs_to_its_end(custom):
    """The cancel stays announced in Redis for a day; the rewound run is not
    stopped by it."""

    async def step(request: Text, ctx: Context) -> Said:
        await ctx.step("before", lambda: "kept")
        said = await ctx.model.complete(f"slow: {request.text} [[fake:sleep=1]]")
        return Said(said=said)

    h = await custom(one_off("rewound", step))
    job_id = await h.submit("/v1/rewound", {"text": "cancel then rewind"})
    async with service_running(h.worker("rewound", claim_idle_ms=300)):
        await cancel_mid_call(h, "rewound", job_id)
        await until_async(lambda: pending_is(h, "rewound", 0))
        rewound = await h.checkpoints.rewind(uuid.UUID(job_id), "before")
        assert rewound is not None and rewound.deleted == ("before",)
        await until_async(lambda: finished(h, job_id))
    assert await h.status(job_id) == "done"
    outcomes = await h.rows(
        "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id", job_id
    )
    # The old delivery is reported cancelled, or (when the rewound run
    # finished before it reported, on a busy machine) as a duplicate.
    assert outcomes[0][0] in ("cancelled", "duplicate")
    assert [o[0] for o in outcomes][1:] == ["done"]


async def test_a_stale_cancel_in_redis_does_not_stop_a_running_job(custom, redis):
    """Redis says cancelled, PostgreSQL does not: the worker asks PostgreSQL,
    which has the last word, and the job runs to done once."""

    async def step(request: Text, ctx: Context) -> Said:
        return Said(said=await ctx.model.complete(f"stale: {request.text} [[fake:sleep=0.5]]"))

    h = await custom(one_off("stale", step))
    worker = h.worker("stale", claim_idle_ms=300, redelivery_base_s=0.01, redelivery_max_s=0.01)
    job_id = await h.submit("/v1/stale", {"text": "x"})
    await h.jobs.streams["stale"].announce_cancel(job_id)  # and nothing in PostgreSQL
    running = asyncio.create_task(worker.run())
    try:
        await until_async(lambda: finished(h, job_id))
    finally:
        worker.stop()
        await asyncio.wait_for(running, 10)
    assert await h.status(job_id) == "done"
    assert [p.billed for p in h.fake.stats("stale:").prompts] == [1]
    assert len(await h.rows("SELECT job_id FROM results WHERE job_id = %s", job_id)) == 1
    outcomes = await h.rows("SELECT outcome FROM job_deliveries WHERE job_id = %s", job_id)
    assert outcomes[-1] == ("done",)


async def test_lease_renewal_survives_a_cancel_heard_after_the_handler_returned(custom):
    async def step(request: Text, ctx: Context) -> Said:
        return Said(said=await ctx.model.complete("quick"))

    h = await custom(one_off("quick", step))
    worker = h.worker("quick", claim_idle_ms=300)
    job_id = await h.submit("/v1/quick", {"text": "cancelled before it runs"})
    found = await h.checkpoints.cancel(uuid.UUID(job_id))
    assert found is not None and found.status == "queued"
    ack_batch = worker._ack_batch

    async def slow_ack(deliveries: Any) -> Any:
        await asyncio.sleep(0.5)  # acknowledging while renewals go round
        return await ack_batch(deliveries)

    worker._ack = type(worker._ack)(slow_ack, key=lambda d: d.entry_id)
    running = asyncio.create_task(worker.run())
    try:
        await until_async(lambda: pending_is(h, "quick", 0))
        await asyncio.sleep(0.5)  # more renewals
        assert not running.done(), "the worker stopped"
    finally:
        worker.stop()
        await asyncio.wait_for(running, 10)
    # The cancelled job ran nothing and wrote nothing.
    assert await h.status(job_id) == "cancelled"
    assert h.calls("quick") == 0
    assert await h.rows("SELECT job_id FROM results WHERE job_id = %s", job_id) == []
    assert await h.rows("SELECT id FROM outbox WHERE job_id = %s", job_id) == []


async def test_a_bug_in_the_step_is_logged_with_its_type_and_frames_never_its_message(custom):
    """A step that raises NameError: the job is dead with the message in its
    record, and the log says which exception and where, without the message
    (it may hold the request's data)."""

    async def step(request: Text, ctx: Context) -> Said:
        return Said(said=undefined_policy[request.text])  # type: ignore[name-defined]  # noqa: F821

    h = await custom(one_off("buggy", step))
    worker = h.worker("buggy")
    job_id = await h.submit("/v1/buggy", {"text": "secret-order-4711"})
    with capture_logs() as logs:
        await redeliver_until(h, worker, "buggy", lambda: finished(h, job_id))
    assert await h.status(job_id) == "dead"
    [(error,)] = await h.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert "undefined_policy" in error  # the record keeps the message

    [raised] = [e for e in logs if e["event"] == "job.unclassified_error"]
    assert raised["error_type"] == "NameError"
    assert raised["frames"][-1].startswith("tests/test_durable_replays.py:")
    assert raised["frames"][-1].endswith(" in step")
    [dead] = [e for e in logs if e["event"] == "job.dead_lettered"]
    assert dead["error"] == "NameError"
    logged = json.dumps(logs, default=str)
    assert "undefined_policy" not in logged
    assert "secret-order-4711" not in logged


async def test_a_stale_delivery_failing_never_kills_the_rewound_run(custom):
    """A delivery fails for good after its job was cancelled and rewound
    under it: the new run (a new generation) stays queued and ends done."""
    runs: list[int] = []

    async def step(request: Text, ctx: Context) -> Said:
        await ctx.step("before", lambda: "kept")
        await ctx.step("after", lambda: "stored with it")  # "before" is stored now
        runs.append(1)
        if len(runs) == 1:
            # Meanwhile an operator cancels the job and rewinds it.
            job = uuid.UUID(ctx.job_id)
            assert await h.checkpoints.cancel(job) is not None
            rewound = await h.checkpoints.rewind(job, "before")
            assert rewound is not None and rewound.deleted
            raise PermanentError("the stale run's own failure")
        return Said(said="second run")

    h = await custom(one_off("stale_dead", step))
    worker = h.worker("stale_dead", redelivery_base_s=0.01, redelivery_max_s=0.01)
    job_id = await h.submit("/v1/stale_dead", {"text": "x"})
    await drain(worker)
    [(status, generation)] = await h.rows(
        "SELECT status, generation FROM jobs WHERE job_id = %s", job_id
    )
    assert (status, generation) == ("queued", 1)  # the stale failure killed nothing
    await redeliver_until(h, worker, "stale_dead", lambda: finished(h, job_id))
    assert await h.status(job_id) == "done"
    assert (await h.get("/v1/stale_dead", job_id))["result"] == {"said": "second run"}
    assert len(runs) == 2
