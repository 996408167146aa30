"""Retention: finished jobs, their results and their sent outbox rows are
deleted once older than ``ONCELY_JOB_RETENTION_S`` (docs/settings.md).

Every worker process runs a pass now and then; passes side by side take
different rows (``SKIP LOCKED``), and each deletes in bounded batches so it
never holds many row locks. A job with an effect not yet delivered is kept.
"""

from __future__ import annotations

import asyncio
import contextlib

import psycopg
import structlog

from oncely.jobs.store import Jobs

log = structlog.get_logger("oncely.retention")


class Retention:
    def __init__(
        self, jobs: Jobs, *, retention_s: float, every_s: float = 300.0, batch: int = 1000
    ) -> None:
        self.jobs = jobs
        self.retention_s = retention_s
        self.every_s = every_s
        self.batch = batch
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.run_once()
            except psycopg.Error as exc:
                log.warning("retention.failed", error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.every_s)

    def stop(self) -> None:
        self._stopping.set()

    async def run_once(self) -> int:
        deleted = await self.jobs.purge_finished(self.retention_s, self.batch)
        if deleted:
            log.info("retention.purged", jobs=deleted)
        return deleted
