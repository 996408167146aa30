"""Refund approval: the model reviews a refund request; a clear case is
decided at once, an unclear one is escalated to a person, who has 48 hours
to answer. One signed webhook asks for the approval, one announces the
decision, each delivered once.

Run it with every oncely command: ``oncely --app examples.refunds:app dev``.
The tutorial (docs/tutorial.md) sends it a request and an approval with curl.
"""

from datetime import timedelta
from typing import Literal

from pydantic import BaseModel, Field

import oncely

POLICY = (
    "You review refund requests for an online shop. Approve clear cases of a "
    "damaged, missing or wrong item; deny requests outside the 30-day window; "
    "escalate anything else to a person. Answer with the decision and a one-line note."
)
# How long an escalated refund waits for a person before it is denied.
APPROVAL_WAIT = timedelta(hours=48)


class RefundRequest(BaseModel):
    order_id: str = Field(min_length=1, max_length=64, examples=["A-1001"])
    amount_cents: int = Field(gt=0, le=10_000_000, examples=[4999])
    reason: str = Field(min_length=1, max_length=5_000, examples=["It arrived broken."])


class Review(BaseModel):
    """What the model answers."""

    decision: Literal["approve", "deny", "escalate"]
    note: str


class Approval(BaseModel):
    """What a person sends: POST /v1/refunds/{job_id}/events/approval."""

    approved: bool
    by: str = Field(min_length=1, max_length=100)
    note: str = Field("", max_length=1_000)


class RefundDecision(BaseModel):
    decision: Literal["approve", "deny"]
    note: str
    decided_by: Literal["model", "person", "timeout"]


async def decide(refund: RefundRequest, ctx: oncely.Context) -> RefundDecision:
    # A checkpoint: once answered, never paid for again for this job.
    review = await ctx.model.structured(Review, describe(refund), system=POLICY)
    if review.decision == "escalate":
        # Written with the wait, in one transaction; delivered once.
        ctx.emit(
            "refund.approval_requested",
            {"job_id": ctx.job_id, "order_id": refund.order_id, "note": review.note},
        )
        # The job waits here holding nothing; the event (or 48 h) resumes it.
        approval = await ctx.wait_for_event("approval", Approval, timeout=APPROVAL_WAIT)
        decision = by_person(approval, review)
    else:
        decision = RefundDecision(decision=review.decision, note=review.note, decided_by="model")
    ctx.emit(
        "refund.decided",
        {"job_id": ctx.job_id, "order_id": refund.order_id, **decision.model_dump()},
    )
    return decision


def describe(refund: RefundRequest) -> str:
    """The request as the model reads it."""
    return f"Order {refund.order_id}, {refund.amount_cents / 100:.2f} EUR.\n\n{refund.reason}"


def by_person(approval: Approval | None, review: Review) -> RefundDecision:
    """A person's decision, or a denial when none came in time."""
    if approval is None:
        return RefundDecision(
            decision="deny", note="no approval within 48 hours", decided_by="timeout"
        )
    return RefundDecision(
        decision="approve" if approval.approved else "deny",
        note=approval.note or review.note,
        decided_by="person",
    )


refunds = oncely.Workflow(
    name="refunds",
    route="/v1/refunds",
    request=RefundRequest,
    result=RefundDecision,
    step=decide,
    effects=[oncely.webhook("refund.approval_requested"), oncely.webhook("refund.decided")],
    events={"approval": Approval},
    summary="Ask for a refund decision",
)

app = oncely.App([refunds])
