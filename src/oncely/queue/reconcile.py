"""The reconciler: Postgres is the record of acceptance, Redis only dispatch.

A job still ``queued`` after ``reconcile_after_s`` whose stream entry no
longer exists is enqueued again with the same job id: Redis lost its data,
or the API died between the insert and the XADD. A job whose entry still
exists is merely slow or waiting, and is left alone (re-enqueueing it would
pay for a second model call). The stream's index hash (job id → entry id,
written with every XADD, removed with every XACK) says which entry to look
for; a missing index entry means a missing message.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import psycopg
import redis.exceptions
import structlog
from psycopg_pool import AsyncConnectionPool

from oncely import names
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query

log = structlog.get_logger("oncely.reconcile")


class Reconciler:
    def __init__(
        self, pool: AsyncConnectionPool, stream: Stream, *, after_s: float, batch: int = 500
    ) -> None:
        self.pool = pool
        self.stream = stream
        self.after_s = after_s
        self.batch = batch
        # One pass per half the threshold, fleet-wide: a lost job is back in
        # the stream at most 1.5 × reconcile_after_s after it was accepted.
        self.every_s = max(after_s / 2, 0.1)
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.run_once()
            except (redis.exceptions.RedisError, psycopg.Error) as exc:
                log.warning("reconcile.failed", error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.every_s)

    def stop(self) -> None:
        self._stopping.set()

    async def run_once(self) -> int:
        """Re-enqueue lost jobs; returns how many. One process at a time does
        the work (a Redis lock with a TTL); the others return 0."""
        lock_ms = int(self.every_s * 1000)
        if not await self.stream.redis.set(names.RECONCILE_LOCK, "1", nx=True, px=lock_ms):
            return 0
        candidates = await self._stale_queued_jobs()
        lost = await self._without_entries(candidates)
        for message in lost:
            await self.stream.enqueue(message)
            log.warning("reconcile.requeued", job_id=message.job_id)
        return len(lost)

    async def _stale_queued_jobs(self) -> list[JobMessage]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("queued_jobs_older_than"), (self.after_s, self.batch))
            rows = await cur.fetchall()
        return [JobMessage.new(str(job_id), tenant, payload) for job_id, tenant, payload in rows]

    async def _without_entries(self, jobs: list[JobMessage]) -> list[JobMessage]:
        if not jobs:
            return []
        entry_ids: list[Any] = await self.stream.redis.hmget(
            self.stream.index, [j.job_id for j in jobs]
        )
        async with self.stream.redis.pipeline(transaction=False) as pipe:
            for entry_id in entry_ids:
                if entry_id is not None:
                    pipe.xrange(self.stream.stream, min=entry_id, max=entry_id)
            found = iter(await pipe.execute())
        lost = []
        for job, entry_id in zip(jobs, entry_ids, strict=True):
            if entry_id is None or not next(found):
                lost.append(job)
        return lost
