"""Multi-step workflows in process: checkpoints, replays, races, effects with
the next checkpoint, waits for events, sleeps, cancellation and rewinds, on
real Redis and PostgreSQL with the fake model behind the real adapter.

Every test counts what happened: model calls at the fake, side calls in
their file, checkpoint and outbox rows, stream entries.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from oncely import Context, TransientError
from oncely.api.auth import create_api_key
from oncely.jobs.checkpoints import Checkpoints
from oncely.jobs.store import Jobs
from oncely.jobs.timers import Timers
from oncely.queue.worker import Worker
from tests.durable import (
    Harness,
    Said,
    Text,
    cancel_mid_call,
    drain,
    entry_of,
    one_off,
    pending,
    pending_is,
    redeliver_until,
    until,
    until_async,
    wait_until_due,
)
from tests.helpers import asgi_app, count, service_running
from tests.steps_app import side_calls


async def test_four_checkpoints_run_once_each_and_the_job_shows_them(harness: Harness):
    job_id = await harness.submit("/v1/chain", {"text": "sku-1 two lamps. Blue ones."})
    await drain(harness.worker("chain"))

    assert await harness.keys(job_id) == ["model", "lookup", "model#2", "model#3"]
    # The last one rides in the result's statement, kept in its row.
    assert await harness.rows_kept(job_id) == ["model", "lookup", "model#2"]
    assert await harness.outbox(job_id) == ["order.fulfilled"]
    assert len(side_calls(harness.side_file, "lookup")) == 1
    for prompt in ("classify:", "draft:", "final:"):
        assert harness.calls(prompt) == 1
    job = await harness.get("/v1/chain", job_id)
    assert job["status"] == "done"
    assert [(s["key"], s["kind"], s["status"]) for s in job["steps"]] == [
        ("model", "model", "done"),
        ("lookup", "step", "done"),
        ("model#2", "model", "done"),
        ("model#3", "model", "done"),
    ]
    # Usage sums every model checkpoint; a side step has none.
    assert job["usage"]["model_calls"] == 3
    assert job["steps"][1]["usage"] is None
    assert (
        sum(s["usage"]["prompt_tokens"] for s in job["steps"] if s["usage"])
        == (job["usage"]["prompt_tokens"])
    )
    assert job["waiting"] is None


async def test_a_failed_delivery_keeps_what_it_paid_for(harness: Harness):
    """The last model call fails past its retries: the redelivery replays
    the first three checkpoints from storage and pays only for the last."""
    worker = harness.worker("chain", redelivery_base_s=0.01, redelivery_max_s=0.01)
    body = {"text": "sku-2 a chair", "hold": "[[fake:503*4]]"}
    job_id = await harness.submit("/v1/chain", body)

    async def done() -> bool:
        return await harness.status(job_id) == "done"

    await redeliver_until(harness, worker, "chain", done)
    assert harness.calls("classify:") == 1
    assert harness.calls("draft:") == 1
    assert len(side_calls(harness.side_file, "lookup")) == 1
    assert harness.calls("final:") == 5  # four 503s in the first delivery, then the answer
    assert await harness.outbox(job_id) == ["order.fulfilled"]
    deliveries = await harness.rows(
        "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id", job_id
    )
    assert [d[0] for d in deliveries] == ["retry", "done"]


async def test_a_model_answer_is_kept_when_the_step_fails_right_after(custom):
    """No checkpoint follows the call before the failure: it is written as
    the delivery fails, so the redelivery does not pay for it again."""
    failed: list[str] = []

    async def step(request: Text, ctx: Context) -> Said:
        said = await ctx.model.complete(f"kept: {request.text}")
        if not failed:
            failed.append(ctx.job_id)
            raise TransientError("the step broke after the call")
        return Said(said=said)

    h = await custom(one_off("keeper", step))
    worker = h.worker("keeper", redelivery_base_s=0.01, redelivery_max_s=0.01)
    job_id = await h.submit("/v1/keeper", {"text": "answer once"})

    async def done() -> bool:
        return await h.status(job_id) == "done"

    await redeliver_until(h, worker, "keeper", done)
    assert failed == [job_id]
    assert h.calls("kept:") == 1
    assert await h.keys(job_id) == ["model"]


async def test_effects_exist_only_with_the_checkpoint_after_them(custom):
    """An emit is written with the next checkpoint: the one before a stored
    checkpoint survives a failure; the one after the last checkpoint does
    not, and the replay writes each once."""
    runs: list[int] = []

    async def step(request: Text, ctx: Context) -> Said:
        runs.append(ctx.delivery)
        ctx.emit("emitter.early", {"job_id": ctx.job_id})
        said = await ctx.step("lookup", lambda: request.text.upper())
        ctx.emit("emitter.said", {"job_id": ctx.job_id})
        if len(runs) == 1:
            raise TransientError("after the emit, before any checkpoint")
        return Said(said=said)

    h = await custom(one_off("emitter", step))
    worker = h.worker("emitter", redelivery_base_s=0.01, redelivery_max_s=0.01)
    job_id = await h.submit("/v1/emitter", {"text": "emit me"})
    await drain(worker)
    assert runs == [1]
    # The early effect came with the lookup, which the failure kept.
    assert await h.keys(job_id) == ["lookup"]
    assert await h.outbox(job_id) == ["emitter.early"]

    async def done() -> bool:
        return await h.status(job_id) == "done"

    await redeliver_until(h, worker, "emitter", done)
    assert await h.outbox(job_id) == ["emitter.early", "emitter.said"]


async def stored_pick(h: Harness, job_id: str) -> bool:
    return bool(
        await h.rows("SELECT 1 FROM checkpoints WHERE job_id = %s AND key = 'pick'", job_id)
    )


async def test_two_deliveries_racing_on_one_checkpoint_store_one_value(custom):
    """Both run the side call; the first writer's value is the one stored,
    the other replays over it; one result, each effect once."""
    both_in = asyncio.Barrier(2)
    values = iter(["first", "second"])

    async def side() -> str:
        value = next(values)
        await both_in.wait()
        if value == "second":
            # The other one writes first: wait for its row.
            await until_async(lambda: stored_pick(h, job_id))
        return value

    async def step(request: Text, ctx: Context) -> Said:
        value = await ctx.step("pick", side)
        ctx.emit("racer.said", {"job_id": ctx.job_id, "value": value})
        said = await ctx.model.complete(f"race: {value}")
        return Said(said=f"{value}: {said}")

    h = await custom(one_off("racer", step))
    job_id = await h.submit("/v1/racer", {"text": "race"})
    message = await h.jobs.streams["racer"].read_new("c0", 1, 10)
    fields = message[0][1]
    from oncely.queue.stream import JobMessage
    from oncely.queue.worker import Delivery

    handler = h.worker("racer").handler
    outcomes = await asyncio.gather(
        handler(JobMessage.from_fields(fields), Delivery(message[0][0], fields, 1, consumer="a")),
        handler(JobMessage.from_fields(fields), Delivery(message[0][0], fields, 2, consumer="b")),
    )
    # The loser found the job done: when it wrote its checkpoint, or at its finish.
    assert sorted(outcomes) in (["done", "duplicate"], ["done", "stopped"])
    rows = await h.rows("SELECT value FROM checkpoints WHERE job_id = %s AND key = 'pick'", job_id)
    assert rows == [('"first"',)]  # JSON text
    result = await h.get("/v1/racer", job_id)
    assert result["result"]["said"].startswith("first: ")
    assert await h.outbox(job_id) == ["racer.said"]
    payload = await h.rows("SELECT payload FROM outbox WHERE job_id = %s", job_id)
    assert payload[0][0]["value"] == "first"
    # The loser replayed over the stored value: it never asked about "second".
    assert h.calls("race: second") == 0


async def test_a_changed_step_shape_is_dead_as_nondeterministic(custom, redis):
    """Checkpoints stored by one version of the step, replayed by another
    that reaches them in another order: the job is dead, and says both keys."""
    version = {"n": 1}

    async def step(request: Text, ctx: Context) -> Said:
        if version["n"] == 1:
            await ctx.step("lookup", lambda: "found")
            raise TransientError("deploy happens now")
        said = await ctx.model.complete(f"v2: {request.text}")  # a model call first now
        await ctx.step("lookup", lambda: "found")
        return Said(said=said)

    from prometheus_client import REGISTRY

    def nondeterministic() -> float:
        found = REGISTRY.get_sample_value(
            "oncely_jobs_nondeterministic_total", {"workflow": "shape"}
        )
        return found or 0.0

    before = nondeterministic()
    h = await custom(one_off("shape", step))
    worker = h.worker("shape", redelivery_base_s=0.01, redelivery_max_s=0.01)
    job_id = await h.submit("/v1/shape", {"text": "changed"})
    await drain(worker)
    assert await h.keys(job_id) == ["lookup"]
    version["n"] = 2

    async def dead() -> bool:
        return await h.status(job_id) == "dead"

    await redeliver_until(h, worker, "shape", dead)
    job = await h.get("/v1/shape", job_id)
    assert job["error"] == "nondeterministic"
    [(error,)] = await h.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert error.startswith("nondeterministic:")
    assert "'model'" in error and "'lookup'" in error
    assert h.calls("v2:") == 0  # caught before paying for the call
    dead_letters = await h.jobs.streams["shape"].dead_letters()
    assert [d.reason for d in dead_letters] == ["nondeterministic"]
    assert nondeterministic() == before + 1


# -- waiting for events ------------------------------------------------------------


async def test_a_waiting_job_holds_no_slot_and_the_event_resumes_it(harness: Harness):
    """With one slot, another job runs while the first waits; the event
    enqueues the first again and it finishes with it."""
    approvals = harness.worker("approvals", concurrency=1)
    waiting = await harness.submit("/v1/approvals", {"text": "refund 40 EUR"})
    await drain(approvals)

    assert await harness.status(waiting) == "waiting"
    assert await pending(harness, "approvals") == 0
    assert await entry_of(harness, "approvals", waiting) is None
    assert approvals.stats["acked"] == 1
    job = await harness.get("/v1/approvals", waiting)
    assert job["status"] == "waiting"
    assert job["waiting"]["event"] == "approval"
    assert [(s["key"], s["status"]) for s in job["steps"]] == [
        ("model", "done"),
        ("approval", "waiting"),
    ]
    assert await harness.outbox(waiting) == ["order.approval_requested"]

    # The one slot is free: the same worker takes the next job meanwhile.
    other = await harness.submit("/v1/approvals", {"text": "refund 12 EUR meanwhile"})
    await drain(approvals)
    assert await harness.status(other) == "waiting"
    assert harness.calls("review: refund 12 EUR") == 1
    assert await harness.status(waiting) == "waiting"

    r = await harness.send_event(
        "/v1/approvals", waiting, "approval", {"approved": True, "by": "ada"}
    )
    assert r.status_code == 202, r.text
    assert r.json() == {"job_id": waiting, "event": "approval", "status": "received"}
    assert await entry_of(harness, "approvals", waiting) is not None  # enqueued again
    await drain(approvals)
    job = await harness.get("/v1/approvals", waiting)
    assert job["status"] == "done"
    [(review,)] = await harness.rows(
        "SELECT value FROM checkpoints WHERE job_id = %s AND key = 'model'", waiting
    )
    assert job["result"] == {"review": json.loads(review), "approved": True, "by": "ada"}
    assert await harness.outbox(waiting) == ["order.approval_requested", "order.decided"]
    assert harness.calls("review: refund 40 EUR") == 1
    outcomes = await harness.rows(
        "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id", waiting
    )
    assert [o[0] for o in outcomes] == ["waiting", "done"]


async def test_the_event_route_keeps_the_idempotency_contract(harness: Harness, pool):
    job_id = await harness.submit("/v1/approvals", {"text": "needs a yes"})
    await drain(harness.worker("approvals"))
    route, key = "/v1/approvals", "event-key-0000001"

    # A body that fails the event's model: 422, and no key claimed.
    bad = await harness.send_event(route, job_id, "approval", {"approved": "maybe"}, key=key)
    assert bad.status_code == 422
    assert bad.json()["type"].endswith("/validation")

    first = await harness.send_event(
        route, job_id, "approval", {"approved": False, "by": "bob"}, key=key
    )
    assert first.status_code == 202
    again = await harness.send_event(
        route, job_id, "approval", {"by": "bob", "approved": False}, key=key
    )
    assert again.status_code == 202
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content

    # The same key with another body: reused.
    reused = await harness.send_event(
        route, job_id, "approval", {"approved": True, "by": "bob"}, key=key
    )
    assert reused.status_code == 422
    assert reused.json()["type"].endswith("/idempotency-key-reused")
    # Another event of that name (another key): refused; the same one: fine.
    conflict = await harness.send_event(route, job_id, "approval", {"approved": True, "by": "x"})
    assert conflict.status_code == 409
    assert conflict.json()["type"].endswith("/event-already-received")
    same = await harness.send_event(route, job_id, "approval", {"approved": False, "by": "bob"})
    assert same.status_code == 202

    # Unknown event, unknown job, another tenant's job: 404, never 403.
    assert (await harness.send_event(route, job_id, "refusal", {})).status_code == 404
    missing = await harness.send_event(
        route, str(uuid.uuid4()), "approval", {"approved": True, "by": "x"}
    )
    assert missing.status_code == 404
    assert (
        await harness.send_event(route, "nope", "approval", {"approved": True, "by": "x"})
    ).status_code == 404
    other_key = await create_api_key(pool, "globex")
    foreign = await harness.api.post(
        f"{route}/{job_id}/events/approval",
        json={"approved": True, "by": "mallory"},
        headers={"Authorization": f"Bearer {other_key}", "Idempotency-Key": "globex-event-000001"},
    )
    assert foreign.status_code == 404
    # One event stored, and it is bob's.
    events = await harness.rows("SELECT name, payload FROM job_events WHERE job_id = %s", job_id)
    assert events == [("approval", {"approved": False, "by": "bob"})]

    await drain(harness.worker("approvals"))
    assert (await harness.get(route, job_id))["result"]["by"] == "bob"
    # The job is done: an event it never received is too late.
    late = await harness.api.post(f"{route}/{job_id}/cancel", headers=harness.auth)
    assert late.status_code == 409
    assert late.json()["type"].endswith("/job-finished")
    assert late.json()["job_status"] == "done"


async def test_an_event_that_arrives_before_the_wait_is_kept_for_it(harness: Harness):
    job_id = await harness.submit("/v1/approvals", {"text": "quick yes"})
    r = await harness.send_event(
        "/v1/approvals", job_id, "approval", {"approved": True, "by": "early"}
    )
    assert r.status_code == 202
    assert await harness.status(job_id) == "queued"  # nothing to resume yet
    await drain(harness.worker("approvals"))
    job = await harness.get("/v1/approvals", job_id)
    assert job["status"] == "done"
    assert job["result"]["by"] == "early"
    outcomes = await harness.rows("SELECT outcome FROM job_deliveries WHERE job_id = %s", job_id)
    assert [o[0] for o in outcomes] == ["done"]  # it never waited
    assert await harness.outbox(job_id) == ["order.approval_requested", "order.decided"]


async def test_a_wait_that_times_out_resumes_with_none(harness: Harness):
    job_id = await harness.submit("/v1/approvals", {"text": "nobody answers", "wait_s": 0.3})
    worker = harness.worker("approvals")
    await drain(worker)
    timers = Timers(harness.checkpoints)
    assert await harness.status(job_id) == "waiting"
    assert await timers.run_once() == 0  # not due yet
    await wait_until_due(harness, job_id)
    assert await timers.run_once() == 1
    await drain(worker)
    job = await harness.get("/v1/approvals", job_id)
    assert job["status"] == "done"
    assert job["result"]["approved"] is None
    assert await harness.outbox(job_id) == ["order.approval_requested", "order.decided"]
    decided = await harness.rows(
        "SELECT payload FROM outbox WHERE job_id = %s AND topic = 'order.decided'", job_id
    )
    assert decided[0][0]["approved"] is None
    assert harness.calls("review:") == 1
    # Late: the event is kept, the job is done.
    late = await harness.send_event(
        "/v1/approvals", job_id, "approval", {"approved": True, "by": "late"}
    )
    assert late.status_code == 409
    assert late.json()["job_status"] == "done"


# -- sleeping ----------------------------------------------------------------------


async def test_a_sleep_holds_nothing_and_resumes_after_its_time(harness: Harness):
    job_id = await harness.submit("/v1/naps", {"text": "zz-1 rest", "sleep_s": 0.3})
    worker = harness.worker("naps")
    await drain(worker)
    job = await harness.get("/v1/naps", job_id)
    assert job["status"] == "waiting"
    assert job["waiting"]["event"] is None
    assert await pending(harness, "naps") == 0
    await wait_until_due(harness, job_id)
    assert await Timers(harness.checkpoints).run_once() == 1
    await drain(worker)
    assert await harness.status(job_id) == "done"
    assert await harness.keys(job_id) == ["note", "sleep", "model"]
    assert len(side_calls(harness.side_file, "lookup")) == 1
    assert harness.calls("after the nap:") == 1
    assert await harness.outbox(job_id) == ["order.rested"]


async def test_waiting_jobs_resume_after_redis_lost_its_data(harness: Harness, redis):
    """PostgreSQL holds the timers: Redis losing everything changes nothing."""
    jobs = [
        await harness.submit("/v1/naps", {"text": f"zz-{n} lost", "sleep_s": 0.3}) for n in range(3)
    ]
    worker = harness.worker("naps")
    await drain(worker)
    assert {await harness.status(j) for j in jobs} == {"waiting"}
    await redis.flushdb()
    for stream in harness.jobs.streams.values():
        await stream.ensure_group()
    for job_id in jobs:
        await wait_until_due(harness, job_id)
    assert await Timers(harness.checkpoints).run_once() == 3
    await drain(worker)
    assert {await harness.status(j) for j in jobs} == {"done"}
    assert harness.calls("after the nap:") == 3


# -- cancelling ---------------------------------------------------------------------


async def test_a_cancelled_waiting_job_never_resumes(harness: Harness):
    job_id = await harness.submit("/v1/approvals", {"text": "cancel me", "wait_s": 0.3})
    await drain(harness.worker("approvals"))
    cancel = f"/v1/approvals/{job_id}/cancel"
    first = await harness.api.post(cancel, headers=harness.auth)
    assert first.status_code == 202
    assert first.json() == {"job_id": job_id, "status": "cancelled"}
    again = await harness.api.post(cancel, headers=harness.auth)
    assert (again.status_code, again.json()) == (202, first.json())
    job = await harness.get("/v1/approvals", job_id)
    assert (job["status"], job["waiting"]) == ("cancelled", None)

    event = await harness.send_event(
        "/v1/approvals", job_id, "approval", {"approved": True, "by": "too late"}
    )
    assert event.status_code == 409
    assert event.json()["job_status"] == "cancelled"
    # Its wait's time is past (rewound in the database): nothing resumes it.
    await harness.rows(
        "UPDATE jobs SET wait_until = now() - interval '1 second' WHERE job_id = %s"
        " RETURNING job_id",
        job_id,
    )
    assert await Timers(harness.checkpoints).run_once() == 0
    assert await entry_of(harness, "approvals", job_id) is None
    assert await harness.outbox(job_id) == ["order.approval_requested"]
    assert (
        await harness.api.post(f"/v1/approvals/{uuid.uuid4()}/cancel", headers=harness.auth)
    ).status_code == 404


async def test_cancel_stops_a_running_model_call_and_writes_nothing_after(custom, harness: Harness):
    async def step(request: Text, ctx: Context) -> Said:
        await ctx.step("before", lambda: "kept")
        said = await ctx.model.complete(f"slow: {request.text} [[fake:sleep=30]]")
        ctx.emit("slowpoke.said", {"job_id": ctx.job_id})
        return Said(said=said)

    h = await custom(one_off("slowpoke", step))
    job_id = await h.submit("/v1/slowpoke", {"text": "cancel mid-call"})
    # Leases renewed every 0.1 s: the cancel is heard within that.
    async with service_running(h.worker("slowpoke", claim_idle_ms=300)):
        await cancel_mid_call(h, "slowpoke", job_id)
        await until(lambda: h.fake.stats().abandoned == 1)
        await until_async(lambda: pending_is(h, "slowpoke", 0))
    assert h.fake.stats().in_flight == 0
    assert await h.status(job_id) == "cancelled"
    assert await h.keys(job_id) == ["before"]  # nothing after the cancel
    assert await h.outbox(job_id) == []
    assert await count(h.pool, "SELECT count(*) FROM results WHERE job_id = %s", job_id) == 0
    outcomes = await h.rows("SELECT outcome FROM job_deliveries WHERE job_id = %s", job_id)
    assert [o[0] for o in outcomes] == ["cancelled"]


# -- rewinding ----------------------------------------------------------------------


async def test_rewind_reruns_from_a_checkpoint_without_repeating_sent_effects(
    harness: Harness,
):
    job_id = await harness.submit("/v1/approvals", {"text": "rewind me"})
    worker = harness.worker("approvals")
    await drain(worker)
    await harness.checkpoints.cancel(uuid.UUID(job_id))
    rewound = await harness.checkpoints.rewind(uuid.UUID(job_id), "model")
    assert rewound is not None
    assert (rewound.status, rewound.deleted) == ("cancelled", ("model", "approval"))
    assert await harness.status(job_id) == "queued"
    await drain(worker)  # runs again from the top: a new review, the same request
    assert await harness.status(job_id) == "waiting"
    assert harness.calls("review:") == 2
    assert await harness.outbox(job_id) == ["order.approval_requested"]  # once
    r = await harness.send_event("/v1/approvals", job_id, "approval", {"approved": True, "by": "z"})
    assert r.status_code == 202
    await drain(worker)
    assert await harness.status(job_id) == "done"
    assert await harness.outbox(job_id) == ["order.approval_requested", "order.decided"]
    [(generation,)] = await harness.rows("SELECT generation FROM jobs WHERE job_id = %s", job_id)
    assert generation == 1
    # Only dead or cancelled jobs rewind; an unknown key changes nothing.
    done = await harness.checkpoints.rewind(uuid.UUID(job_id), "model")
    assert done is not None and (done.status, done.deleted) == ("done", ())


async def test_a_delivery_of_an_earlier_generation_writes_nothing(harness: Harness):
    """A run that loaded generation 0 cannot write after a rewind began
    generation 1, though the job runs (queued) again."""
    from oncely.journal import NewCheckpoint, RunStopped, Writes

    def lookup(ordinal: int, found: str) -> Writes:
        return Writes((NewCheckpoint("lookup", ordinal, "step", {"found": found}, None),))

    job_id = await harness.submit("/v1/chain", {"text": "sku-3 stale"})
    await harness.checkpoints.write("chain", job_id, 0, lookup(1, "first"))
    await harness.checkpoints.cancel(uuid.UUID(job_id))
    rewound = await harness.checkpoints.rewind(uuid.UUID(job_id), "lookup")
    assert rewound is not None and rewound.deleted == ("lookup",)
    run = await harness.checkpoints.run_of(job_id)
    assert run is not None and (run.status, run.generation) == ("queued", 1)

    # The old run's delivery: refused, though the job is queued.
    with pytest.raises(RunStopped):
        await harness.checkpoints.write("chain", job_id, 0, lookup(1, "stale"))
    assert await harness.jobs.finish("chain", job_id, {"kind": "x"}, None, generation=0) is False
    assert await harness.keys(job_id) == []
    assert await harness.status(job_id) == "queued"
    assert await harness.rows("SELECT job_id FROM results WHERE job_id = %s", job_id) == []
    # The new generation's writes land.
    await harness.checkpoints.write("chain", job_id, 1, lookup(1, "fresh"))
    assert await harness.keys(job_id) == ["lookup"]


# -- operators ----------------------------------------------------------------------


async def test_the_console_shows_checkpoints_and_what_a_job_waits_for(harness: Harness, redis):
    from pydantic import SecretStr

    key = "operator-key-for-tests-only-7f3a"
    settings = harness.settings.model_copy(update={"console_key": SecretStr(key)})
    app = asgi_app(settings, redis, harness.pool, harness.app)
    transport = httpx.ASGITransport(app=app)
    text = "<script>alert(1)</script> refund"
    job_id = await harness.submit("/v1/approvals", {"text": text})
    await drain(harness.worker("approvals"))
    async with httpx.AsyncClient(transport=transport, base_url="http://oncely.test") as console:
        assert (await console.post("/console/login", data={"key": key})).status_code == 303
        page = await console.get(f"/console/workflows/approvals/jobs/{job_id}")
    assert page.status_code == 200
    assert 'id="waiting">event &#39;approval&#39;, until' in page.text
    rows = re.findall(
        r'<tr class="checkpoint status-(\w+)"><td>(\d+)</td><td class="id">([^<]+)', page.text
    )
    assert rows == [("done", "1", "model"), ("waiting", "2", "approval")]
    assert "<script>alert(1)</script>" not in page.text
    assert "&lt;script&gt;" in page.text  # the model's answer quotes the request, escaped


async def test_a_shadow_run_gets_the_primarys_event_skips_sleeps_and_keeps_nothing(
    harness: Harness, redis
):
    """A shadow variant runs the whole multi-step function again: no
    checkpoints of its own, the primary's event for its wait, no sleeping."""
    from oncely.bootstrap import Resources, WorkerGroup

    settings = harness.settings.model_copy(
        update={"shadow": "approvals=oncely-fake-v2:1,naps=oncely-fake-v2:1"}
    )
    group = WorkerGroup(harness.app, Resources(settings, redis, harness.pool), harness.llm)
    for loop in group.loops:
        await loop.stream.ensure_group()

    def loop(label: str) -> Worker:
        return next(w for w in group.loops if w.workflow == label)

    waited = await harness.submit("/v1/approvals", {"text": "shadow me"})
    slept = await harness.submit("/v1/naps", {"text": "zz-5 shadow", "sleep_s": 0.2})
    await drain(loop("approvals"))
    await drain(loop("naps"))
    r = await harness.send_event(
        "/v1/approvals", waited, "approval", {"approved": False, "by": "cy"}
    )
    assert r.status_code == 202
    await drain(loop("approvals"))
    await wait_until_due(harness, slept)
    assert await group.timers.run_once() == 1
    await drain(loop("naps"))
    assert {await harness.status(waited), await harness.status(slept)} == {"done"}
    checkpoints_before = await count(harness.pool, "SELECT count(*) FROM checkpoints")

    await drain(loop("approvals:shadow:oncely-fake-v2"))
    await drain(loop("naps:shadow:oncely-fake-v2"))
    rows = await harness.rows(
        "SELECT job_id::text, result, emitted, error FROM shadow_results ORDER BY workflow"
    )
    results = {job_id: (result, emitted, error) for job_id, result, emitted, error in rows}
    result, emitted, error = results[waited]
    assert error is None
    assert (result["approved"], result["by"]) == (False, "cy")  # the primary's event
    assert [e["topic"] for e in emitted] == ["order.approval_requested", "order.decided"]
    assert results[slept][2] is None and results[slept][0]["before"] == "zz-5"
    # Nothing of the shadows' in the job's tables; their model calls are their own.
    assert await count(harness.pool, "SELECT count(*) FROM checkpoints") == checkpoints_before
    assert await harness.outbox(waited) == ["order.approval_requested", "order.decided"]
    assert harness.fake.stats().models["oncely-fake-v2"] == 2


