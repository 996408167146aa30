"""Timers: waiting jobs resume when their time comes.

A job that sleeps, or waits for an event with a timeout, is a row in
PostgreSQL (``status = 'waiting'``, ``wait_until``): the record, which
survives restarts of every process and Redis losing its data. Every worker
process runs this service; each pass queues the due jobs with ``SKIP
LOCKED`` (passes side by side take different rows) and enqueues them, so
Redis only wakes a worker. A due job resumes within about ``every_s`` plus
the worker's read interval. A job queued whose enqueue failed is the
reconciler's to restore. The same service counts the ends of maps'
children that no process counted (``Children.repair``).
"""

from __future__ import annotations

import asyncio
import contextlib

import psycopg
import structlog

from oncely.jobs.checkpoints import Checkpoints
from oncely.services import Progress

log = structlog.get_logger("oncely.timers")


# Passes between two repairs of maps' counts (oncely.jobs.children).
_REPAIR_EVERY = 10


class Timers:
    def __init__(self, checkpoints: Checkpoints, *, every_s: float = 1.0, batch: int = 500) -> None:
        self.checkpoints = checkpoints
        self.every_s = every_s
        self.batch = batch
        self._passes = 0
        self.progress = Progress()
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        while not self._stopping.is_set():
            self.progress.tick()
            try:
                # A full batch: more are due now, go again at once.
                if await self.run_once() >= self.batch:
                    continue
            except psycopg.Error as exc:
                log.warning("timers.failed", error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.every_s)

    def stop(self) -> None:
        self._stopping.set()

    async def run_once(self) -> int:
        """Resume every due job (up to a batch); how many. Every few
        passes, count the ends of maps' children a dead process left
        uncounted."""
        self._passes += 1
        if self._passes % _REPAIR_EVERY == 1:
            await self.checkpoints.children.repair()
        resumed = await self.checkpoints.resume_due(self.batch)
        for job in resumed:
            log.info("job.resumed", job_id=job.job_id, workflow=job.kind, by="timer")
        return len(resumed)
