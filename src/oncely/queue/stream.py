"""Stream messages and enqueueing.

Every XADD also records ``job_id -> entry id`` in the stream's index hash, in
the same Lua call (one round trip). Acknowledging removes the entry from the
index, so the reconciler can tell a job still waiting in the stream from one
whose message was lost with Redis' data.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from oncely import names

# KEYS[1] stream, KEYS[2] index; ARGV: job_id, tenant, payload, enqueued_at
_ENQUEUE = """
local id = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], 'tenant', ARGV[2],
                      'payload', ARGV[3], 'enqueued_at', ARGV[4])
redis.call('HSET', KEYS[2], ARGV[1], id)
return id
"""


@dataclass(frozen=True)
class JobMessage:
    job_id: str
    tenant: str
    payload: dict[str, Any]
    enqueued_at: float

    @classmethod
    def new(cls, job_id: str, tenant: str, payload: dict[str, Any]) -> JobMessage:
        return cls(job_id, tenant, payload, time.time())

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> JobMessage:
        return cls(
            job_id=fields["job_id"],
            tenant=fields["tenant"],
            payload=json.loads(fields["payload"]),
            enqueued_at=float(fields["enqueued_at"]),
        )


class Stream:
    """One job stream: ``stream`` with its ``dead`` letters, ``index`` and ``group``."""

    def __init__(
        self,
        redis: Redis,
        *,
        stream: str = names.SUMMARIES_STREAM,
        dead: str = names.SUMMARIES_DEAD,
        index: str = names.SUMMARIES_INDEX,
        group: str = names.SUMMARIES_GROUP,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.dead = dead
        self.index = index
        self.group = group
        self._enqueue = redis.register_script(_ENQUEUE)

    async def enqueue(self, message: JobMessage) -> str:
        """XADD the message and index it; return the entry id."""
        args = [
            message.job_id,
            message.tenant,
            json.dumps(message.payload, separators=(",", ":")),
            f"{message.enqueued_at:.6f}",
        ]
        entry_id = await self._enqueue(keys=[self.stream, self.index], args=args)
        return str(entry_id)