async def test_retention_deletes_cancelled_jobs_with_their_checkpoints_and_events(
    harness: Harness,
):
    from oncely.jobs.retention import Retention

    old = await harness.submit("/v1/approvals", {"text": "old and cancelled"})
    recent = await harness.submit("/v1/approvals", {"text": "recent and cancelled"})
    await drain(harness.worker("approvals"))
    for job_id in (old, recent):
        r = await harness.send_event(
            "/v1/approvals", job_id, "approval", {"approved": True, "by": "x"}
        )
        assert r.status_code == 202
    await drain(harness.worker("approvals"))
    for job_id in (old, recent):
        await harness.checkpoints.cancel(uuid.UUID(job_id))  # done: stays done
    waiting = await harness.submit("/v1/approvals", {"text": "waits, then cancelled"})
    await drain(harness.worker("approvals"))
    await harness.checkpoints.cancel(uuid.UUID(waiting))
    async with harness.pool.connection() as conn:
        await conn.execute(
            "UPDATE jobs SET updated_at = now() - interval '40 days' WHERE job_id IN (%s, %s)",
            (old, waiting),
        )
        await conn.execute("UPDATE outbox SET sent_at = now()")
    purged = await Retention(harness.jobs, retention_s=30 * 86400.0).run_once()
    assert purged == 2
    left = await harness.rows("SELECT DISTINCT job_id::text FROM checkpoints")
    assert left == [(recent,)]
    assert await harness.rows("SELECT job_id::text FROM job_events") == [(recent,)]


