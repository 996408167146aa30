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

import oncely
from examples.shop import (
    APPROVAL_ABOVE_CENTS,
    INSTRUCTIONS,
    RefundArgs,
    Refunded,
    SupportReply,
    SupportRequest,
    find_order,
    render_reply,
)


@oncely.tool
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up by its id: the item, the total in cents, how many
    days ago it was delivered, and its status."""
    order = find_order(order_id)
    if order is None:
        # The model is told, and can ask the customer again.
        raise oncely.PermanentError(f"no order {order_id!r}")
    return order


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
