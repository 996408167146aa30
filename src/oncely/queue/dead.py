"""Dead letters: list them, and replay them into the stream for a person.

A dead entry keeps the original message fields plus ``original_id``,
``reason``, ``deliveries``, ``last_error`` and ``dead_at``. Replaying sets
the job back to ``queued`` (Postgres first, the record of acceptance), adds
a fresh message with the same job id, then deletes the dead entry; a crash
in between leaves a duplicate that collapses downstream, never a lost job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from psycopg_pool import AsyncConnectionPool

from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query

log = structlog.get_logger("oncely.dlq")


@dataclass(frozen=True)
class DeadLetter:
    dead_id: str
    job_id: str
    reason: str
    deliveries: int
    last_error: str
    original_id: str
    dead_at: float

    @classmethod
    def from_entry(cls, dead_id: str, fields: dict[str, str]) -> DeadLetter:
        return cls(
            dead_id=dead_id,
            job_id=fields.get("job_id", ""),
            reason=fields.get("reason", ""),
            deliveries=int(fields.get("deliveries", "0")),
            last_error=fields.get("last_error", ""),
            original_id=fields.get("original_id", ""),
            dead_at=float(fields.get("dead_at", "0")),
        )


async def list_dead(stream: Stream, limit: int = 100) -> list[DeadLetter]:
    """Newest first."""
    entries: Any = await stream.redis.xrevrange(stream.dead, count=limit)
    return [DeadLetter.from_entry(i, f) for i, f in entries]


async def replay(pool: AsyncConnectionPool, stream: Stream, dead_id: str) -> str | None:
    """Put one dead letter back in the stream; returns its job id (None if unknown)."""
    entries: Any = await stream.redis.xrange(stream.dead, min=dead_id, max=dead_id)
    if not entries:
        return None
    fields: dict[str, str] = entries[0][1]
    message = JobMessage.from_fields(fields)
    async with pool.connection() as conn:
        await conn.execute(query("mark_job_requeued"), (message.job_id,))
    await stream.enqueue(JobMessage.new(message.job_id, message.tenant, message.payload))
    await stream.redis.xdel(stream.dead, dead_id)
    log.info("dlq.replayed", job_id=message.job_id, dead_id=dead_id)
    return message.job_id


async def replay_all(pool: AsyncConnectionPool, stream: Stream) -> list[str]:
    replayed = []
    while batch := await list_dead(stream, 100):
        for letter in batch:
            job_id = await replay(pool, stream, letter.dead_id)
            if job_id is not None:
                replayed.append(job_id)
    return replayed
