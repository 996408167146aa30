"""`oncely status`: per workflow, the stream, its dead letters and its jobs;
and the outbox."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from oncely.jobs.store import Jobs
from oncely.outbox.store import OutboxCounts, OutboxStore
from oncely.queue.stream import StreamStats


@dataclass(frozen=True)
class WorkflowStatus:
    workflow: str
    stream: StreamStats
    jobs: dict[str, int]


@dataclass(frozen=True)
class Status:
    workflows: list[WorkflowStatus]
    outbox: OutboxCounts

    def to_json(self) -> dict[str, Any]:
        return {
            "workflows": {
                w.workflow: {
                    "stream_length": w.stream.length,
                    "pending": w.stream.pending,
                    "oldest_pending_age_s": round(w.stream.oldest_pending_age_s, 3),
                    "delayed": w.stream.delayed,
                    "dead_letters": w.stream.dead_letters,
                    "consumers": [asdict(c) for c in w.stream.consumers],
                    "jobs": w.jobs,
                }
                for w in self.workflows
            },
            "outbox": asdict(self.outbox),
        }


async def read_status(jobs: Jobs, outbox: OutboxStore) -> Status:
    counts = await jobs.counts()
    workflows = [
        WorkflowStatus(
            name,
            await stream.stats(),
            counts.get(name, {"queued": 0, "done": 0, "dead": 0}),
        )
        for name, stream in jobs.streams.items()
    ]
    return Status(workflows, await outbox.counts())
