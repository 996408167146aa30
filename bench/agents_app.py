"""The workflows ``bench.agents`` runs in real worker processes
(``oncely --app bench.agents_app:app worker --workflow …``): the same
support case handled by an agent and by the same work written by hand.

- ``agent``: ``oncely.Agent`` with two function tools (``lookup``,
  ``check``) and a call tool (``refund``): the fake model's directives in
  the case's text make it call each in a turn of its own, then answer:
  four model turns, two tool checkpoints, one call.
- ``by_hand``: the same four model calls, the same two side calls through
  ``ctx.step`` and the same call through ``ctx.call``, in a fixed order.

The side calls append a line to ``ONCELY_BENCH_SIDE_CALLS`` (as in
``bench.steps_app``), so the benchmark counts how often they really ran.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

import oncely
from bench.steps_app import _record
from oncely import Context, Workflow, webhook

TOPIC = "bench.refund"
TOPIC_BY_HAND = "bench.refund_by_hand"


class Case(BaseModel):
    text: str = Field(min_length=1, max_length=4000)


class Handled(BaseModel):
    reply: str
    refund_id: str


class RefundArgs(BaseModel):
    sku: str
    cents: int


def directives(sku: str) -> str:
    """What makes the fake model call the three tools, one a turn."""
    calls = (
        ("lookup", {"sku": sku}),
        ("check", {"sku": sku}),
        ("refund", {"sku": sku, "cents": 1200}),
    )
    return " ".join(f"[[fake:tool={name} {json.dumps(args)}]]" for name, args in calls)


@oncely.tool
def lookup(sku: str) -> dict[str, Any]:
    """Look a SKU up."""
    _record(f"lookup {sku}")
    return {"sku": sku, "stock": 3}


@oncely.tool
def check(sku: str) -> dict[str, Any]:
    """Check a SKU's refund policy."""
    _record(f"check {sku}")
    return {"sku": sku, "refundable": True}


refund = oncely.call_tool(TOPIC, args=RefundArgs, description="Refund.", name="refund")
support = oncely.Agent("support", "Handle the case.", [lookup, check, refund])


async def with_agent(case: Case, ctx: Context) -> Handled:
    run = await support.run(ctx, case.text)
    answer = next(c.result for c in run.tool_calls if c.tool == "refund")
    return Handled(reply=str(run.output), refund_id=str(answer["id"]))


async def by_hand(case: Case, ctx: Context) -> Handled:
    sku = case.text.split()[0]
    await ctx.model.complete(f"plan: {case.text}")
    await ctx.step("lookup", lookup.fn, sku)  # type: ignore[arg-type]
    await ctx.model.complete(f"after lookup: {case.text}")
    await ctx.step("check", check.fn, sku)  # type: ignore[arg-type]
    await ctx.model.complete(f"after check: {case.text}")
    answer = await ctx.call(TOPIC_BY_HAND, {"sku": sku, "cents": 1200})
    reply = await ctx.model.complete(f"reply: {case.text}")
    return Handled(reply=reply, refund_id=str(answer["id"]))


agent = Workflow(
    name="agent",
    route="/v1/bench/agent",
    request=Case,
    result=Handled,
    step=with_agent,
    effects=[webhook(TOPIC, returns=True)],
    agents=[support],
)
hand = Workflow(
    name="by_hand",
    route="/v1/bench/by-hand",
    request=Case,
    result=Handled,
    step=by_hand,
    effects=[webhook(TOPIC_BY_HAND, returns=True)],
)

app = oncely.App([agent, hand])
