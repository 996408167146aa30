"""oncely.testing scripts tools and MCP servers (docs/testing.md):
``tools=`` answers a tool by name in place of running it (a function tool,
an MCP server's, a framework's), its checkpoint stored as a worker stores
it; ``toolsets=`` lists an MCP toolset without asking its server, the
policy following the scripted annotations. With both, an agent with MCP
tools is tested with no server at all."""

from __future__ import annotations

from typing import Any

import pytest

import oncely
from oncely.errors import PermanentError
from oncely.fakes.mcp import FakeMCPServer
from oncely.testing import ToolCalls, run_step
from tests.test_mcp import Answer, Ask, agent_workflow

# A server no test can reach: a call to it fails the run.
NOWHERE = "http://127.0.0.1:9/mcp"
SHOP = [
    {
        "name": "lookup_order",
        "description": "Look an order up.",
        "inputSchema": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
        },
        "annotations": {"readOnlyHint": True},
    },
    {
        "name": "refund",
        "description": "Refund part of an order.",
        "inputSchema": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}, "cents": {"type": "integer"}},
            "required": ["order_id", "cents"],
        },
        "annotations": {"destructiveHint": True},
    },
]
REFUNDED = {"refunded": True, "id": "re_1", "cents": 1200}


def shop_agent(server: str = NOWHERE, **options: Any) -> oncely.Agent:
    return oncely.Agent("support", "Help.", [oncely.mcp_tools(server, name="shop", **options)])


LOOKUP = ToolCalls(("lookup_order", {"order_id": "A1"}))
REFUND = ToolCalls(("refund", {"order_id": "A1", "cents": 1200}))


async def refund_a1(answers: list[Any], **options: Any) -> Any:
    """``run_step`` of the shop agent (its tools ``SHOP``, listed by no
    server) asked to refund A1, the model answering ``answers``."""
    workflow = agent_workflow(shop_agent())
    return await run_step(
        workflow, {"text": "Refund A1."}, answers=answers, toolsets={"shop": SHOP}, **options
    )


async def test_a_function_tool_is_answered_as_scripted_and_never_runs() -> None:
    ran: list[str] = []

    @oncely.tool
    def lookup_order(order_id: str) -> dict[str, str]:
        """Look an order up."""
        ran.append(order_id)
        return {"status": "real"}

    workflow = agent_workflow(oncely.Agent("support", "Help.", [lookup_order]))
    run = await run_step(
        workflow,
        {"text": "Where is A1?"},
        answers=[LOOKUP, "It shipped."],
        tools={"lookup_order": {"status": "shipped"}},
        crash_after="support/lookup_order/tool",
    )
    assert ran == []
    assert run.result.tools == ["lookup_order:ok"]
    assert run.result.results == [{"status": "shipped"}]
    # The same checkpoints as a real run's; the model is told the scripted value.
    assert run.steps == ("support/model", "support/lookup_order/tool", "support/model#2")
    told = [m.content for m in run.calls[-1].messages if m.role == "tool"]
    assert '"shipped"' in told[0]

    # Arguments the tool's schema refuses never reach the script.
    bad = await run_step(
        workflow,
        {"text": "Where?"},
        answers=[ToolCalls(("lookup_order", {"order": "A1"})), "Which order?"],
        tools={"lookup_order": {"status": "shipped"}},
    )
    assert bad.result.tools == ["lookup_order:error"]
    assert "invalid arguments" in bad.result.results[0]["error"]


async def test_a_scripted_exception_is_raised_in_the_tools_place() -> None:
    run = await refund_a1(
        [REFUND, "Sorry."], tools={"refund": PermanentError("the card was declined")}
    )
    assert run.result.tools == ["refund:error"]
    assert run.result.results[0]["error"] == "PermanentError: the card was declined"


async def test_mcp_tools_with_no_server_listed_and_answered_as_scripted() -> None:
    run = await refund_a1(
        [LOOKUP, REFUND, "Refunded."],
        tools={"lookup_order": {"status": "shipped"}, "refund": REFUNDED},
    )
    assert run.result.tools == ["lookup_order:ok", "refund:ok"]
    assert run.result.results == [{"status": "shipped"}, REFUNDED]
    # Listed once, a checkpoint as a worker keeps it; the destructive refund
    # is at most once (its intent stored first), the read-only lookup is not.
    assert run.steps == (
        "support/shop.tools",
        "support/model",
        "support/lookup_order/tool",
        "support/model#2",
        "support/refund/tool",
        "support/refund/tool/intent",
        "support/model#3",
    )
    [listing] = [c.value for c in run.checkpoints if c.key == "support/shop.tools"]
    assert [t["name"] for t in listing["tools"]] == ["lookup_order", "refund"]
    assert listing["tools"][1]["schema"]["required"] == ["order_id", "cents"]
    # Arguments that fail the scripted schema never reach the script.
    bad = await refund_a1(
        [ToolCalls(("refund", {"order_id": "A1", "cents": "all"})), "Sorry."],
        tools={"refund": REFUNDED},
    )
    assert bad.result.tools == ["refund:error"]


async def test_a_crash_mid_refund_asks_a_person_and_resend_answers_again() -> None:
    run = await refund_a1(
        [REFUND, "Refunded."],
        tools={"refund": REFUNDED},
        crash_after="support/refund/tool/intent",
        uncertain={"refund": "resend"},
    )
    assert run.result.tools == ["refund:ok"]
    assert run.result.results == [REFUNDED]
    assert "support/refund/tool/uncertain" in run.steps


