"""The workflows ``bench.agents`` runs in real worker processes
(``oncely --app bench.agents_app:app worker --workflow …``): the same
support case handled by an agent and by the same work written by hand.

- ``agent``: ``oncely.Agent`` with two function tools (``lookup``,
  ``check``) and a call tool (``refund``): the fake model's directives in
  the case's text make it call each in a turn of its own, then answer:
  four model turns, two tool checkpoints, one call.
- ``by_hand``: the same four model calls, the same two side calls through
  ``ctx.step`` and the same call through ``ctx.call``, in a fixed order.
- ``pydantic_ai``, ``openai_agents``, ``langgraph``: the same agent written
  in each framework and run through its integration
  (``oncely.integrations.<framework>.run``): the same instructions, the two
  function tools as the framework's own tools (each call a tool checkpoint
  through the adapter) and the call tool as ``as_tool(refund)``; the same
  four turns, two tool checkpoints and one call.

Each contender's call has a topic of its own, so each workflow declares the
effect it sends.

The side calls append a line to ``ONCELY_BENCH_SIDE_CALLS`` (as in
``bench.steps_app``), so the benchmark counts how often they really ran.
"""

from __future__ import annotations

import json
from typing import Any

import agents as oaa
import pydantic_ai as pai
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import BaseModel, Field

import oncely
from bench.steps_app import _record
from oncely import Context, Workflow, webhook
from oncely.integrations import langgraph as oncely_lg
from oncely.integrations import openai_agents as oncely_oaa
from oncely.integrations import pydantic_ai as oncely_pai

INSTRUCTIONS = "Handle the case."
TOPIC = "bench.refund"
TOPIC_BY_HAND = "bench.refund_by_hand"
TOPIC_PAI = "bench.refund_pydantic_ai"
TOPIC_OAA = "bench.refund_openai_agents"
TOPIC_LG = "bench.refund_langgraph"
TOPIC_ONCE = "bench.refund_at_most_once"


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


def refund_tool(topic: str) -> oncely.Tool:
    return oncely.call_tool(topic, args=RefundArgs, description="Refund.", name="refund")


refund = refund_tool(TOPIC)
support = oncely.Agent("support", INSTRUCTIONS, [lookup, check, refund])
# The same agent with its check at most once (docs/at-most-once.md): what an
# intent costs over a plain tool call.
check_once = oncely.tool(name="check", at_most_once=True)(check.fn)  # type: ignore[arg-type]
support_once = oncely.Agent("support", INSTRUCTIONS, [lookup, check_once, refund_tool(TOPIC_ONCE)])


async def with_agent(case: Case, ctx: Context) -> Handled:
    run = await support.run(ctx, case.text)
    answer = next(c.result for c in run.tool_calls if c.tool == "refund")
    return Handled(reply=str(run.output), refund_id=str(answer["id"]))


async def with_agent_once(case: Case, ctx: Context) -> Handled:
    run = await support_once.run(ctx, case.text)
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


# -- the same agent in each framework, run through its integration ----------------

pai_support = pai.Agent(
    name="support",
    instructions=INSTRUCTIONS,
    tools=[
        pai.Tool(lookup.fn, name="lookup"),  # type: ignore[arg-type]
        pai.Tool(check.fn, name="check"),  # type: ignore[arg-type]
        oncely_pai.as_tool(refund_tool(TOPIC_PAI)),
    ],
)


async def with_pydantic_ai(case: Case, ctx: Context) -> Handled:
    result = await oncely_pai.run(ctx, pai_support, case.text)
    answers: list[Any] = [
        part.content
        for message in result.all_messages()
        for part in message.parts
        if isinstance(part, pai.messages.ToolReturnPart) and part.tool_name == "refund"
    ]
    return Handled(reply=str(result.output), refund_id=str(answers[0]["id"]))


oaa_support = oaa.Agent(
    name="support",
    instructions=INSTRUCTIONS,
    tools=[
        oaa.function_tool(lookup.fn, name_override="lookup"),  # type: ignore[arg-type]
        oaa.function_tool(check.fn, name_override="check"),  # type: ignore[arg-type]
        oncely_oaa.as_tool(refund_tool(TOPIC_OAA)),
    ],
)


async def with_openai_agents(case: Case, ctx: Context) -> Handled:
    result = await oncely_oaa.run(ctx, oaa_support, case.text)
    refunds = {
        item.raw_item.call_id  # type: ignore[union-attr]
        for item in result.new_items
        if isinstance(item, oaa.ToolCallItem) and item.tool_name == "refund"
    }
    answers = [
        json.loads(item.output)
        for item in result.new_items
        if isinstance(item, oaa.ToolCallOutputItem) and item.call_id in refunds
    ]
    return Handled(reply=str(result.final_output), refund_id=str(answers[0]["id"]))


LG_TOOLS = [
    oncely_lg.as_tool(StructuredTool.from_function(lookup.fn, name="lookup")),
    oncely_lg.as_tool(StructuredTool.from_function(check.fn, name="check")),
    oncely_lg.as_tool(refund_tool(TOPIC_LG)),
]


def support_graph() -> Any:
    """The usual agent graph: the model answers or calls tools, whose
    answers go back to it."""
    model = oncely_lg.chat_model().bind_tools(LG_TOOLS)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(LG_TOOLS))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    graph.add_edge("agent", END)
    return graph.compile(name="support")


lg_support = support_graph()


async def with_langgraph(case: Case, ctx: Context) -> Handled:
    state = await oncely_lg.run(
        ctx, lg_support, {"messages": [SystemMessage(INSTRUCTIONS), HumanMessage(case.text)]}
    )
    messages = state["messages"]
    answers = [
        json.loads(str(m.content))
        for m in messages
        if isinstance(m, ToolMessage) and m.name == "refund"
    ]
    return Handled(reply=str(messages[-1].content), refund_id=str(answers[0]["id"]))


agent = Workflow(
    name="agent",
    route="/v1/bench/agent",
    request=Case,
    result=Handled,
    step=with_agent,
    effects=[webhook(TOPIC, returns=True)],
    agents=[support],
)
agent_once = Workflow(
    name="at_most_once",
    route="/v1/bench/at-most-once",
    request=Case,
    result=Handled,
    step=with_agent_once,
    effects=[webhook(TOPIC_ONCE, returns=True)],
    agents=[support_once],
)
hand = Workflow(
    name="by_hand",
    route="/v1/bench/by-hand",
    request=Case,
    result=Handled,
    step=by_hand,
    effects=[webhook(TOPIC_BY_HAND, returns=True)],
)


def _framework(
    name: str, step: Any, topic: str, framework_agent: object
) -> Workflow[Case, Handled]:
    return Workflow(
        name=name,
        route=f"/v1/bench/{name.replace('_', '-')}",
        request=Case,
        result=Handled,
        step=step,
        effects=[webhook(topic, returns=True)],
        agents=[framework_agent],
    )


# The framework contenders' steps, by name (bench.agents' profile buckets).
STEPS = ("with_pydantic_ai", "with_openai_agents", "with_langgraph")
with_pai = _framework("pydantic_ai", with_pydantic_ai, TOPIC_PAI, pai_support)
with_oaa = _framework("openai_agents", with_openai_agents, TOPIC_OAA, oaa_support)
with_lg = _framework("langgraph", with_langgraph, TOPIC_LG, lg_support)

app = oncely.App([agent, agent_once, hand, with_pai, with_oaa, with_lg])
