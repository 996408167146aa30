"""The support agent of examples/support_agent.py, written with LangGraph:
a graph of a model node and a ``ToolNode`` that looks the order up and
refunds through the shop's refund service (a call that answers, sent exactly
once), and replies by email. A refund above 50.00 waits for a person's
approval first; the job holds no worker while it waits.

The graph is LangGraph's own; oncely's pieces go where the model and the
tools go: ``chat_model()`` answers through the job's model checkpoints,
``as_tool`` makes each tool call a checkpoint. ``run`` runs it in the step
(docs/framework-langgraph.md). Run it with every oncely command:
``oncely --app examples.langgraph_support:app dev``; it needs
``oncely[langgraph]``. examples/test_langgraph_support.py tests it with
``oncely.testing``.

What happens once, and what at least once: each model turn is paid for once
per job; ``lookup_order`` may run again after a crash before its answer was
stored (it only reads); the refund is a call the relay sends once under a
stable key, which the refund service dedupes on.
"""

from datetime import timedelta
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import StructuredTool, ToolException
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

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
from oncely.integrations import langgraph


def look_up(order_id: str) -> dict[str, Any]:
    """Look an order up by its id: the item, the total in cents, how many
    days ago it was delivered, and its status."""
    order = find_order(order_id)
    if order is None:
        # LangChain's own way to tell the model; the answer is kept as any other.
        raise ToolException(f"no order {order_id!r}")
    return order


lookup_order = StructuredTool.from_function(look_up, name="lookup_order", handle_tool_error=True)


refund = oncely.call_tool(
    "refund.issue",
    args=RefundArgs,
    name="refund",
    description="Refund part or all of an order, in cents, with the reason.",
    approval=lambda args: args.cents > APPROVAL_ABOVE_CENTS,
)

TOOLS = [langgraph.as_tool(lookup_order), langgraph.as_tool(refund)]


def support_graph(tools: list[Any] = TOOLS, name: str = "support") -> Any:
    """The agent: the model answers or calls tools; the tools' answers go back to it."""
    model = langgraph.chat_model().bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    graph.add_edge("agent", END)
    return graph.compile(name=name)


support = support_graph()


async def answer(request: SupportRequest, ctx: oncely.Context) -> SupportReply:
    state = await langgraph.run(
        ctx,
        support,
        {"messages": [SystemMessage(INSTRUCTIONS), HumanMessage(request.message)]},
        max_turns=8,
        approval_timeout=timedelta(hours=48),
    )
    messages = state["messages"]
    reply = str(messages[-1].content)
    # Written with the result, in one transaction; delivered once.
    ctx.emit("support.reply", {"customer": request.customer, "reply": reply})
    return SupportReply(
        reply=reply,
        refunded_cents=refunded_cents(messages),
        tool_calls=[f"{m.name}:{m.status}" for m in messages if isinstance(m, ToolMessage)],
    )


def refunded_cents(messages: list[Any]) -> int:
    """The cents of every refund call that succeeded."""
    asked = {
        call["id"]: call["args"]
        for m in messages
        if isinstance(m, AIMessage)
        for call in m.tool_calls
        if call["name"] == "refund"
    }
    return sum(
        int(asked[m.tool_call_id]["cents"])
        for m in messages
        if isinstance(m, ToolMessage) and m.status == "success" and m.tool_call_id in asked
    )


workflow = oncely.Workflow(
    name="lg_support",
    route="/v1/lg-support",
    request=SupportRequest,
    result=SupportReply,
    step=answer,
    effects=[
        oncely.email("support.reply", render_reply),
        oncely.webhook("refund.issue", returns=Refunded),
        oncely.webhook("approval.requested"),
    ],
    agents=[support],
    summary="A LangGraph support agent that looks orders up and refunds once.",
)

app = oncely.App([workflow])
