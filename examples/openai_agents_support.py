"""A support agent written with the OpenAI Agents SDK, run by oncely: the
model reads a customer's message, looks the order up, refunds through the
shop's refund service (a call that answers, sent exactly once) and replies.
A refund above 50.00 waits for a person's approval first; the job holds no
worker while it waits.

The agent is plain ``agents.Agent`` code: the one oncely line is
``openai_agents.run(ctx, support, ...)`` in place of ``Runner.run(support,
...)``, and the refund is an oncely call tool made into the SDK's tool with
``openai_agents.as_tool``. Run it with ``oncely --app
examples.openai_agents_support:app dev``; examples/test_openai_agents_support.py
tests it with ``oncely.testing``.

What happens once, and what at least once (docs/framework-openai-agents.md):
each model turn is paid for once per job; ``lookup_order`` may run again
after a crash before its answer was stored (it only reads); the refund is
a call the relay sends once under a stable key, which the refund service
dedupes on.
"""

import json
from typing import Any

from agents import Agent, RunResult, ToolCallItem, ToolCallOutputItem, function_tool

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
from oncely.integrations import openai_agents


@function_tool
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up by its id: the item, the total in cents, how many
    days ago it was delivered, and its status.

    Args:
        order_id: The order's id, as A-1001.
    """
    order = find_order(order_id)
    if order is None:
        return {"error": f"no order {order_id!r}"}
    return order


refund = openai_agents.as_tool(
    oncely.call_tool(
        "refund.issue",
        args=RefundArgs,
        name="refund",
        description="Refund part or all of an order, in cents, with the reason.",
        approval=lambda args: args.cents > APPROVAL_ABOVE_CENTS,
    )
)

# The SDK's agent, as it would run anywhere else.
support = Agent(name="support", instructions=INSTRUCTIONS, tools=[lookup_order, refund])


async def answer(request: SupportRequest, ctx: oncely.Context) -> SupportReply:
    result = await openai_agents.run(ctx, support, request.message, max_turns=8)
    reply = str(result.final_output)
    # Written with the result, in one transaction; delivered once.
    ctx.emit("support.reply", {"customer": request.customer, "reply": reply})
    calls = tool_calls(result)
    return SupportReply(
        reply=reply,
        refunded_cents=sum(
            int(arguments["cents"])
            for name, arguments, said in calls
            if name == "refund" and said.get("ok") is True
        ),
        tool_calls=[name for name, _, _ in calls],
    )


def tool_calls(result: RunResult) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Each tool call of the run: its name, its arguments, what it answered."""
    said: dict[str, Any] = {}
    for item in result.new_items:
        if isinstance(item, ToolCallOutputItem):
            said[str(item.call_id)] = item.output
    found = []
    for item in result.new_items:
        if isinstance(item, ToolCallItem) and item.call_id is not None:
            output = said.get(str(item.call_id))
            try:
                answered = json.loads(output) if isinstance(output, str) else {}
            except ValueError:
                answered = {}
            arguments = json.loads(getattr(item.raw_item, "arguments", None) or "{}")
            found.append((str(item.tool_name), arguments, answered))
    return found


workflow = oncely.Workflow(
    name="support_oaa",
    route="/v1/support-oaa",
    request=SupportRequest,
    result=SupportReply,
    step=answer,
    effects=[
        oncely.webhook("refund.issue", returns=Refunded),
        oncely.webhook("approval.requested"),
        oncely.email("support.reply", render_reply),
    ],
    agents=[support],
    summary="A support agent written with the OpenAI Agents SDK: lookups, one refund, a reply.",
)

app = oncely.App([workflow])
