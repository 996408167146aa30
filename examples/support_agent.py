"""A support agent: the model reads a customer's message, looks the order up,
refunds through the shop's refund service (a call that answers, sent exactly
once) and replies by email. A refund above 50.00 waits for a person's
approval first; the job holds no worker while it waits.

Run it with every oncely command: ``oncely --app examples.support_agent:app dev``.
docs/agents.md drives it end to end with curl, and examples/test_support_agent.py
tests it with ``oncely.testing``.

What happens once, and what at least once (docs/agents.md): each model turn
is paid for once per job; ``lookup_order`` may run again after a crash
before its answer was stored (it only reads); the refund is a call the relay
sends once under a stable key, which the refund service dedupes on, so the
customer is refunded once whatever crashes; the reply is one email.
"""

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, EmailStr, Field

import oncely

INSTRUCTIONS = (
    "You are the support desk of an online shop. Look the customer's order up "
    "before you answer. Refund a damaged, missing or wrong item in full; refund "
    "nothing for an order older than 30 days. Then answer the customer in two "
    "or three friendly sentences."
)
# Refunds above this wait for a person's approval.
APPROVAL_ABOVE_CENTS = 5_000

# The shop's orders, as a read-only lookup would find them.
ORDERS: dict[str, dict[str, Any]] = {
    "A-1001": {"item": "teapot", "total_cents": 4_200, "days_ago": 3, "status": "delivered"},
    "A-1002": {"item": "armchair", "total_cents": 38_900, "days_ago": 5, "status": "delivered"},
    "A-0999": {"item": "kettle", "total_cents": 2_900, "days_ago": 45, "status": "delivered"},
}


class SupportRequest(BaseModel):
    customer: EmailStr = Field(examples=["ada@example.com"])
    message: str = Field(min_length=1, max_length=5_000, examples=["My teapot A-1001 broke."])


class SupportReply(BaseModel):
    reply: str
    refunded_cents: int
    tool_calls: list[str]


class RefundArgs(BaseModel):
    """What the model fills in to refund."""

    order_id: str = Field(min_length=1, max_length=64)
    cents: int = Field(gt=0, le=10_000_000)
    reason: str = Field(min_length=1, max_length=500)


class Refunded(BaseModel):
    """What the refund service answers (the fake provider's shape: its
    ``data`` is what it was sent)."""

    ok: bool
    id: str


@oncely.tool
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up by its id: the item, the total in cents, how many
    days ago it was delivered, and its status."""
    order = ORDERS.get(order_id.strip().upper())
    if order is None:
        # The model is told, and can ask the customer again.
        raise oncely.PermanentError(f"no order {order_id!r}")
    return {"order_id": order_id, **order}


refund = oncely.call_tool(
    "refund.issue",
    args=RefundArgs,
    name="refund",
    description="Refund part or all of an order, in cents, with the reason.",
    approval=lambda args: args.cents > APPROVAL_ABOVE_CENTS,
)

support = oncely.Agent(
    "support",
    INSTRUCTIONS,
    tools=[lookup_order, refund],
    max_turns=8,
    approval_timeout=timedelta(hours=48),
)


def render_reply(payload: Any) -> oncely.Email:
    return oncely.Email(to=payload["customer"], subject="About your order", text=payload["reply"])


async def answer(request: SupportRequest, ctx: oncely.Context) -> SupportReply:
    run = await support.run(ctx, request.message)
    refunded = sum(
        int(call.arguments["cents"])
        for call in run.tool_calls
        if call.tool == "refund" and call.status == "ok" and call.arguments
    )
    reply = str(run.output)
    # Written with the result, in one transaction; delivered once.
    ctx.emit("support.reply", {"customer": request.customer, "reply": reply})
    return SupportReply(
        reply=reply,
        refunded_cents=refunded,
        tool_calls=[f"{c.tool}:{c.status}" for c in run.tool_calls],
    )


workflow = oncely.Workflow(
    name="support",
    route="/v1/support",
    request=SupportRequest,
    result=SupportReply,
    step=answer,
    effects=[
        oncely.webhook("refund.issue", returns=Refunded),
        oncely.webhook("approval.requested"),
        oncely.email("support.reply", render_reply),
    ],
    agents=[support],
    summary="A support agent that looks orders up, refunds once and replies.",
)

app = oncely.App([workflow])
