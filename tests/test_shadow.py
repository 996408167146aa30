"""Shadow runs on real Redis and PostgreSQL with the fake model as a real
HTTP server: variants, sampling, one stored shadow result per job and
variant, no outbox rows from shadows, failing shadows, the limiter share,
and the report's numbers checked against the stored rows."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from oncely import App, ModelJudge, names
from oncely.bootstrap import Resources, WorkerGroup, connect_llm
from oncely.builtin import app as builtin_app
from oncely.builtin.triage import Triage, triage
from oncely.jobs.records import JobSpec
from oncely.llm.base import Message
from oncely.llm.limiter import FleetLimiter, LimitedLLM, Limits
from oncely.queue.stream import JobMessage, Stream
from oncely.queue.worker import Worker
from oncely.shadow.config import parse_primary, parse_shadow, sampled
from oncely.shadow.dispatch import PRIMARY_FIELD
from oncely.shadow.evaluate import Evaluation, evaluate, field_agreement
from oncely.shadow.report import Thresholds, build_report, gate
from oncely.shadow.store import ShadowResults
from tests.helpers import count, drain, rows
from tests.processes import oncely

# -- pure logic ----------------------------------------------------------------------


def test_shadow_setting_parses_variants_and_rates() -> None:
    specs = parse_shadow(" triage=fake-v2:0.2, summaries=fake-v2:0.05,triage=llama3:8b:1 ")
    assert [(s.workflow, s.variant, s.rate) for s in specs] == [
        ("triage", "fake-v2", 0.2),
        ("summaries", "fake-v2", 0.05),
        ("triage", "llama3:8b", 1.0),
    ]
    assert parse_shadow("") == [] and parse_shadow("  ") == []
    assert parse_primary("triage=fake-v2") == {"triage": "fake-v2"}


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("triage=fake-v2", "want workflow=variant:rate"),
        ("triage=fake-v2:0", "the rate must be in (0, 1]"),
        ("triage=fake-v2:1.5", "the rate must be in (0, 1]"),
        ("triage=fake-v2:nan", "the rate must be in (0, 1]"),
        ("triage=fake-v2:1e-1", "the rate must be in (0, 1]"),
        ("triage", "want workflow=variant"),
        ("Triage=fake-v2:0.2", "is not a workflow name"),
        ("triage=fake v2:0.2", "a variant is"),
        ("triage=primary:0.2", "a variant is"),
        ("triage=fake-v2:0.2,", "want workflow=variant"),
        ("triage=fake-v2:0.2,triage=fake-v2:0.5", "named twice"),
    ],
)
def test_bad_shadow_settings_say_what_is_wrong(text: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint.replace("(", r"\(").replace("]", r"\]")):
        parse_shadow(text)


def test_sampling_a_quarter_of_400_jobs_takes_60_to_140_the_same_every_time() -> None:
    ids = [str(uuid.uuid5(uuid.NAMESPACE_URL, f"job-{i}")) for i in range(400)]
    chosen = [i for i in ids if sampled(i, 0.25)]
    assert 60 <= len(chosen) <= 140, len(chosen)
    assert chosen == [i for i in ids if sampled(i, 0.25)], "a redelivery samples the same"
    assert set(chosen) <= {i for i in ids if sampled(i, 0.5)}, "higher rates include lower"
    assert all(sampled(i, 1.0) for i in ids)


def test_field_agreement_scores_each_field_and_their_mean() -> None:
    a = Triage(category="billing", priority="urgent", reply="Sorry.")
    b = Triage(category="bug", priority="urgent", reply="Sorry!")
    assert evaluate(None, a, b) == Evaluation(
        1 / 3, {"category": 0.0, "priority": 1.0, "reply": 0.0}
    )
    assert evaluate(field_agreement("category", "priority"), a, b).score == 0.5
    assert evaluate(lambda p, s: 0.25, a, b) == Evaluation(0.25, {})
    with pytest.raises(ValueError, match=r"score in \[0, 1\]"):
        evaluate(lambda p, s: 2, a, b)


# -- in-process deployments ------------------------------------------------------------


def ticket(i: int, *, two_categories: bool) -> dict[str, str]:
    """The fake model picks the first mentioned enum value, ``v2`` the second:
    a ticket naming two categories gets different categories from the two."""
    body = "My billing page shows a bug." if two_categories else "My billing page is wrong."
    return {"subject": f"Ticket {i}: urgent", "body": f"{body} Please help, case {i}."}


class Deployment:
    """A WorkerGroup built by the composition root from settings, driven round
    by round (the production loops' ``run_once``)."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def worker(self, label: str) -> Worker:
        return next(w for w in self.group.loops if w.workflow == label)

    async def start(self) -> None:
        for w in self.group.loops:
            await w.stream.ensure_group()

    async def settle(self, label: str, rounds: int = 2) -> None:
        await drain(self.worker(label), rounds)


@pytest.fixture
async def deploy(worker_settings, redis, pool):
    llms = []

    async def make(**settings: Any) -> Deployment:
        s = worker_settings.model_copy(update=settings)
        llm = connect_llm(s)
        llms.append(llm)
        group = WorkerGroup(builtin_app, Resources(s, redis, pool), llm)
        d = Deployment(group)
        await d.start()
        return d

    yield make
    for llm in llms:
        await llm.aclose()


async def accept_tickets(jobs, n: int, every_other_differs: int = 4) -> list[str]:
    ids = []
    for i in range(n):
        job_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"ticket-{i}"))
        payload = ticket(i, two_categories=i % every_other_differs == 0)
        await jobs.accept(JobSpec(job_id, "acme", "triage", payload))
        ids.append(job_id)
    return ids


