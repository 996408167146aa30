"""Workflows on the cheaper lanes (docs/lanes.md), for
tests/test_lanes_processes.py: ``digest`` on the batch lane, ``nightly`` on
the flex lane, one model call each.

``ONCELY_TEST_BATCH_KILL`` kills the worker (SIGKILL, its own) at a point
of its first batch: ``gathered`` (the lines' batch id stored, the batch
not created) or ``created`` (created at the provider, its id not
recorded): the fault-injection hook of the crash tests."""

from __future__ import annotations

import os
import signal
from typing import Any

from pydantic import BaseModel

from oncely import App, Context, Workflow
from oncely.llm.batches import Batcher

KILL = "ONCELY_TEST_BATCH_KILL"


class Text(BaseModel):
    text: str


class Summary(BaseModel):
    summary: str


async def summarise(request: Text, ctx: Context) -> Summary:
    return Summary(summary=await ctx.model.complete(request.text))


digest = Workflow("digest", "/v1/digest", Text, Summary, summarise, lane="batch")
nightly = Workflow("nightly", "/v1/nightly", Text, Summary, summarise, lane="flex")
app = App([digest, nightly])


def _killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


_submit, _record = Batcher.submit, Batcher.record


async def _submit_then_maybe_die(self: Batcher, api: Any, batch_id: str, lines: Any) -> str:
    if os.environ.get(KILL) == "gathered":
        _killed()
    return await _submit(self, api, batch_id, lines)


async def _record_or_die(self: Batcher, batch_id: str, provider_id: str) -> None:
    if os.environ.get(KILL) == "created":
        _killed()
    await _record(self, batch_id, provider_id)


if os.environ.get(KILL):
    Batcher.submit = _submit_then_maybe_die  # type: ignore[method-assign]
    Batcher.record = _record_or_die  # type: ignore[method-assign]
