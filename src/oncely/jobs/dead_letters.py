"""Dead letters for a person: list them, and replay them.

A dead letter is a dead job: PostgreSQL is the record, so the lists and the
replays read the ``jobs`` table, and survive Redis losing its data. Each
workflow's dead stream in Redis (written by the worker as it gives up on a
message) only mirrors them: a replay deletes the job's entries there too.

Replaying sets the job back to ``queued`` in a new generation (PostgreSQL
first, the record of acceptance), then adds a fresh message with the same
job id; a crash in between leaves a queued row the reconciler enqueues,
never a lost job.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import structlog

from oncely.jobs.records import DeadJob, JobSpec
from oncely.jobs.store import Jobs
from oncely.views import tenant_error

log = structlog.get_logger("oncely.dlq")


@dataclass(frozen=True)
class DeadLetter:
    """A dead job as the dead-letter list shows it. ``dead_id`` is its job id
    (what ``replay`` takes)."""

    workflow: str
    job_id: str
    tenant: str
    # The stable reason (``permanent``, ``max_age``, ``nondeterministic``, …).
    reason: str
    last_error: str
    deliveries: int
    dead_at: datetime

    @property
    def dead_id(self) -> str:
        return self.job_id

    @classmethod
    def of(cls, job: DeadJob) -> DeadLetter:
        error = job.error or ""
        reason, _, detail = error.partition(":")
        return cls(
            workflow=job.kind,
            job_id=str(job.job_id),
            tenant=job.tenant,
            reason=tenant_error(error) or "failed",
            last_error=detail.strip() if reason.strip() == tenant_error(error) else error,
            deliveries=job.deliveries,
            dead_at=job.dead_at,
        )


async def list_dead(jobs: Jobs, workflow: str, limit: int = 100) -> list[DeadLetter]:
    """The workflow's dead letters, newest first."""
    return [DeadLetter.of(job) for job in await jobs.dead(workflow, limit)]


async def replay(jobs: Jobs, workflow: str | None, dead_id: str) -> JobSpec | None:
    """Put one dead job back in its stream (of ``workflow``, or any); the
    job, or None if there is no such dead job. ``dead_id`` is the job id, or
    the id of a dead entry in Redis (what earlier versions listed)."""
    job_id = await _job_id(jobs, workflow, dead_id)
    if job_id is None:
        return None
    job = await jobs.dead_job(job_id, workflow)
    if job is None:
        return None
    await jobs.replay(job)
    await jobs.streams[job.kind].forget_dead_letters({job.job_id})
    log.info("dlq.replayed", workflow=job.kind, job_id=job.job_id)
    return job


async def replay_all(jobs: Jobs, workflow: str) -> list[str]:
    """Replay every dead job of the workflow; their ids. Each once: a job
    that dies again while this runs (a worker is serving it) stays dead."""
    replayed: list[str] = []
    seen: set[str] = set()
    while batch := [d for d in await jobs.dead(workflow, 500) if str(d.job_id) not in seen]:
        for dead in batch:
            seen.add(str(dead.job_id))
            job = await jobs.dead_job(dead.job_id, workflow)
            if job is not None:
                await jobs.replay(job)
                replayed.append(job.job_id)
                log.info("dlq.replayed", workflow=workflow, job_id=job.job_id)
    if replayed:
        await jobs.streams[workflow].forget_dead_letters(set(replayed))
    return replayed


async def _job_id(jobs: Jobs, workflow: str | None, dead_id: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(dead_id)
    except ValueError:
        pass
    streams = [jobs.streams[workflow]] if workflow else list(jobs.streams.values())
    for stream in streams:
        letter = await stream.dead_letter_by_id(dead_id)
        if letter is not None:
            try:
                return uuid.UUID(letter.job_id)
            except ValueError:
                return None
    return None
