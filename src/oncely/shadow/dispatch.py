"""Sending a done job to its shadow variants: after the primary's result
is committed, the job is enqueued on each variant's stream whose sample it
is in, with the primary's result to compare with (docs/shadow.md). The
worker's handler holds one; ``oncely.shadow.run`` serves the streams."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from oncely.queue.stream import JobMessage, Stream
from oncely.shadow.config import sampled

log = structlog.get_logger("oncely.shadow")

# The message field carrying the primary result (JSON) to compare with.
PRIMARY_FIELD = "primary"


class ShadowDispatch:
    """The shadow variants of one workflow, each with its rate and stream."""

    def __init__(self, shadows: Sequence[tuple[str, float, Stream]]) -> None:
        self.shadows = list(shadows)

    async def after_commit(self, message: JobMessage, result: Mapping[str, Any]) -> None:
        """Enqueue the job for every shadow variant whose sample it is in.
        Never raises: a failure is logged and that shadow run is skipped."""
        due = [(v, stream) for v, rate, stream in self.shadows if sampled(message.job_id, rate)]
        if not due:
            return
        primary = json.dumps(result, separators=(",", ":"))
        shadow = JobMessage.new(message.job_id, message.tenant, message.payload)
        for variant, stream in due:
            try:
                await stream.enqueue(shadow, {PRIMARY_FIELD: primary})
            except Exception as exc:
                log.warning(
                    "shadow.enqueue_failed",
                    job_id=message.job_id,
                    variant=variant,
                    error=f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS],
                )


_ERROR_CHARS = 500