async def test_a_listing_of_names_takes_any_arguments_and_each_tool_is_at_most_once() -> None:
    run = await run_step(
        agent_workflow(shop_agent()),
        {"text": "Look A1 up."},
        answers=[ToolCalls(("lookup_order", {"anything": 1})), "Done."],
        toolsets={"shop": ["lookup_order"]},
        tools={"lookup_order": "found"},
    )
    assert run.result.results == ["found"]
    assert "support/lookup_order/tool/intent" in run.steps, "no annotations: destructive"

    # Unless the toolset says otherwise, or the scripted server dedupes on the key.
    for options, listing in (
        ({"retry": ["lookup_order"]}, ["lookup_order"]),
        ({}, {"tools": ["lookup_order"], "idempotent": True}),
    ):
        run = await run_step(
            agent_workflow(shop_agent(**options)),
            {"text": "Look A1 up."},
            answers=[ToolCalls(("lookup_order", {})), "Done."],
            toolsets={"shop": listing},
            tools={"lookup_order": "found"},
        )
        assert "support/lookup_order/tool/intent" not in run.steps, options


async def test_a_tool_the_script_does_not_answer_is_called_on_the_server() -> None:
    async with FakeMCPServer() as fake:
        run = await run_step(
            agent_workflow(shop_agent(fake.url)),
            {"text": "Refund A1."},
            answers=[LOOKUP, REFUND, "Refunded."],
            toolsets={"shop": SHOP},
            tools={"refund": REFUNDED},
            job_id="job-1",
        )
    assert run.result.results[0]["status"] == "shipped"
    # Listed from the script, the lookup sent (with its key), the refund not.
    assert fake.calls()["lists"] == 0
    assert fake.calls()["by_key"] == {"job-1:support/lookup_order/tool": 1}
    assert fake.calls()["effects"] == 0


async def test_a_framework_tool_is_answered_as_scripted() -> None:
    from pydantic_ai import Agent as PydanticAgent

    from oncely.integrations import pydantic_ai as oncely_pai

    ran: list[str] = []
    agent = PydanticAgent(name="shop")

    @agent.tool_plain
    def stock(sku: str) -> int:
        """Units in stock."""
        ran.append(sku)
        return 3

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        result = await oncely_pai.run(ctx, agent, request.text)
        return Answer(reply=str(result.output), tools=[])

    workflow = oncely.Workflow(
        name="pai", route="/v1/pai", request=Ask, result=Answer, step=step, agents=[agent]
    )
    run = await run_step(
        workflow,
        {"text": "Stock?"},
        answers=[ToolCalls(("stock", {"sku": "a"})), "None left."],
        tools={"stock": 0},
    )
    assert ran == []
    assert run.steps == ("shop/model", "shop/stock/tool", "shop/model#2")
    told = [m.content for m in run.calls[-1].messages if m.role == "tool"]
    assert told == ["0"]


@pytest.mark.parametrize(
    ("value", "told"),
    [({"item": "scripted"}, '{"item":"scripted"}'), ("in stock", "in stock"), (0, "0")],
    ids=["object", "text", "number"],
)
async def test_a_langgraph_tool_is_answered_as_scripted(value: Any, told: str) -> None:
    """A LangChain tool the model calls: the scripted value is its
    ``ToolMessage``'s content (text as it is, else JSON), the tool never runs."""
    from examples.langgraph_support import support_graph

    from oncely.integrations import langgraph

    ran: list[str] = []

    def stock(sku: str) -> int:
        """Units in stock."""
        ran.append(sku)
        return 3

    graph = support_graph([langgraph.as_tool(stock)], name="shop")

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        state = await langgraph.run(ctx, graph, {"messages": [("user", request.text)]})
        return Answer(reply=str(state["messages"][-1].content), tools=[])

    workflow = oncely.Workflow(
        name="lg", route="/v1/lg", request=Ask, result=Answer, step=step, agents=[graph]
    )
    run = await run_step(
        workflow,
        {"text": "Stock?"},
        answers=[ToolCalls(("stock", {"sku": "a"})), "Done."],
        tools={"stock": value},
    )
    assert ran == []
    assert run.steps == ("shop/model", "shop/stock/tool", "shop/model#2")
    assert [m.content for m in run.calls[-1].messages if m.role == "tool"] == [told]


async def test_an_agent_given_for_a_workflow_says_what_to_give() -> None:
    with pytest.raises(TypeError, match="run_step runs a Workflow's step, got Agent"):
        await run_step(oncely.Agent("support", "Help.", []), {"text": "x"})  # type: ignore[arg-type]


async def test_mistakes_in_the_script_say_what_to_write() -> None:
    refund = oncely.call_tool("refund.issue", args=Ask, description="Refund.", name="refund_issue")
    workflow = agent_workflow(
        oncely.Agent("support", "Help.", [refund]),
        effects=[oncely.webhook("refund.issue", returns=Answer)],
    )
    # (Raised in the agent's tool calls' task group: the run says it failed there.)
    with pytest.raises(PermanentError, match=r"calls=\{'refund.issue': \.\.\.\}"):
        await run_step(
            workflow,
            {"text": "x"},
            answers=[ToolCalls(("refund_issue", {"text": "A1"})), "Done."],
            tools={"refund_issue": {"ok": True}},
        )
    with pytest.raises(TypeError, match="a list of the server's tools"):
        await run_step(
            agent_workflow(shop_agent()), {"text": "x"}, answers=["x"], toolsets={"shop": "refund"}
        )
    with pytest.raises(PermanentError, match="no tool name"):
        await run_step(
            agent_workflow(shop_agent()),
            {"text": "x"},
            answers=["x"],
            toolsets={"shop": ["Refund Now"]},
        )
