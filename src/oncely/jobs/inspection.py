"""One job as an operator sees it, for the console's job page and
``oncely jobs show``: the row with its request and result, its checkpoints
(with their values) and what it waits for, its deliveries, its outbox rows,
and where its message is in Redis now.

The deliveries are the ones that reported back (``job_deliveries``). A
delivery whose worker was killed mid-job never reports: it has no row, its
number is skipped, and while its message is pending Redis still counts it
(``Whereabouts.entry_deliveries``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions

from oncely.jobs.checkpoints import Checkpoints
from oncely.jobs.children import MapCounts
from oncely.jobs.records import DeliveryRecord, JobDetail
from oncely.jobs.store import Jobs
from oncely.journal import Checkpoint
from oncely.outbox.store import OutboxRow, OutboxStore
from oncely.queue.stream import Whereabouts
from oncely.usage.totals import summed
from oncely.views import waiting_of

UNREPORTED_NOTE = (
    "A delivery whose worker was killed mid-job never reports: it is not listed and its "
    "number is skipped. Numbers start again at 1 when the job is replayed or restored."
)


@dataclass(frozen=True)
class JobInspection:
    job: JobDetail
    deliveries: list[DeliveryRecord]
    outbox: list[OutboxRow]
    # None: the workflow is not in this app, or Redis did not answer.
    whereabouts: Whereabouts | None
    # In the order the run reached them, with their values.
    checkpoints: list[Checkpoint]
    # Its maps (``ctx.map``), oldest first, with what their children count.
    maps: list[MapCounts] = field(default_factory=list)

    @property
    def usage(self) -> dict[str, Any] | None:
        """What its model calls spent, as GET says it: the result's, or, for
        a job not done (waiting, dead, cancelled), its checkpoints' summed."""
        if self.job.usage is not None:
            return dict(self.job.usage)
        parts = [c.usage for c in self.checkpoints if c.usage]
        return summed(parts) if parts else None

    @property
    def status(self) -> str:
        """The job's status as GET says it: ``running`` while a worker holds
        a queued job (its message in flight), docs/streaming.md."""
        held = self.whereabouts is not None and self.whereabouts.state == "in_flight"
        return "running" if self.job.status == "queued" and held else self.job.status

    def to_json(self) -> dict[str, Any]:
        j = self.job
        w = self.whereabouts
        return {
            "job_id": str(j.job_id),
            "workflow": j.kind,
            "tenant": j.tenant,
            "status": self.status,
            "request": j.payload,
            "result": j.result,
            "usage": self.usage,
            "error": j.error,
            "created_at": j.created_at.isoformat(),
            "updated_at": j.updated_at.isoformat(),
            "waiting": (
                {**waiting_of(j), "until": j.wait_until.isoformat()}
                if j.status == "waiting" and j.wait_until is not None
                else None
            ),
            "checkpoints": [_checkpoint_json(c) for c in self.checkpoints],
            "parent": None if j.parent_id is None else str(j.parent_id),
            "maps": [
                {"key": m.key, "workflow": m.workflow, "finished": m.finished, **m.to_json()}
                for m in self.maps
            ],
            "deliveries": [
                {
                    "delivery": d.delivery,
                    "outcome": d.outcome,
                    "consumer": d.consumer,
                    "started_at": d.started_at.isoformat(),
                    "finished_at": d.finished_at.isoformat(),
                    "error": d.error,
                    "model_calls": d.model_calls,
                }
                for d in self.deliveries
            ],
            "message": None if w is None else _message_json(w),
            "outbox": [
                {
                    "id": r.id,
                    "topic": r.topic,
                    "dedupe_key": r.dedupe_key,
                    "attempts": r.attempts,
                    "last_error": r.last_error,
                    "sent_at": None if r.sent_at is None else r.sent_at.isoformat(),
                    "failed_at": None if r.failed_at is None else r.failed_at.isoformat(),
                }
                for r in self.outbox
            ],
        }


def _checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    return {
        "key": c.key,
        "ordinal": c.ordinal,
        "kind": c.kind,
        "status": c.status,
        "value": c.value,
        "usage": c.usage,
        "until": None if c.until is None else c.until.isoformat(),
        "finished_at": None if c.finished_at is None else c.finished_at.isoformat(),
        "with_result": c.with_result,
    }


def _message_json(w: Whereabouts) -> dict[str, Any]:
    return {
        "state": w.state,
        "entry_id": w.entry_id,
        "delivery": w.delivery,
        "consumer": w.consumer,
        "idle_ms": w.idle_ms if w.state == "in_flight" else None,
        "entry_deliveries": w.entry_deliveries if w.state == "in_flight" else None,
        "due_at": w.due_at,
        "last_error": w.fields.get("last_error"),
    }


async def inspect_job(
    jobs: Jobs, outbox: OutboxStore, workflow: str | None, job_id: uuid.UUID
) -> JobInspection | None:
    """The job of ``workflow`` (any when None) with everything known about
    it; None if there is no such job."""
    job = await jobs.detail(workflow, job_id)
    if job is None:
        return None
    stream = jobs.streams.get(job.kind)
    whereabouts = None
    if stream is not None:
        try:
            whereabouts = await stream.whereabouts(str(job_id))
        except redis.exceptions.RedisError:
            whereabouts = None  # the rows are worth showing without it
    checkpoints = Checkpoints(jobs)
    stored = await checkpoints.of_job(job_id)
    deliveries, rows = await jobs.deliveries(job_id), await outbox.for_job(job_id)
    maps = await checkpoints.children.counts(str(job_id))
    return JobInspection(job, deliveries, rows, whereabouts, stored, maps)
