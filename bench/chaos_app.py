"""The chaos soak's app (``oncely --app bench.chaos_app:app``): the two
built-in workflows, unchanged, ``reviews``, a multi-step workflow, and
``support``, the support agent of examples/support_agent.py, unchanged: an
agent whose turns are checkpoints, with a function tool and a call tool
(the refund, a call that answers, sent once by the relay). ``frameworks``
is the same app with that agent written in Pydantic AI instead.

A review has six checkpoints at most, each kind of them:

1. ``model``: a draft, from the model (prompt ``[step=draft] <text>``);
2. ``lookup``: a side step that appends one line to the file named by
   ``CHAOS_SIDE_CALLS`` (job, a token for this run, the process id, the
   time it started), then takes ``LOOKUP_S``, so a SIGKILL lands in the
   middle of one now and then; its value is the token and the process id,
   so the soak knows which run's value was kept;
3. the webhook ``review.requested`` (emitted: written with the next checkpoint);
4. ``approval``: waits for the ``approval`` event, at most ``wait_s``;
5. ``sleep``: sleeps ``sleep_s`` when the request asks for it;
6. ``model#2``: the final answer, from the model (prompt ``[step=final]
   <text> Verdict: …`` and the request's ``fate``, a fake-model directive
   only this call sees), then the webhook ``review.decided`` with the result.

Every prompt starts with its step's tag and carries the request's marker,
so the fake model's per-prompt counts are per job and per model call.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

from examples.support_agent import workflow as support
from pydantic import BaseModel, Field

from oncely import App, Context, Workflow, webhook
from oncely.builtin.summaries import summaries
from oncely.builtin.triage import triage

# The file every side step appends to (one JSON line per run).
SIDE_CALLS = "CHAOS_SIDE_CALLS"
# How long a side step takes after it has written its line.
LOOKUP_S = 0.2
REVIEW_REQUESTED = "review.requested"
REVIEW_DECIDED = "review.decided"
ROUTE = "/v1/reviews"


class ReviewRequest(BaseModel):
    text: str = Field(min_length=1, max_length=2000)
    # How long to wait for the approval; then the review goes on without one.
    wait_s: float = Field(ge=0, le=3600)
    # A durable sleep after the wait (0: none).
    sleep_s: float = Field(0.0, ge=0, le=600)
    # Appended to the final model call's prompt only (a fake-model directive).
    fate: str = Field("", max_length=100)


class Approval(BaseModel):
    approved: bool
    by: str = Field(min_length=1, max_length=100)


class Review(BaseModel):
    draft: str
    # The token of the side step's run whose value was kept.
    lookup: str
    approved: bool | None
    by: str | None
    final: str


def prompt(step: str, text: str) -> str:
    """A model call's prompt: its step's tag first (the fake model's excerpt
    keeps the first 80 characters)."""
    return f"[step={step}] {text}"


def verdict(approval: Approval | None) -> str:
    if approval is None:
        return "no answer in time"
    return f"{'approved' if approval.approved else 'rejected'} by {approval.by}"


def side_call_line(job_id: str, run: str) -> dict[str, Any]:
    return {"job_id": job_id, "run": run, "pid": os.getpid(), "at": time.time()}


async def lookup(job_id: str) -> dict[str, Any]:
    """The side step: noted in the side-call file as it starts, then some work."""
    run = uuid.uuid4().hex
    path = os.environ.get(SIDE_CALLS)
    if path:
        # One write of one short line in append mode: lines of concurrent
        # runs never mix. Before any await, so ``at`` is when the run began.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(side_call_line(job_id, run)) + "\n").encode())
        finally:
            os.close(fd)
    await asyncio.sleep(LOOKUP_S)
    return {"run": run, "pid": os.getpid()}


async def review(request: ReviewRequest, ctx: Context) -> Review:
    draft = await ctx.model.complete(prompt("draft", request.text))
    found = await ctx.step("lookup", lookup, ctx.job_id)
    ctx.emit(REVIEW_REQUESTED, {"job_id": ctx.job_id, "draft": draft})
    approval = await ctx.wait_for_event("approval", Approval, timeout=request.wait_s)
    if request.sleep_s > 0:
        await ctx.sleep(request.sleep_s)
    asked = f"{request.text} Verdict: {verdict(approval)}. {request.fate}".rstrip()
    final = await ctx.model.complete(prompt("final", asked))
    result = Review(
        draft=draft,
        lookup=str(found["run"]),
        approved=None if approval is None else approval.approved,
        by=None if approval is None else approval.by,
        final=final,
    )
    decided = {"job_id": ctx.job_id, "approved": result.approved, "by": result.by, "final": final}
    ctx.emit(REVIEW_DECIDED, decided)
    return result


reviews = Workflow(
    name="reviews",
    route=ROUTE,
    request=ReviewRequest,
    result=Review,
    step=review,
    effects=[webhook(REVIEW_REQUESTED), webhook(REVIEW_DECIDED)],
    events={"approval": Approval},
    summary="Draft a review, ask for an approval, then decide",
)

app = App([summaries, triage, reviews, support])


def __getattr__(name: str) -> App:
    """``frameworks`` (``--app bench.chaos_app:frameworks``): the same app
    with the support agent written in Pydantic AI
    (examples/pydantic_ai_support.py) in place of oncely's. Not beside it:
    a call's topic is one workflow's, and both call ``refund.issue``. Built
    when asked for, so the default app's processes import no framework."""
    if name == "frameworks":
        from examples.pydantic_ai_support import workflow as pai_support

        return App([summaries, triage, reviews, pai_support])
    raise AttributeError(name)
