"""`oncely status`: per workflow, the stream, its dead letters and its jobs;
per shadow variant, its stream and dead letters; the outbox; and clocks:
this command's and each running process's against PostgreSQL's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from psycopg_pool import AsyncConnectionPool

from oncely import clock
from oncely.clock import ClockOffset, ProcessClock
from oncely.jobs.store import Jobs
from oncely.outbox.store import OutboxCounts, OutboxStore
from oncely.queue.stream import Stream, StreamStats
from oncely.redis_client import RedisClient
from oncely.statuses import ROW_STATUSES


@dataclass(frozen=True)
class WorkflowStatus:
    workflow: str
    stream: StreamStats
    jobs: dict[str, int]


@dataclass(frozen=True)
class Clocks:
    """This command's clock against PostgreSQL's (None: not measured), and
    every running process's as it last reported it (``oncely.clock``)."""

    here: ClockOffset | None = None
    processes: list[ProcessClock] = field(default_factory=list)

    def warnings(self) -> list[str]:
        found = [
            ClockOffset(p.offset_s).warning(f"the clock of {p.process}")
            for p in self.processes
            if ClockOffset(p.offset_s).skewed
        ]
        if self.here is not None and self.here.skewed:
            found.append(self.here.warning("this machine's clock"))
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "offset_s": None if self.here is None else round(self.here.offset_s, 3),
            "processes": {p.process: p.offset_s for p in self.processes},
            "warnings": self.warnings(),
        }


@dataclass(frozen=True)
class Status:
    workflows: list[WorkflowStatus]
    outbox: OutboxCounts
    # <workflow>:shadow:<variant> -> its stream (ONCELY_SHADOW).
    shadows: dict[str, StreamStats] = field(default_factory=dict)
    clocks: Clocks = field(default_factory=Clocks)

    def to_json(self) -> dict[str, Any]:
        return {
            "workflows": {
                w.workflow: {**_stream_json(w.stream), "jobs": w.jobs} for w in self.workflows
            },
            "shadows": {name: _stream_json(s) for name, s in self.shadows.items()},
            "outbox": asdict(self.outbox),
            "clocks": self.clocks.to_json(),
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
    jobs: Jobs,
    outbox: OutboxStore,
    shadows: Mapping[str, Stream] | None = None,
    clocks: Clocks | None = None,
) -> Status:
    counts = await jobs.counts()
    workflows = [
        WorkflowStatus(
            name,
            await stream.stats(),
            counts.get(name, dict.fromkeys(ROW_STATUSES, 0)),
        )
        for name, stream in jobs.streams.items()
    ]
    shadow_stats = {name: await stream.stats() for name, stream in (shadows or {}).items()}
    return Status(workflows, await outbox.counts(), shadow_stats, clocks or Clocks())


async def read_clocks(pool: AsyncConnectionPool, redis: RedisClient, *, timeout_s: float) -> Clocks:
    """This command's clock measured now; the processes' last reports (those
    of the last ``REPORT_KEPT_S``, by PostgreSQL's time)."""
    here = await clock.measure(pool, timeout_s=timeout_s)
    now = clock.local_now().timestamp() - here.offset_s
    return Clocks(here, clock.recent(await clock.read_reports(redis), now))
