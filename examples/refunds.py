"""Refund approval: a refund request in, a decision out, one signed webhook.

Run it with every oncely command: ``oncely --app examples.refunds:app dev``.
"""

from typing import Literal

from pydantic import BaseModel, Field

import oncely


class RefundRequest(BaseModel):
    order_id: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(gt=0, le=10_000_000)
    reason: str = Field(min_length=1, max_length=5_000)


class RefundDecision(BaseModel):
    decision: Literal["approve", "deny", "escalate"]
    note: str


POLICY = (
    "You review refund requests for an online shop. Approve clear cases of a "
    "damaged, missing or wrong item; deny requests outside the 30-day window; "
    "escalate anything else. Answer with the decision and a one-line note."
)


async def review(refund: RefundRequest, ctx: oncely.Context) -> RefundDecision:
    decision = await ctx.model.structured(
        RefundDecision,
        f"Order {refund.order_id}, {refund.amount_cents / 100:.2f} EUR.\n\n{refund.reason}",
        system=POLICY,
    )
    # Stored with the decision, in one transaction; delivered once.
    ctx.emit(
        "refund.decided",
        {"job_id": ctx.job_id, "order_id": refund.order_id, **decision.model_dump()},
    )
    return decision


refunds = oncely.Workflow(
    name="refunds",
    route="/v1/refunds",
    request=RefundRequest,
    result=RefundDecision,
    step=review,
    effects=[oncely.webhook("refund.decided")],
    summary="Ask for a refund decision",
)

app = oncely.App([refunds])
