"""The summary handler's pieces on real Postgres."""

from __future__ import annotations

import asyncio
import uuid

from psycopg.types.json import Jsonb

from oncely.sql import query
from oncely.workflow import StoredSummaries


async def test_pre_checks_asked_together_share_one_query(pool):
    stored_ids = [str(uuid.uuid4()) for _ in range(5)]
    async with pool.connection() as conn:
        for job_id in stored_ids:
            await conn.execute(query("insert_job"), (job_id, "acme", Jsonb({})))
            await conn.execute(
                "INSERT INTO summaries (job_id, summary) VALUES (%s, 's')", (job_id,)
            )
    missing_ids = [str(uuid.uuid4()) for _ in range(45)]
    lookup = StoredSummaries(pool)
    asked = stored_ids + missing_ids + stored_ids[:1]  # a job asked about twice
    answers = await asyncio.gather(*(lookup.exists(job_id) for job_id in asked))
    assert answers == [True] * 5 + [False] * 45 + [True]
    assert lookup.queries == 1
    assert await lookup.exists(missing_ids[0]) is False
    assert lookup.queries == 2