async def test_a_jobs_age_counts_from_its_last_resume(harness: Harness):
    """The job is older than ONCELY_JOB_MAX_AGE_S when it resumes from a
    sleep; a transient failure then is redelivered, not dead."""
    worker = harness.worker(
        "naps", job_max_age_s=1.0, redelivery_base_s=0.01, redelivery_max_s=0.01
    )
    job_id = await harness.submit("/v1/naps", {"text": "zz-6 old [[fake:503*4]]", "sleep_s": 1.5})
    await drain(worker)
    assert await harness.status(job_id) == "waiting"
    await wait_until_due(harness, job_id)
    assert await Timers(harness.checkpoints).run_once() == 1

    async def done() -> bool:
        return await harness.status(job_id) in ("done", "dead")

    await redeliver_until(harness, worker, "naps", done)
    assert await harness.status(job_id) == "done"
    outcomes = await harness.rows(
        "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id", job_id
    )
    assert [o[0] for o in outcomes] == ["waiting", "retry", "done"]


async def test_a_side_step_is_retried_in_process_and_a_bug_kills_the_job(custom):
    """Errors that can succeed later are retried within the delivery; a
    PermanentError, an unknown error or a value that is not JSON kill the job
    at once, storing nothing for that step."""
    tries: list[str] = []

    async def flaky() -> dict[str, int]:
        tries.append("flaky")
        if len(tries) < 3:
            raise TransientError("the service is busy")
        return {"n": len(tries)}

    async def step(request: Text, ctx: Context) -> Said:
        got = await ctx.step("flaky", flaky)
        if request.text == "bug":
            await ctx.step("broken", lambda: {}["missing"])
        if request.text == "not json":
            await ctx.step("opaque", lambda: object())
        return Said(said=str(got["n"]))

    h = await custom(one_off("sidestep", step))
    worker = h.worker("sidestep")
    fine = await h.submit("/v1/sidestep", {"text": "fine"})
    await drain(worker)
    assert await h.status(fine) == "done"
    assert (await h.get("/v1/sidestep", fine))["result"] == {"said": "3"}
    assert len(tries) == 3  # two transient failures, retried in one delivery

    for text, error in (("bug", "KeyError"), ("not json", "not JSON")):
        tries.clear()
        job_id = await h.submit("/v1/sidestep", {"text": text})
        await drain(worker)
        assert await h.status(job_id) == "dead"
        [(message,)] = await h.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
        assert message.startswith("permanent:") and error in message
        assert await h.keys(job_id) == ["flaky"]  # what it reached before, kept


