"""Sending a done job to its shadow variants: after the primary's result
is committed, the job is enqueued on each variant's stream whose sample it
is in, with the primary's result to compare with (docs/shadow.md). The
worker subscribes one per workflow to its jobs' ends
(``oncely.jobs.transitions``); ``oncely.shadow.run`` serves the streams."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from oncely.jobs.transitions import Ended
from oncely.queue.stream import JobMessage, Stream
from oncely.shadow.config import sampled

log = structlog.get_logger("oncely.shadow")

# The message field carrying the primary result (JSON) to compare with.
PRIMARY_FIELD = "primary"


class ShadowDispatch:
    """The shadow variants of one workflow, each with its rate and stream."""

    def __init__(self, workflow: str, shadows: Sequence[tuple[str, float, Stream]]) -> None:
        self.workflow = workflow
        self.shadows = list(shadows)

    async def on_end(self, end: Ended) -> None:
        """A job's end as ``Jobs.transitions`` tells it: a done job of this
        workflow goes to every shadow variant whose sample it is in."""
        if end.status != "done" or end.workflow != self.workflow:
            return
        # A done end carries what the shadow runs need (the handler's).
        assert end.tenant is not None and end.payload is not None and end.result is not None
        await self.after_commit(end.job_id, end.tenant, end.payload, end.result)

    async def after_commit(
        self, job_id: str, tenant: str, payload: Mapping[str, Any], result: Mapping[str, Any]
    ) -> None:
        """Enqueue the job for every shadow variant whose sample it is in.
        Never raises: a failure is logged and that shadow run is skipped."""
        due = [(v, stream) for v, rate, stream in self.shadows if sampled(job_id, rate)]
        if not due:
            return
        primary = json.dumps(result, separators=(",", ":"))
        shadow = JobMessage.new(job_id, tenant, dict(payload))
        for variant, stream in due:
            try:
                await stream.enqueue(shadow, {PRIMARY_FIELD: primary})
            except Exception as exc:
                log.warning(
                    "shadow.enqueue_failed",
                    job_id=job_id,
                    variant=variant,
                    error=f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS],
                )


_ERROR_CHARS = 500
