"""The ``jobs`` and ``results`` tables, and the one way a job gets dispatched.

Only this module runs SQL on those tables. PostgreSQL is the record of
acceptance and Redis only the dispatch path, so every way into a stream goes
through ``Jobs``: ``accept`` inserts the row then enqueues (intake),
``replay`` sets a dead job back to queued then enqueues (operators), and
``restore`` enqueues a job whose row is still queued but whose message Redis
lost (the reconciler). A crash between the two steps leaves a queued row
without a message, which the reconciler puts back; never a message without
a row.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.batching import GroupCommit
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query
from oncely.workflow import Emitted

_ERROR_CHARS = 2000


@dataclass(frozen=True)
class Job:
    """A job as it is dispatched: which workflow, for whom, with what request."""

    job_id: str
    tenant: str
    kind: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class JobRecord:
    """A job row with its result, as ``GET <route>/{job_id}`` shows it."""

    job_id: uuid.UUID
    tenant: str
    kind: str
    status: str
    result: dict[str, Any] | None
    usage: dict[str, int] | None
    error: str | None
    created_at: datetime
    updated_at: datetime


class Jobs:
    def __init__(self, pool: AsyncConnectionPool, streams: Mapping[str, Stream]) -> None:
        self.pool = pool
        # workflow name -> its stream
        self.streams = streams
        # Pre-checks asked while one query runs share the next one.
        self._stored: GroupCommit[str, str] = GroupCommit(self._results_stored, key=str)

    # -- dispatch: the row first, then the stream ------------------------------

    async def accept(self, job: Job) -> None:
        """Intake: record the job, then enqueue it. Idempotent per job id."""
        async with self.pool.connection() as conn:
            await conn.execute(
                query("insert_job"), (job.job_id, job.tenant, job.kind, Jsonb(job.payload))
            )
        await self._enqueue(job)

    async def replay(self, job: Job) -> bool:
        """A dead job back to queued, then enqueued; False if it was not dead."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("mark_job_requeued"), (job.job_id,))
        await self._enqueue(job)
        return cur.rowcount > 0

    async def restore(self, job: Job) -> None:
        """A queued job whose message is gone, enqueued again (same job id)."""
        await self._enqueue(job)

    async def _enqueue(self, job: Job) -> None:
        await self.streams[job.kind].enqueue(JobMessage.new(job.job_id, job.tenant, job.payload))

    # -- the worker's side -----------------------------------------------------

    async def result_stored(self, job_id: str) -> bool:
        return await self._stored(job_id)

    @property
    def pre_check_queries(self) -> int:
        return self._stored.flushes

    async def _results_stored(self, job_ids: list[str]) -> set[str]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("results_stored"), (job_ids,))
            return {str(row[0]) for row in await cur.fetchall()}

    async def finish(
        self,
        workflow: str,
        job_id: str,
        result: Mapping[str, Any],
        usage: Mapping[str, int] | None,
        emitted: Sequence[Emitted],
    ) -> bool:
        """Store the result, the emitted outbox rows and ``done`` atomically.
        False when another delivery stored this job's result first (then
        nothing of this delivery is written)."""
        params = {
            "job_id": job_id,
            "workflow": workflow,
            "result": Jsonb(result),
            "usage": None if usage is None else Jsonb(usage),
            "topics": [e.topic for e in emitted],
            "dedupe_keys": [e.dedupe_key for e in emitted],
            "payloads": [Jsonb(e.payload) for e in emitted],
        }
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("finish_job"), params)
            row = await cur.fetchone()
        return row is not None and bool(row[0])

    async def mark_dead(self, job_id: str, reason: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(query("mark_job_dead"), (reason[:_ERROR_CHARS], job_id))

    # -- readers ---------------------------------------------------------------

    async def get(self, kind: str, job_id: uuid.UUID, tenant: str) -> JobRecord | None:
        """The job, only if it is of this workflow and this tenant's."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("get_job"), (job_id, tenant, kind))
            row = await cur.fetchone()
        return None if row is None else JobRecord(*row)

    async def stale_queued(self, kind: str, older_than_s: float, limit: int) -> list[Job]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("queued_jobs_older_than"), (kind, older_than_s, limit))
            rows = await cur.fetchall()
        return [Job(str(job_id), tenant, k, payload) for job_id, tenant, k, payload in rows]

    async def counts(self) -> dict[str, dict[str, int]]:
        """Jobs by workflow and status."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("jobs_by_kind_and_status"))
            rows = await cur.fetchall()
        counts: dict[str, dict[str, int]] = {}
        for kind, status, n in rows:
            counts.setdefault(kind, {"queued": 0, "done": 0, "dead": 0})[status] = int(n)
        return counts

    # -- lifecycle ---------------------------------------------------------------

    async def purge_finished(self, older_than_s: float, batch: int = 1000) -> int:
        """Delete finished jobs (with results and outbox rows) last changed
        more than ``older_than_s`` ago whose effects have all been sent,
        ``batch`` per statement; how many jobs went."""
        total = 0
        while True:
            async with self.pool.connection() as conn:
                cur = await conn.execute(
                    query("purge_finished_jobs"), {"age_s": older_than_s, "batch": batch}
                )
            total += max(cur.rowcount, 0)
            if cur.rowcount < batch:
                return total

    async def erase_tenant(self, tenant: str) -> dict[str, int]:
        """Every job, result and outbox row of ``tenant``; the counts deleted."""
        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(query("erase_tenant_jobs"), {"tenant": tenant})
            row = await cur.fetchone()
        jobs, results, outbox = row if row is not None else (0, 0, 0)
        return {"jobs": int(jobs), "results": int(results), "outbox": int(outbox)}
