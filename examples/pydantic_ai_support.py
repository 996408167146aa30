"""The support agent of examples/support_agent.py, written in Pydantic AI and
run unchanged inside an oncely step: the model reads a customer's message,
looks the order up, refunds through the shop's refund service (a call that
answers, sent exactly once) and replies by email. A refund above 50.00 waits
for a person's approval first; the job holds no worker while it waits.

Run it with every oncely command:
``oncely --app examples.pydantic_ai_support:app dev``.
docs/framework-pydantic-ai.md explains it, and
examples/test_pydantic_ai_support.py tests it with ``oncely.testing``.

What happens once, and what at least once: each request Pydantic AI makes
is paid for once per job; ``lookup_order`` may run again after a crash
before its answer was stored (it only reads); the refund is a call the relay
sends once under a stable key, which the refund service dedupes on; the
reply is one email.
"""

from typing import Any

from pydantic_ai import Agent, ModelRetry
from pydantic_ai.messages import ToolCallPart, ToolReturnPart

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
from oncely.integrations import pydantic_ai as oncely_pai

# The refund is oncely's: a call that answers, approved by a person above 50.00.
refund = oncely.call_tool(
    "refund.issue",
    args=RefundArgs,
    name="refund",
    description="Refund part or all of an order, in cents, with the reason.",
    approval=lambda args: args.cents > APPROVAL_ABOVE_CENTS,
)

# The agent is Pydantic AI's own: it runs as it is inside oncely and outside it.
support = Agent(name="support", instructions=INSTRUCTIONS, tools=[oncely_pai.as_tool(refund)])


@support.tool_plain
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up by its id: the item, the total in cents, how many
    days ago it was delivered, and its status."""
    order = find_order(order_id)
    if order is None:
        # Pydantic AI tells the model, which can ask the customer again.
        raise ModelRetry(f"no order {order_id!r}: ask the customer for the order id")
    return order


async def answer(request: SupportRequest, ctx: oncely.Context) -> SupportReply:
    result = await oncely_pai.run(ctx, support, request.message, max_turns=8)
    reply = str(result.output)
    # Written with the result, in one transaction; delivered once.
    ctx.emit("support.reply", {"customer": request.customer, "reply": reply})
    calls, refunded = tool_calls(result.all_messages())
    return SupportReply(reply=reply, refunded_cents=refunded, tool_calls=calls)


def tool_calls(messages: list[Any]) -> tuple[list[str], int]:
    """What the tools did (``name:ok``, ``:rejected``, ``:error``, ``:retried``)
    and the cents refunded, read from Pydantic AI's own message history."""
    asked = {
        part.tool_call_id: part
        for message in messages
        for part in message.parts
        if isinstance(part, ToolCallPart)
    }
    calls, refunded = [], 0
    for message in messages:
        for part in message.parts:
            if not isinstance(part, ToolReturnPart) or part.tool_call_id not in asked:
                continue
            content = part.content if isinstance(part.content, dict) else {}
            status: str = "ok" if part.outcome == "success" else part.outcome
            if content.get("rejected"):
                status = "rejected"
            elif "error" in content:
                status = "error"
            calls.append(f"{part.tool_name}:{status}")
            if part.tool_name == "refund" and content.get("ok"):
                refunded += int(asked[part.tool_call_id].args_as_dict()["cents"])
    return calls, refunded


workflow = oncely.Workflow(
    name="pai_support",
    route="/v1/pai-support",
    request=SupportRequest,
    result=SupportReply,
    step=answer,
    effects=[
        oncely.webhook("refund.issue", returns=Refunded),
        oncely.webhook("approval.requested"),
        oncely.email("support.reply", render_reply),
    ],
    agents=[support],
    summary="A Pydantic AI support agent that looks orders up, refunds once and replies.",
)

app = oncely.App([workflow])
