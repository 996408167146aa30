"""Data lifecycle: retention purges only what is old and delivered; erasure
removes every trace of one tenant and touches no other."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

from oncely.api.auth import create_api_key
from oncely.jobs.records import JobSpec
from oncely.jobs.retention import Retention
from oncely.journal import Emitted, NewCheckpoint, Writes
from oncely.queue.worker import DeliveryReport
from oncely.usage.calls import Call, CallSite
from oncely.usage.ledger import Ledger
from tests.helpers import rows
from tests.processes import oncely

DAY_S = 86400.0


def report(job_id: str, number: int, outcome: str) -> DeliveryReport:
    return DeliveryReport(job_id, number, "c1", 1.7e9, outcome, "503", 1)


async def finished(jobs, pool, tenant: str, *, status: str, age_days: float, sent: bool) -> str:
    """A job of ``tenant`` finished ``age_days`` ago after a failed delivery,
    with a result and an outbox row (sent or not); a dead job has neither."""
    job_id = str(uuid.uuid4())
    await jobs.accept(JobSpec(job_id, tenant, "triage", {"subject": "s", "body": "b"}))
    await jobs.record_deliveries([report(job_id, 1, "retry")])
    if status == "done":
        row = Emitted("ticket.triaged", {"job_id": job_id}, f"ticket_triaged:{job_id}")
        done = report(job_id, 2, "done")
        assert await jobs.finish(
            "triage", job_id, {"category": "bug"}, None, Writes(emitted=(row,)), delivery=done
        )
    else:
        await jobs.mark_dead(job_id, "permanent: 400")
        await jobs.record_deliveries([report(job_id, 2, "dead")])
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE jobs SET updated_at = now() - make_interval(days => %s) WHERE job_id = %s",
            (age_days, job_id),
        )
        if sent:
            await conn.execute("UPDATE outbox SET sent_at = now() WHERE job_id = %s", (job_id,))
    return job_id


async def ids(pool, sql: str, *args: Any) -> set[str]:
    return {str(r[0]) for r in await rows(pool, sql, *args)}


async def test_retention_purges_only_old_finished_jobs_whose_effects_left(jobs, pool):
    old_done = await finished(jobs, pool, "acme", status="done", age_days=40, sent=True)
    old_dead = await finished(jobs, pool, "acme", status="dead", age_days=40, sent=False)
    unsent = await finished(jobs, pool, "acme", status="done", age_days=40, sent=False)
    recent = await finished(jobs, pool, "acme", status="done", age_days=10, sent=True)
    queued = str(uuid.uuid4())
    await jobs.accept(JobSpec(queued, "acme", "triage", {"subject": "s", "body": "b"}))
    async with pool.connection() as conn:
        await conn.execute("UPDATE jobs SET created_at = now() - interval '40 days'")

    purged = await Retention(jobs, retention_s=30 * DAY_S, batch=1).run_once()

    assert purged == 2
    assert await ids(pool, "SELECT job_id FROM jobs") == {unsent, recent, queued}
    assert await ids(pool, "SELECT job_id FROM results") == {unsent, recent}
    assert await ids(pool, "SELECT job_id FROM outbox") == {unsent, recent}
    assert old_done not in await ids(pool, "SELECT job_id FROM outbox")
    assert old_dead not in await ids(pool, "SELECT job_id FROM jobs")
    # Deliveries go with their jobs: two each for the jobs that stay.
    assert await ids(pool, "SELECT job_id FROM job_deliveries") == {unsent, recent}
    assert await ids(pool, "SELECT count(*) FROM job_deliveries") == {"4"}


@pytest.mark.slow
async def test_erasing_a_tenant_leaves_nothing_of_it_and_touches_no_other(
    jobs, checkpoints, pool, redis, redis_url, database_url, client
):
    stream = jobs.streams["triage"]
    await stream.ensure_group()
    for tenant in ("acme", "globex"):  # one request each through the API: one record each
        key = await create_api_key(pool, tenant)
        r = await client.post(
            "/v1/triage",
            json={"subject": tenant, "body": "through the API"},
            headers={"Authorization": f"Bearer {key}", "Idempotency-Key": f"erase-me-{tenant}-01"},
        )
        assert r.status_code == 202
    for tenant in ("acme", "globex"):
        await finished(jobs, pool, tenant, status="done", age_days=1, sent=True)
        await create_api_key(pool, tenant)
        queued = str(uuid.uuid4())
        await jobs.accept(JobSpec(queued, tenant, "triage", {"subject": tenant, "body": "waits"}))
        # It reached a checkpoint, and was sent an event.
        lookup = NewCheckpoint("lookup", 1, "step", {"found": tenant}, None)
        await checkpoints.write("triage", queued, 0, Writes((lookup,)))
        received = await checkpoints.receive_event(
            "triage", uuid.UUID(queued), tenant, "approval", {"ok": True}, "fp"
        )
        assert received.outcome == "received"
        dead = str(uuid.uuid4())
        await jobs.accept(JobSpec(dead, tenant, "triage", {"subject": tenant, "body": "dies"}))
        delayed = str(uuid.uuid4())
        await jobs.accept(JobSpec(delayed, tenant, "triage", {"subject": tenant, "body": "later"}))
        # Two model calls in the ledger: one failed, one answered.
        ledger = Ledger(pool)
        site = CallSite("triage", queued, tenant)
        for outcome in ("retryable", "ok"):
            ledger.record(Call(site, "model", "oncely-fake", 1, outcome, 10, 5, 20, None))
        assert await ledger.flush() == 2
    # Two of each tenant's messages leave the stream: one dead, one delayed.
    entries = await stream.read_new("c1", 100, 10)
    for entry_id, fields in entries:
        if fields["payload"].endswith('"dies"}'):
            assert await stream.dead_letter("c1", entry_id, fields["job_id"], fields)
        elif fields["payload"].endswith('"later"}'):
            assert await stream.defer("c1", entry_id, fields["job_id"], 600, fields)

    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url}
    erased = await asyncio.to_thread(oncely, "tenants", "erase", "acme", "--json", env=env)
    # acme's messages: five in the stream (trimming would drop the acknowledged
    # ones later, erasure does not wait), one dead letter, one delayed.

    assert erased.returncode == 0, erased.stderr
    report = json.loads(erased.stdout)
    assert report == {
        "tenant": "acme",
        "deleted": {
            "jobs": 5,
            "results": 1,
            "outbox": 1,
            "deliveries": 2,
            "checkpoints": 1,
            "events": 1,
            "messages": 7,
            "idempotency_records": 1,
            "api_keys": 2,
            "model_calls": 2,
        },
    }
    assert await ids(pool, "SELECT DISTINCT tenant FROM model_calls") == {"globex"}
    for table in ("jobs", "api_keys"):
        assert await ids(pool, f"SELECT DISTINCT tenant FROM {table}") == {"globex"}
    assert await ids(pool, "SELECT count(*) FROM results") == {"1"}
    assert await ids(pool, "SELECT count(*) FROM outbox") == {"1"}
    globex_jobs = await ids(pool, "SELECT job_id FROM jobs WHERE tenant = 'globex'")
    assert await ids(pool, "SELECT job_id FROM job_deliveries") <= globex_jobs
    assert await ids(pool, "SELECT count(*) FROM job_deliveries") == {"2"}
    for table in ("checkpoints", "job_events"):
        assert await ids(pool, f"SELECT job_id FROM {table}") <= globex_jobs
        assert await ids(pool, f"SELECT count(*) FROM {table}") == {"1"}
    left: list[dict[str, str]] = []
    for key in (stream.stream, stream.dead):
        left += [f for _, f in await redis.xrange(key)]
    left += [json.loads(v) for v in (await redis.hgetall(stream.keys.delayed_messages)).values()]
    assert {f["tenant"] for f in left} == {"globex"}
    # Every message of globex stays: its five entries in the stream (acknowledged
    # or not, until trimmed), its dead letter and its delayed message.
    assert len(left) == 7
    records = [k async for k in redis.scan_iter(match="oncely:idem:*")]
    assert len(records) == 1, "globex's idempotency record stays"