async def test_without_shadow_settings_the_primary_path_has_no_shadow_work(
    deploy, jobs, pool, redis
):
    d = await deploy()
    assert d.group.shadow_workers == []
    await accept_tickets(jobs, 4)
    await d.settle("triage")
    assert await count(pool, "SELECT count(*) FROM jobs WHERE status = 'done'") == 4
    # Nothing followed the done jobs to a shadow stream.
    assert [k async for k in redis.scan_iter(match="oncely:{triage}:shadow:*")] == []


async def test_every_done_job_gets_one_shadow_result_and_no_shadow_outbox_row(
    deploy, jobs, pool, fake_llm
):
    d = await deploy(shadow="triage=oncely-fake-v2:1")
    ids = await accept_tickets(jobs, 12)
    await d.settle("triage")
    assert await count(pool, "SELECT count(*) FROM jobs WHERE status = 'done'") == 12
    await d.settle("triage:shadow:oncely-fake-v2")

    stored = await rows(
        pool,
        "SELECT job_id::text, variant, result, emitted, usage, error, score FROM shadow_results",
    )
    assert sorted(r[0] for r in stored) == sorted(ids)
    assert {r[1] for r in stored} == {"oncely-fake-v2"}
    for _, _, result, emitted, usage, error, _ in stored:
        assert error is None and result["category"] in ("billing", "bug")
        # What the shadow would have emitted is recorded, never sent.
        assert [e["topic"] for e in emitted] == ["ticket.triaged"]
        assert usage["model_calls"] == 1 and usage["prompt_tokens"] > 0
        assert usage["model_ms"] >= 0
    outbox = await rows(pool, "SELECT job_id::text, dedupe_key FROM outbox")
    assert sorted(outbox) == sorted((i, f"ticket_triaged:{i}") for i in ids)
    assert fake_llm.stats().models == {"oncely-fake": 12, "oncely-fake-v2": 12}
    statuses = await rows(pool, "SELECT DISTINCT status FROM jobs")
    assert statuses == [("done",)]

    # The report's agreement is what the stored rows say, computed here apart.
    pairs = await rows(
        pool,
        "SELECT r.result, s.result FROM shadow_results s JOIN results r USING (job_id)",
    )
    scores = [sum(p[f] == s[f] for f in ("category", "priority")) / 2 for p, s in pairs]
    expected = sum(scores) / len(scores)
    assert expected < 1, "the v2 model disagrees on tickets naming two categories"
    store = ShadowResults(pool)
    [report] = await build_report(store, "triage", None, datetime(1970, 1, 1, tzinfo=UTC))
    assert report.pairs == 12 and report.errors == 0
    assert report.agreement == pytest.approx(expected)
    category = sum(p["category"] == s["category"] for p, s in pairs) / len(pairs)
    assert report.fields == pytest.approx({"category": category, "priority": 1.0})
    assert sum(report.scores.values()) == 12
    assert report.scores["1"] == sum(1 for s in scores if s == 1)
    assert report.primary["model_calls"] == report.shadow["model_calls"] == 1
    assert report.shadow["tokens"] < report.primary["tokens"], "one sentence, not two"
    assert gate(report, Thresholds(min_agreement=expected - 0.01)).passed
    assert not gate(report, Thresholds(min_agreement=expected + 0.01)).passed
    assert not gate(report, Thresholds(min_agreement=0.0, min_pairs=13)).passed


