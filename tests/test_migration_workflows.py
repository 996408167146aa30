"""A database from before workflows (migration 1 only, with data) migrated to
today's schema: every job, summary and outbox row stays readable and is
served by today's API, relay and status."""

from __future__ import annotations

import uuid

import httpx
import psycopg
import pytest
from psycopg.types.json import Jsonb

from oncely.api.auth import create_api_key
from oncely.builtin import app as builtin_app
from oncely.cli.status import read_status
from oncely.jobs.store import Jobs
from oncely.outbox.store import OutboxStore
from oncely.queue.stream import Stream
from oncely.sql import query
from oncely.sql.migrate import available, migrate
from tests.helpers import asgi_app


@pytest.fixture
def old_database_url(database_url) -> str:
    """The per-test database, emptied and brought to migration 1 by hand."""
    [first, *_] = available()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
        conn.execute(query("create_migrations_table"))
        conn.execute(query("add_migration_checksums"))
        conn.execute(first.sql.encode())
        conn.execute(query("record_migration"), (first.version, first.name, first.checksum))
    return database_url


async def test_old_jobs_summaries_and_outbox_rows_survive_the_migration(
    old_database_url, settings, redis, pool
):
    done, queued = str(uuid.uuid4()), str(uuid.uuid4())
    payload = {"text": "Old text.", "notify": "ada@example.com"}
    async with await psycopg.AsyncConnection.connect(old_database_url, autocommit=True) as conn:
        for job_id, status in ((done, "done"), (queued, "queued")):
            await conn.execute(
                "INSERT INTO jobs (job_id, tenant, payload, status) VALUES (%s, 'acme', %s, %s)",
                (job_id, Jsonb(payload), status),
            )
        await conn.execute(
            "INSERT INTO summaries (job_id, summary) VALUES (%s, 'An old summary.')", (done,)
        )
        await conn.execute(
            "INSERT INTO outbox (topic, dedupe_key, payload) VALUES (%s, %s, %s)",
            (
                "email.summary_ready",
                f"summary_ready:{done}",
                Jsonb({"job_id": done, "to": "ada@example.com", "summary": "An old summary."}),
            ),
        )

    assert await migrate(old_database_url) == [m.version for m in available()[1:]]

    key = await create_api_key(pool, "acme")
    app = asgi_app(settings, redis, pool)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        auth = {"Authorization": f"Bearer {key}"}
        old_done = (await client.get(f"/v1/summaries/{done}", headers=auth)).json()
        old_queued = (await client.get(f"/v1/summaries/{queued}", headers=auth)).json()
    assert old_done["status"] == "done"
    assert old_done["summary"] == "An old summary."
    assert old_done["result"] == {"summary": "An old summary."}
    assert old_done["usage"] is None
    assert old_queued["status"] == "queued" and old_queued["summary"] is None

    async with pool.connection() as conn:
        kinds = await (await conn.execute("SELECT DISTINCT kind FROM jobs")).fetchall()
        view = await (await conn.execute("SELECT job_id::text, summary FROM summaries")).fetchall()
        outbox = await (await conn.execute("SELECT workflow, job_id::text FROM outbox")).fetchall()
    assert kinds == [("summaries",)]
    assert view == [(done, "An old summary.")], "summaries stays readable as a view"
    assert outbox == [("summaries", done)]
    [row] = await OutboxStore(pool).list()
    assert row.dedupe_key == f"summary_ready:{done}" and row.sent_at is None

    jobs = Jobs(pool, {w.name: Stream(redis, w.keys) for w in builtin_app})
    status = await read_status(jobs, OutboxStore(pool))
    by_name = {w.workflow: w.jobs for w in status.workflows}
    assert by_name["summaries"] == {
        "queued": 1,
        "held": 0,
        "waiting": 0,
        "done": 1,
        "dead": 0,
        "cancelled": 0,
    }
    assert status.outbox.unsent == 1