class Crash(BaseException):
    """Stands for kill -9: nothing after it runs, nothing is cleaned up."""


async def test_an_entry_left_pending_before_a_wait_is_dropped_once_the_job_resumed(
    harness: Harness,
):
    """The worker dies after the wait committed, before acknowledging; the
    event enqueues the job again. The stale entry, reclaimed later, is
    acknowledged without running: the job runs once, not twice at once."""
    approvals = harness.worker("approvals")
    handler = approvals.handler

    async def wait_then_die(message: Any, delivery: Any) -> str:
        await handler(message, delivery)
        raise Crash

    approvals.handler = wait_then_die
    job_id = await harness.submit("/v1/approvals", {"text": "stale entry"})
    await approvals.run_once()
    with pytest.raises(Crash):
        await asyncio.gather(*approvals._tasks.values())
    assert await harness.status(job_id) == "waiting"
    assert await pending(harness, "approvals") == 1  # never acknowledged
    r = await harness.send_event("/v1/approvals", job_id, "approval", {"approved": True, "by": "x"})
    assert r.status_code == 202

    other = harness.worker("approvals", claim_idle_ms=0)
    with capture_logs() as logs:
        await drain(other, rounds=3)
    assert await harness.status(job_id) == "done"
    assert await pending(harness, "approvals") == 0
    [dropped] = [e for e in logs if e["event"] == "job.superseded_entry_dropped"]
    assert dropped["job_id"] == job_id
    # The new message ran (its first delivery), not the stale one (its second).
    outcomes = await harness.rows(
        "SELECT outcome, delivery FROM job_deliveries WHERE job_id = %s ORDER BY id", job_id
    )
    assert outcomes == [("waiting", 1), ("done", 1)]
    assert harness.calls("review:") == 1