async def test_a_shadow_that_always_fails_changes_nothing_of_the_primary_and_is_reported(
    deploy, jobs, pool, fake_llm
):
    fake_llm.model.model_outages["fake-broken"] = "400"
    d = await deploy(shadow="triage=fake-broken:1")
    ids = await accept_tickets(jobs, 6)
    await d.settle("triage")
    await d.settle("triage:shadow:fake-broken")

    assert await rows(pool, "SELECT DISTINCT status FROM jobs") == [("done",)]
    assert await count(pool, "SELECT count(*) FROM results") == 6
    assert await count(pool, "SELECT count(*) FROM outbox") == 6
    errors = await rows(pool, "SELECT job_id::text, result, error FROM shadow_results")
    assert sorted(e[0] for e in errors) == sorted(ids)
    assert all(result is None and "400" in error for _, result, error in errors)
    assert fake_llm.stats().models["fake-broken"] == 6, "a 400 is permanent: one call each"
    [report] = await build_report(
        ShadowResults(pool), "triage", "fake-broken", datetime(1970, 1, 1, tzinfo=UTC)
    )
    assert (report.runs, report.errors, report.pairs) == (6, 6, 0)
    [(error, n)] = report.top_errors
    assert "400" in error and n == 6
    verdict = gate(report, Thresholds(min_agreement=0.0))
    assert not verdict.passed and any("error rate" in f for f in verdict.failures)
    shadow_stream = d.worker("triage:shadow:fake-broken").stream
    assert (
        int((await shadow_stream.redis.xpending(shadow_stream.stream, "shadow-workers"))["pending"])
        == 0
    )


async def test_a_quarter_sample_shadows_exactly_the_sampled_jobs(deploy, jobs, pool, fake_llm):
    d = await deploy(shadow="triage=oncely-fake-v2:0.25")
    ids = await accept_tickets(jobs, 40)
    await d.settle("triage")
    await d.settle("triage:shadow:oncely-fake-v2")
    shadowed = {r[0] for r in await rows(pool, "SELECT job_id::text FROM shadow_results")}
    assert shadowed == {i for i in ids if sampled(i, 0.25)}
    assert 0 < len(shadowed) < 40
    assert await count(pool, "SELECT count(*) FROM outbox") == 40


