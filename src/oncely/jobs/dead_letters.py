"""Dead letters for a person: list them, and replay them.

Replaying sets the job back to ``queued`` (PostgreSQL first, the record of
acceptance), adds a fresh message with the same job id, then deletes the
dead entry; a crash in between leaves a duplicate that collapses downstream,
never a lost job.
"""

from __future__ import annotations

import structlog

from oncely.jobs.store import Job, Jobs
from oncely.queue.stream import DeadLetter

log = structlog.get_logger("oncely.dlq")


async def replay(jobs: Jobs, workflow: str, dead_id: str) -> str | None:
    """Put one dead letter back in its stream; its job id (None if unknown)."""
    stream = jobs.streams[workflow]
    letter = await stream.dead_letter_by_id(dead_id)
    if letter is None:
        return None
    message = letter.message()
    await jobs.replay(Job(message.job_id, message.tenant, workflow, message.payload))
    await stream.forget_dead_letter(dead_id)
    log.info("dlq.replayed", workflow=workflow, job_id=message.job_id, dead_id=dead_id)
    return message.job_id


async def replay_all(jobs: Jobs, workflow: str) -> list[str]:
    replayed = []
    while batch := await jobs.streams[workflow].dead_letters(100):
        for letter in batch:
            job_id = await replay(jobs, workflow, letter.dead_id)
            if job_id is not None:
                replayed.append(job_id)
    return replayed


async def list_dead(jobs: Jobs, workflow: str, limit: int = 100) -> list[DeadLetter]:
    return await jobs.streams[workflow].dead_letters(limit)