async def test_metrics_count_checkpoints_replays_and_waiting_jobs(harness: Harness, redis):
    from prometheus_client import REGISTRY

    from oncely.health import HealthConfig, HealthServer

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    written = value("oncely_checkpoints_written_total", workflow="chain")
    replays = value("oncely_checkpoint_replays_total", workflow="chain", kind="model")
    chain = harness.worker("chain", redelivery_base_s=0.01, redelivery_max_s=0.01)
    job_id = await harness.submit("/v1/chain", {"text": "sku-m metrics", "hold": "[[fake:503*4]]"})

    async def done() -> bool:
        return await harness.status(job_id) == "done"

    await redeliver_until(harness, chain, "chain", done)
    # Every checkpoint: three rows before the last call, the last one with
    # the result; the redelivery replayed the two model ones.
    assert len(await harness.keys(job_id)) == 4
    assert value("oncely_checkpoints_written_total", workflow="chain") == written + 4
    assert value("oncely_checkpoint_replays_total", workflow="chain", kind="model") == replays + 2

    await harness.submit("/v1/approvals", {"text": "waits for the gauge"})
    await drain(harness.worker("approvals"))
    health = HealthServer(
        HealthConfig(port=0), redis=redis, pool=harness.pool,
        streams=list(harness.jobs.streams.values()), loops=[],
    )  # fmt: skip
    await health._read_backlog()
    assert value("oncely_jobs_waiting", workflow="approvals") == 1
    assert value("oncely_jobs_waiting", workflow="chain") == 0


