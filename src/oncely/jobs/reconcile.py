"""The reconciler: PostgreSQL is the record of acceptance, Redis only dispatch.

A job still ``queued`` after ``reconcile_after_s`` (30 s by default) whose
stream entry no longer exists is enqueued again with the same job id: Redis
lost its data (a failover, a restart without its file), or the API died
between the insert and the XADD. Each pass reads one page of such jobs, the
next pass the page after it (a cursor), so a backlog still in the stream
never hides a lost job behind it. A job whose entry still
exists is merely slow or waiting, and is left alone (re-enqueueing it would
pay for a second model call), and so is one waiting out a redelivery
backoff in the delayed set. The stream's index hash (job id → entry id, or
``delayed``; written with every XADD and deferral, removed with every XACK)
says where to look; a missing index entry means a missing message.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime

import psycopg
import redis.exceptions
import structlog

from oncely.jobs.records import JobSpec
from oncely.jobs.store import Jobs
from oncely.queue.stream import DELAYED, Stream

log = structlog.get_logger("oncely.reconcile")


class Reconciler:
    """Reconciles one workflow's jobs; one pass at a time fleet-wide."""

    def __init__(self, jobs: Jobs, workflow: str, *, after_s: float, batch: int = 500) -> None:
        self.jobs = jobs
        self.workflow = workflow
        self.stream: Stream = jobs.streams[workflow]
        self.after_s = after_s
        self.batch = batch
        # One pass per half the threshold, fleet-wide: a lost job is back in
        # the stream at most 1.5 × reconcile_after_s after it was accepted.
        self.every_s = max(after_s / 2, 0.1)
        self._stopping = asyncio.Event()
        # Where the next pass's page starts (None: from the oldest).
        self._after: tuple[datetime, str] | None = None

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.run_once()
            except (redis.exceptions.RedisError, psycopg.Error) as exc:
                log.warning(
                    "reconcile.failed",
                    workflow=self.workflow,
                    error=f"{type(exc).__name__}: {exc}",
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.every_s)

    def stop(self) -> None:
        self._stopping.set()

    async def run_once(self) -> int:
        """Re-enqueue lost jobs; returns how many. One process at a time does
        the work (a Redis lock with a TTL); the others return 0."""
        if not await self.stream.take_reconcile_turn(int(self.every_s * 1000)):
            return 0
        candidates, self._after = await self.jobs.stale_queued(
            self.workflow, self.after_s, self.batch, self._after
        )
        lost = await self._without_entries(candidates)
        for job in lost:
            await self.jobs.restore(job)
            log.warning("reconcile.requeued", workflow=self.workflow, job_id=job.job_id)
        return len(lost)

    async def _without_entries(self, jobs: list[JobSpec]) -> list[JobSpec]:
        if not jobs:
            return []
        entry_ids = await self.stream.index_entries([j.job_id for j in jobs])
        in_stream = [e for e in entry_ids if e not in (None, DELAYED)]
        delayed = [j.job_id for j, e in zip(jobs, entry_ids, strict=True) if e == DELAYED]
        exists = iter(await self.stream.entries_exist(in_stream))
        waiting = iter(await self.stream.delayed_jobs(delayed))
        return [
            job
            for job, entry_id in zip(jobs, entry_ids, strict=True)
            if entry_id is None or not next(waiting if entry_id == DELAYED else exists)
        ]
