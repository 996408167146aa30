"""`oncely status`: per workflow, the stream, its dead letters and its jobs;
per shadow variant, its stream and dead letters; and the outbox."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from oncely.jobs.records import JOB_STATUSES
from oncely.jobs.store import Jobs
from oncely.outbox.store import OutboxCounts, OutboxStore
from oncely.queue.stream import Stream, StreamStats


@dataclass(frozen=True)
class WorkflowStatus:
    workflow: str
    stream: StreamStats
    jobs: dict[str, int]


@dataclass(frozen=True)
class Status:
    workflows: list[WorkflowStatus]
    outbox: OutboxCounts
    # <workflow>:shadow:<variant> -> its stream (ONCELY_SHADOW).
    shadows: dict[str, StreamStats] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "workflows": {
                w.workflow: {**_stream_json(w.stream), "jobs": w.jobs} for w in self.workflows
            },
            "shadows": {name: _stream_json(s) for name, s in self.shadows.items()},
            "outbox": asdict(self.outbox),
        }


def _stream_json(s: StreamStats) -> dict[str, Any]:
    return {
        "stream_length": s.length,
        "pending": s.pending,
        "oldest_pending_age_s": round(s.oldest_pending_age_s, 3),
        "delayed": s.delayed,
        "dead_letters": s.dead_letters,
        "consumers": [asdict(c) for c in s.consumers],
    }


async def read_status(
    jobs: Jobs, outbox: OutboxStore, shadows: Mapping[str, Stream] | None = None
) -> Status:
    counts = await jobs.counts()
    workflows = [
        WorkflowStatus(
            name,
            await stream.stats(),
            counts.get(name, dict.fromkeys(JOB_STATUSES, 0)),
        )
        for name, stream in jobs.streams.items()
    ]
    shadow_stats = {name: await stream.stats() for name, stream in (shadows or {}).items()}
    return Status(workflows, await outbox.counts(), shadow_stats)