async def test_timers_resume_only_the_workflows_their_process_serves(harness: Harness):
    """A worker started for some workflows leaves the others' due jobs to
    their own workers (and does not fall over them)."""
    job_id = await harness.submit("/v1/approvals", {"text": "refund 7 EUR, due"})
    await drain(harness.worker("approvals"))
    assert await harness.status(job_id) == "waiting"
    async with harness.pool.connection() as conn:
        await conn.execute(
            "UPDATE jobs SET wait_until = now() - interval '1 second' WHERE job_id = %s", (job_id,)
        )
    others = Checkpoints(Jobs(harness.pool, {"chain": harness.jobs.streams["chain"]}))
    assert await Timers(others).run_once() == 0
    assert await harness.status(job_id) == "waiting"
    assert await Timers(harness.checkpoints).run_once() == 1
    assert await harness.status(job_id) == "queued"
    assert await entry_of(harness, "approvals", job_id) is not None


async def test_a_waiting_jobs_usage_is_the_same_in_get_the_cli_and_the_console(
    harness: Harness,
):
    """What a job spent before it waits (or died) shows on every surface as
    GET shows it: its checkpoints summed."""
    import uuid

    from pydantic import SecretStr

    from oncely.jobs.inspection import inspect_job
    from oncely.outbox.store import OutboxStore
    from tests.helpers import asgi_app

    job_id = await harness.submit("/v1/approvals", {"text": "Usage shows everywhere."})
    await drain(harness.worker("approvals"))
    view = await harness.get("/v1/approvals", job_id)
    assert view["status"] == "waiting" and view["usage"]["model_calls"] == 1
    inspected = await inspect_job(harness.jobs, OutboxStore(harness.pool), None, uuid.UUID(job_id))
    assert inspected is not None
    assert inspected.to_json()["usage"]["model_calls"] == 1
    assert inspected.usage["prompt_tokens"] == view["usage"]["prompt_tokens"]
    key = "operator-key-for-usage-tests-0001"
    settings = harness.settings.model_copy(update={"console_key": SecretStr(key)})
    app = asgi_app(settings, harness.redis, harness.pool, harness.app)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://oncely.test"
    ) as console:
        assert (await console.post("/console/login", data={"key": key})).status_code == 303
        page = (await console.get(f"/console/workflows/approvals/jobs/{job_id}")).text
    assert 'id="usage"' in page and "&#34;model_calls&#34;: 1" in page
    assert "No result yet." in page
