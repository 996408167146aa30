"""An agent with an MCP server's tools, run as real processes by
tests/test_mcp_processes.py (``oncely --app tests.mcp_app:app``).

The server is the one ``ONCELY_TEST_MCP_URL`` names (the fake, ``oncely
fake-mcp``, in the tests): its read-only ``lookup_order`` is retried after
a crash, its destructive ``refund`` runs at most once unless the server
declares that it dedupes on the key (docs/mcp.md). The model is the fake
one: the tool calls are written in the customer's message
(``[[fake:tool=refund {...}]]``), and so are the MCP fake's faults, in the
tools' arguments (``[[fake:slow]]``).
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, Field

import oncely

MCP_URL = "ONCELY_TEST_MCP_URL"


class Ask(BaseModel):
    message: str = Field(min_length=1, max_length=4000)


class Answer(BaseModel):
    reply: str
    # Each call as ``<tool>:<status>``, and what the model was told of it.
    tool_calls: list[str]
    results: list[Any] = []


shop = oncely.mcp_tools(
    os.environ.get(MCP_URL, "http://127.0.0.1:8103/mcp"), name="shop", timeout=30
)
support = oncely.Agent("support", "You help customers of the shop.", [shop], max_turns=6)


async def answer(request: Ask, ctx: oncely.Context) -> Answer:
    run = await support.run(ctx, request.message)
    return Answer(
        reply=str(run.output),
        tool_calls=[f"{c.tool}:{c.status}" for c in run.tool_calls],
        results=[c.result for c in run.tool_calls],
    )


workflow = oncely.Workflow(
    name="mcpdesk",
    route="/v1/mcpdesk",
    request=Ask,
    result=Answer,
    step=answer,
    agents=[support],
    # A person is told of a call whose outcome is unknown (docs/at-most-once.md).
    effects=[oncely.webhook("uncertain.raised")],
)

app = oncely.App([workflow])
