"""`oncely status`: one look at the stream, the dead letters, the outbox and the jobs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from psycopg_pool import AsyncConnectionPool

from oncely.outbox.store import OutboxCounts, OutboxStore
from oncely.queue.stream import Stream
from oncely.sql import query


@dataclass(frozen=True)
class Consumer:
    name: str
    pending: int
    idle_ms: int


@dataclass(frozen=True)
class Status:
    stream_length: int
    pending: int
    consumers: list[Consumer]
    dead_letters: int
    outbox: OutboxCounts
    jobs: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def read_status(pool: AsyncConnectionPool, stream: Stream) -> Status:
    await stream.ensure_group()
    redis = stream.redis
    pending: Any = await redis.xpending(stream.stream, stream.group)
    consumers: Any = await redis.xinfo_consumers(stream.stream, stream.group)
    async with pool.connection() as conn:
        cur = await conn.execute(query("jobs_by_status"))
        jobs = {"queued": 0, "done": 0, "dead": 0} | {s: int(n) for s, n in await cur.fetchall()}
    return Status(
        stream_length=int(await redis.xlen(stream.stream)),
        pending=int(pending["pending"]),
        consumers=[Consumer(str(c["name"]), int(c["pending"]), int(c["idle"])) for c in consumers],
        dead_letters=int(await redis.xlen(stream.dead)),
        outbox=await OutboxStore(pool).counts(),
        jobs=jobs,
    )