async def test_redelivered_and_concurrent_shadow_runs_store_one_result(
    deploy, jobs, pool, redis, fake_llm
):
    d = await deploy(shadow="triage=oncely-fake-v2:1")
    [job_id] = await accept_tickets(jobs, 1)
    await d.settle("triage")
    shadow = d.worker("triage:shadow:oncely-fake-v2")
    primary = (await rows(pool, "SELECT result::text FROM results"))[0][0]
    message = JobMessage.new(job_id, "acme", ticket(0, two_categories=True))
    # The same work enqueued twice more (a retried enqueue, a redelivery), run
    # by two workers at once: each one races to store.
    for _ in range(2):
        await shadow.stream.enqueue(message, {PRIMARY_FIELD: primary})
    rival = Worker(shadow.stream, shadow.handler, shadow.config, workflow=shadow.workflow)
    await asyncio.gather(drain(shadow), drain(rival))
    await drain(shadow)
    assert await count(pool, "SELECT count(*) FROM shadow_results") == 1
    assert fake_llm.stats().models["oncely-fake-v2"] <= 3
    # Stored: one more delivery finds it and makes no model call.
    before = fake_llm.stats().models["oncely-fake-v2"]
    await shadow.stream.enqueue(message, {PRIMARY_FIELD: primary})
    await drain(shadow)
    assert fake_llm.stats().models["oncely-fake-v2"] == before
    assert await count(pool, "SELECT count(*) FROM shadow_results") == 1
    assert await count(pool, "SELECT count(*) FROM outbox") == 1


async def test_a_promoted_variant_runs_the_primary(deploy, jobs, pool, fake_llm):
    d = await deploy(primary="triage=oncely-fake-v2")
    [job_id] = await accept_tickets(jobs, 1)
    await d.settle("triage")
    [(stored_for, result)] = await rows(pool, "SELECT job_id::text, result FROM results")
    assert stored_for == job_id
    assert result["category"] == "bug", "the v2 model's answer is the job's result"
    assert fake_llm.stats().models == {"oncely-fake-v2": 1}
    assert await count(pool, "SELECT count(*) FROM outbox") == 1


async def test_a_failed_shadow_enqueue_does_not_fail_the_primary(deploy, jobs, pool, redis):
    d = await deploy(shadow="triage=oncely-fake-v2:1")
    # The shadow stream's key holds a string: every XADD to it fails.
    await redis.set(names.shadow_keys("triage", "oncely-fake-v2").stream, "in the way")
    await accept_tickets(jobs, 2)
    await d.settle("triage")
    assert await rows(pool, "SELECT DISTINCT status FROM jobs") == [("done",)]
    assert await count(pool, "SELECT count(*) FROM outbox") == 2
    stream = d.worker("triage").stream
    assert int((await redis.xpending(stream.stream, stream.group))["pending"]) == 0


async def test_shadow_calls_stay_within_their_share_while_production_runs_at_its_limit(
    redis, fake_llm, worker_settings
):
    rpm, share = 600, 0.2
    llm = connect_llm(worker_settings)
    production = LimitedLLM(llm, FleetLimiter(redis, Limits(rpm=rpm)))
    shadow = LimitedLLM(
        llm.with_model("oncely-fake-v2"), FleetLimiter(redis, Limits(rpm=rpm), share=share)
    )
    ask = [Message("user", "One sentence. Another one.")]

    stop = asyncio.Event()

    async def keep_calling(limited: LimitedLLM) -> None:
        # Ends on the event as well as on cancellation: a cancellation that a
        # client library swallows mid-request must not keep the loop going.
        while not stop.is_set():
            await limited.complete(ask, timeout=30)

    started = time.monotonic()
    tasks = [asyncio.create_task(keep_calling(production)) for _ in range(16)]
    tasks += [asyncio.create_task(keep_calling(shadow)) for _ in range(16)]

    def production_past_its_burst() -> bool:
        return fake_llm.stats().models.get("oncely-fake", 0) >= 80

    try:
        # Under the test's own timeout, so that a stall reports the counts.
        deadline = time.monotonic() + 40
        while not production_past_its_burst():
            assert time.monotonic() < deadline, fake_llm.stats().models
            assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=10)
        await llm.aclose()
    elapsed_min = (time.monotonic() - started) / 60
    models = fake_llm.stats().models
    # Each bucket allows a tenth of a minute's calls at once, then its rate.
    fleet_allowance = rpm * (0.1 + elapsed_min) + 1
    share_allowance = rpm * share * (0.1 + elapsed_min) + 1
    assert 0 < models["oncely-fake-v2"] <= share_allowance, (models, elapsed_min)
    assert models["oncely-fake"] + models["oncely-fake-v2"] <= fleet_allowance, models
    assert models["oncely-fake"] >= 3 * models["oncely-fake-v2"], models


