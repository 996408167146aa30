"""A framework agent per framework whose one tool asks for a person with the
framework's own flag (Pydantic AI ``requires_approval=True``, the OpenAI
Agents SDK's ``needs_approval=True``, LangGraph's ``as_tool(...,
approval=True)``), for real processes: ``oncely --app
tests.frameworks_app:pai`` (``oaa``, ``lg``). Each app is built when asked
for, so a process imports only its own framework.

``cancel_order`` appends a line to the file named by
``ONCELY_TEST_SIDE_CALLS`` (tests/steps_app.py) with its stable key, so a
test sees whether, and how often, it really ran, whichever worker ran it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

import oncely
from oncely import App, Context, Workflow
from tests.steps_app import record_side_call

INSTRUCTIONS = "You are the support desk. Cancel an order when the customer asks."


class Ask(BaseModel):
    text: str = Field(min_length=1, max_length=2000)


class Answer(BaseModel):
    reply: str


def cancel_order(order_id: str) -> str:
    """Cancel an order by its id (a person approves it first)."""
    record_side_call("cancel_order", oncely.tool_key())
    return f"cancelled {order_id}"


def desk(name: str, step: Callable[..., Any], agent: object) -> App:
    workflow = Workflow(
        name=name,
        route=f"/v1/{name.replace('_', '-')}",
        request=Ask,
        result=Answer,
        step=step,
        agents=[agent],
    )
    return App([workflow])


def pai_desk() -> App:
    from pydantic_ai import Agent

    from oncely.integrations import pydantic_ai

    agent = Agent(name="desk", instructions=INSTRUCTIONS)
    agent.tool_plain(requires_approval=True)(cancel_order)

    async def step(request: Ask, ctx: Context) -> Answer:
        result = await pydantic_ai.run(ctx, agent, request.text, max_turns=4)
        return Answer(reply=str(result.output))

    return desk("pai_desk", step, agent)


def oaa_desk() -> App:
    from agents import Agent, function_tool

    from oncely.integrations import openai_agents

    tool = function_tool(cancel_order, needs_approval=True)
    agent = Agent(name="desk", instructions=INSTRUCTIONS, tools=[tool])

    async def step(request: Ask, ctx: Context) -> Answer:
        result = await openai_agents.run(ctx, agent, request.text, max_turns=4)
        return Answer(reply=str(result.final_output))

    return desk("oaa_desk", step, agent)


def lg_desk() -> App:
    from examples.langgraph_support import support_graph
    from langchain_core.messages import HumanMessage

    from oncely.integrations import langgraph

    compiled = support_graph([langgraph.as_tool(cancel_order, approval=True)], name="desk")

    async def step(request: Ask, ctx: Context) -> Answer:
        state = await langgraph.run(
            ctx, compiled, {"messages": [HumanMessage(request.text)]}, max_turns=4
        )
        return Answer(reply=str(state["messages"][-1].content))

    return desk("lg_desk", step, compiled)


APPS: dict[str, Callable[[], App]] = {"pai": pai_desk, "oaa": oaa_desk, "lg": lg_desk}


def __getattr__(name: str) -> App:
    # `--app tests.frameworks_app:pai` looks the name up here (PEP 562).
    if name in APPS:
        return APPS[name]()
    raise AttributeError(name)