async def test_fake_model_fails_one_model_only_and_counts_calls_per_model(fake_llm):
    import httpx

    async with httpx.AsyncClient(base_url=fake_llm.root_url) as http:
        await http.post("/_outage", json={"fault": "400", "model": "broken"})

        async def chat(model: str) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": "Hi."}]}
            return (await http.post("/v1/chat/completions", json=body)).status_code

        assert (await chat("broken"), await chat("fine")) == (400, 200)
        await http.request("DELETE", "/_outage", json={"model": "broken"})
        assert await chat("broken") == 200
        calls = (await http.get("/_calls")).json()
    assert calls["models"] == {"broken": 2, "fine": 1}


async def test_a_model_judge_scores_with_its_own_counted_calls(
    worker_settings, redis, pool, jobs, fake_llm
):
    judged = dataclasses.replace(triage, evaluator=ModelJudge())
    s = worker_settings.model_copy(update={"shadow": "triage=oncely-fake-v2:1"})
    llm = connect_llm(s)
    try:
        d = Deployment(WorkerGroup(App([judged]), Resources(s, redis, pool), llm))
        await d.start()
        ids = await accept_tickets(jobs, 3)
        await d.settle("triage")
        await d.settle("triage:shadow:oncely-fake-v2")
    finally:
        await llm.aclose()
    stored = await rows(pool, "SELECT job_id::text, score, fields, usage FROM shadow_results")
    assert sorted(r[0] for r in stored) == sorted(ids)
    for _, score, fields, usage in stored:
        # The fake judge answers the first enum value ("same") for these tickets.
        assert (score, fields) == (1.0, {"judge": 1.0})
        assert usage["model_calls"] == 1 and usage["judge_model_calls"] == 1
        assert usage["judge_prompt_tokens"] > 0
    # The primary's model judges: one call per job for the job, one to judge.
    assert fake_llm.stats().models == {"oncely-fake": 6, "oncely-fake-v2": 3}
    judge_prompts = fake_llm.stats(contains="Candidate:").prompts
    assert len(judge_prompts) == 3 and all(p.count == 1 for p in judge_prompts)


@pytest.mark.slow
async def test_status_shows_each_shadow_variants_stream(redis, redis_url, database_url, pool):
    """`oncely status` reports a shadow variant's stream beside its
    workflow's: what waits there, and its dead letters."""
    shadow = Stream(redis, names.shadow_keys("triage", "fake-v2"))
    await shadow.ensure_group()
    await shadow.enqueue(JobMessage.new(str(uuid.uuid4()), "acme", {"subject": "s", "body": "b"}))
    env = {
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_SHADOW": "triage=fake-v2:1.0",
        "COLUMNS": "200",
    }
    report = await asyncio.to_thread(oncely, "status", "--json", env=env)
    assert report.returncode == 0, report.stderr
    shadows = json.loads(report.stdout)["shadows"]
    assert list(shadows) == ["triage:shadow:fake-v2"]
    assert shadows["triage:shadow:fake-v2"]["stream_length"] == 1
    assert shadows["triage:shadow:fake-v2"]["dead_letters"] == 0
    table = await asyncio.to_thread(oncely, "status", env=env)
    assert table.returncode == 0, table.stderr
    assert "triage:shadow:fake-v2" in table.stdout
