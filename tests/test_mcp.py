"""Tools from MCP servers (docs/mcp.md), against the fake MCP server and
servers written here with the ``mcp`` SDK, all over real streamable HTTP:
the listing is a checkpoint of the run, the key reaches the server in
``_meta``, names a server sends are checked, the policy follows the tools'
annotations and the server's capability, errors are translated where they
enter, and headers are sent but never logged. Through ``oncely.testing``
here; through a real worker on Redis and PostgreSQL at the end."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp.server import Server
from mcp.server.mcpserver import MCPServer
from mcp_types import (
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    TextContent,
    ToolAnnotations,
)
from mcp_types import Tool as ServerTool
from pydantic import BaseModel
from structlog.testing import capture_logs

import oncely
from oncely.errors import PermanentError, TransientError
from oncely.fakes.mcp import MCP_PATH, FakeMCPServer, Served
from oncely.mcp import NotSent
from oncely.testing import ToolCalls, run_step
from tests.durable import drain, redeliver_until

TOKEN = "s3cret-token-never-logged"
ROOT = Path(__file__).resolve().parent.parent


class Ask(BaseModel):
    text: str


class Answer(BaseModel):
    reply: str
    tools: list[str]
    results: list[Any] = []


def agent_workflow(
    agent: oncely.Agent, name: str = "support", **options: Any
) -> oncely.Workflow[Ask, Answer]:
    """A workflow ``name`` whose step is ``agent``'s run: its reply, and each
    tool call as ``<tool>:<status>`` with what the model was told of it."""

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        run = await agent.run(ctx, request.text)
        return Answer(
            reply=str(run.output),
            tools=[f"{c.tool}:{c.status}" for c in run.tool_calls],
            results=[c.result for c in run.tool_calls],
        )

    route = f"/v1/{name}"
    return oncely.Workflow(name, route, Ask, Answer, step, agents=[agent], **options)


def listing_workflow(toolset: oncely.Toolset) -> oncely.Workflow[Ask, Answer]:
    """A step that only lists the toolset: each tool's name and whether it
    runs at most once."""

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        tools = await toolset.tools(ctx)
        return Answer(reply="", tools=[f"{t.name}:{t.at_most_once}" for t in tools])

    return oncely.Workflow(name="lister", route="/v1/lister", request=Ask, result=Answer, step=step)


@pytest.fixture
async def fake() -> AsyncIterator[FakeMCPServer]:
    async with FakeMCPServer() as server:
        yield server


# -- the listing and the calls --------------------------------------------------


async def test_a_read_only_tool_is_called_with_the_key_and_its_result_reaches_the_model(
    fake: FakeMCPServer,
) -> None:
    shop = oncely.mcp_tools(fake.url, name="shop")
    run = await run_step(
        agent_workflow(oncely.Agent("support", "Help.", [shop])),
        {"text": "Where is A1?"},
        answers=[ToolCalls(("lookup_order", {"order_id": "A1"})), "It shipped."],
        job_id="job-1",
    )
    assert run.result.tools == ["lookup_order:ok"]
    assert run.steps == (
        "support/shop.tools",
        "support/model",
        "support/lookup_order/tool",
        "support/model#2",
    )
    # The key is the tool checkpoint's: the same on every retry and replay.
    assert fake.calls()["by_key"] == {"job-1:support/lookup_order/tool": 1}
    told = [m.content for m in run.calls[-1].messages if m.role == "tool"]
    assert json.loads(told[0]) == {"order_id": "A1", "status": "shipped", "total_cents": 4200}


async def test_the_listing_is_a_checkpoint_a_replay_asks_the_server_nothing(
    fake: FakeMCPServer,
) -> None:
    shop = oncely.mcp_tools(fake.url, name="shop")
    workflow = agent_workflow(oncely.Agent("support", "Help.", [shop]))
    run = await run_step(
        workflow,
        {"text": "Where is A1?"},
        answers=[ToolCalls(("lookup_order", {"order_id": "A1"})), "It shipped."],
        crash_after="support/lookup_order/tool",
    )
    assert run.result.tools == ["lookup_order:ok"]
    assert fake.calls()["lists"] == 1 and fake.calls()["calls"] == 1

    # A job in flight keeps the tools it saw: resumed over its listing, with
    # the server gone, it still knows them (and asks nothing of it).
    gone = oncely.mcp_tools("http://127.0.0.1:9/mcp", name="shop")
    resumed = await run_step(
        agent_workflow(oncely.Agent("support", "Help.", [gone])),
        {"text": "Where is A1?"},
        answers=["It shipped."],  # the turns before are stored
        resume_from=run.until("support/lookup_order/tool"),
    )
    assert resumed.result.tools == ["lookup_order:ok"]
    assert fake.calls()["lists"] == 1 and fake.calls()["calls"] == 1


async def test_an_is_error_result_is_an_error_the_model_sees(fake: FakeMCPServer) -> None:
    shop = oncely.mcp_tools(fake.url, name="shop")
    run = await run_step(
        agent_workflow(oncely.Agent("support", "Help.", [shop])),
        {"text": "Where is B2?"},
        answers=[ToolCalls(("lookup_order", {"order_id": "B2 [[fake:error]]"})), "Unknown."],
    )
    assert run.result.tools == ["lookup_order:error"]
    [result] = run.result.results
    assert result["error"].startswith("MCPToolError: ")
    assert "no such order" in result["error"]
    told = [m.content for m in run.calls[-1].messages if m.role == "tool"]
    assert "no such order" in told[0]


async def test_arguments_that_fail_the_servers_schema_never_reach_it(fake: FakeMCPServer) -> None:
    shop = oncely.mcp_tools(fake.url, name="shop")
    run = await run_step(
        agent_workflow(oncely.Agent("support", "Help.", [shop])),
        {"text": "Refund."},
        answers=[ToolCalls(("refund", {"order_id": "A1", "cents": "many"})), "Sorry."],
    )
    assert run.result.tools == ["refund:error"]
    assert "invalid arguments" in run.result.results[0]["error"]
    assert fake.calls()["calls"] == 0


async def test_tools_and_toolsets_mix_and_prefix_tells_them_apart(fake: FakeMCPServer) -> None:
    @oncely.tool
    def lookup_order(order_id: str) -> str:
        """Our own lookup."""
        return f"own:{order_id}"

    clash = oncely.Agent(
        "support", "Help.", [lookup_order, oncely.mcp_tools(fake.url, name="shop")]
    )
    with pytest.raises(PermanentError, match="prefix="):
        await run_step(agent_workflow(clash), {"text": "x"}, answers=["no tools"])

    shop = oncely.mcp_tools(fake.url, name="shop", prefix="shop_")
    run = await run_step(
        agent_workflow(oncely.Agent("support", "Help.", [lookup_order, shop])),
        {"text": "Both."},
        answers=[
            ToolCalls(
                ("lookup_order", {"order_id": "A1"}), ("shop_lookup_order", {"order_id": "A1"})
            ),
            "Both found.",
        ],
    )
    assert run.result.tools == ["lookup_order:ok", "shop_lookup_order:ok"]
    assert run.result.results[0] == "own:A1"
    assert run.result.results[1]["status"] == "shipped"
    # The server is asked by its own name.
    assert fake.calls()["by_tool"] == {"lookup_order": 1}


# -- names and schemas a server sends ---------------------------------------------


def hostile_server() -> Server[Any]:
    """A server whose tools' names and schemas are not all usable."""
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    listed = [
        ServerTool(name="good_tool", description="Fine.", input_schema=schema),
        ServerTool(name="Bad.Name\nINJECTED", description="x", input_schema=schema),
        ServerTool(name="x" * 80, description="x", input_schema=schema),
        ServerTool(
            name="bad_schema",
            description="x",
            input_schema={"type": "object", "properties": {"q": {"type": "nonsense"}}},
        ),
        ServerTool(name="good_tool", description="Twice.", input_schema=schema),
    ]

    async def list_tools(ctx: Any, params: Any) -> ListToolsResult:
        return ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: CallToolRequestParams) -> CallToolResult:
        return CallToolResult(content=[TextContent(type="text", text=f"ran {params.name}")])

    return Server("hostile", on_list_tools=list_tools, on_call_tool=call_tool)


async def test_names_and_schemas_a_server_sends_are_checked_and_never_logged() -> None:
    app = hostile_server().streamable_http_app(json_response=True, stateless_http=True)
    async with Served(app) as served:
        hostile = oncely.mcp_tools(served.base_url + MCP_PATH, name="hostile")
        with capture_logs() as logs:
            run = await run_step(listing_workflow(hostile), {"text": "x"})
    # Only the usable tool, once; none the server could make a key or a label of.
    assert run.result.tools == ["good_tool:True"]
    [skipped] = [e for e in logs if e["event"] == "mcp.tools_skipped"]
    assert skipped["skipped"] == 4 and skipped["toolset"] == "hostile"
    assert "INJECTED" not in repr(logs) and "Bad.Name" not in repr(logs)


def test_a_toolset_refuses_bad_names_of_its_own() -> None:
    with pytest.raises(ValueError, match="toolset name"):
        oncely.mcp_tools("http://127.0.0.1:9/mcp", name="Shop")
    with pytest.raises(ValueError, match="prefix"):
        oncely.mcp_tools("http://127.0.0.1:9/mcp", name="shop", prefix="Shop.")
    with pytest.raises(ValueError, match="no tool name"):
        oncely.mcp_tools("http://127.0.0.1:9/mcp", name="shop", retry=["Look Up"])
    with pytest.raises(ValueError, match="both"):
        oncely.mcp_tools("http://127.0.0.1:9/mcp", name="shop", retry=["a"], at_most_once=["a"])
    with pytest.raises(ValueError, match="headers"):
        oncely.mcp_tools(["python", "server.py"], name="shop", headers={"X": "y"})


# -- the policy -------------------------------------------------------------------


def annotated_server() -> MCPServer:
    """Tools with each kind of annotation."""
    server = MCPServer("annotated", log_level="WARNING")

    def reads() -> str:
        return "read"

    server.add_tool(reads, name="reads", annotations=ToolAnnotations(read_only_hint=True))
    server.add_tool(
        reads, name="idempotent_write", annotations=ToolAnnotations(idempotent_hint=True)
    )
    server.add_tool(reads, name="destructive", annotations=ToolAnnotations(destructive_hint=True))
    server.add_tool(reads, name="unannotated")
    return server


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {},
            {"reads": False, "idempotent_write": False, "destructive": True, "unannotated": True},
        ),
        (
            {"retry": ["destructive"]},
            {"reads": False, "idempotent_write": False, "destructive": False, "unannotated": True},
        ),
        (
            {"at_most_once": ["reads"]},
            {"reads": True, "idempotent_write": False, "destructive": True, "unannotated": True},
        ),
        (
            {"at_most_once": True, "retry": ["reads"]},
            {"reads": False, "idempotent_write": True, "destructive": True, "unannotated": True},
        ),
        (
            {"retry": True},
            {"reads": False, "idempotent_write": False, "destructive": False, "unannotated": False},
        ),
    ],
)
async def test_the_policy_follows_the_annotations_overridden_by_name(
    options: dict[str, Any], expected: dict[str, bool]
) -> None:
    app = annotated_server().streamable_http_app(json_response=True, stateless_http=True)
    async with Served(app) as served:
        toolset = oncely.mcp_tools(served.base_url + MCP_PATH, name="annotated", **options)
        run = await run_step(listing_workflow(toolset), {"text": "x"})
    assert dict(t.split(":") for t in run.result.tools) == {
        name: str(at_most_once) for name, at_most_once in expected.items()
    }


async def test_a_server_that_dedupes_on_the_key_has_its_tools_retried() -> None:
    async with FakeMCPServer(idempotent=True) as fake:
        run = await run_step(
            listing_workflow(oncely.mcp_tools(fake.url, name="shop")), {"text": "x"}
        )
    assert sorted(run.result.tools) == ["lookup_order:False", "refund:False"]


async def test_a_destructive_tool_is_at_most_once_a_crash_mid_call_is_never_resent_alone(
    fake: FakeMCPServer,
) -> None:
    shop = oncely.mcp_tools(fake.url, name="shop")
    workflow = agent_workflow(oncely.Agent("support", "Help.", [shop]))
    refund = ToolCalls(("refund", {"order_id": "A1", "cents": 1200}))
    run = await run_step(
        workflow,
        {"text": "Refund A1."},
        answers=[refund, "Refunded."],
        crash_after="support/refund/tool/intent",
        uncertain={"refund": {"result": {"refunded": True, "id": "re_1", "cents": 1200}}},
    )
    # The refund happened before the crash; a person said so; never sent again.
    assert fake.calls()["effects"] == 1 and fake.calls()["calls"] == 1
    assert run.result.tools == ["refund:ok"]
    assert "support/refund/tool/uncertain" in run.steps

    resent = await run_step(
        workflow,
        {"text": "Refund A1."},
        answers=[refund, "Refunded."],
        crash_after="support/refund/tool/intent",
        uncertain={"refund": "resend"},
        job_id="job-2",
    )
    # "resend": sent once more, with the same key.
    assert resent.result.tools == ["refund:ok"]
    assert fake.calls()["by_key"]["job-2:support/refund/tool"] == 2


# -- errors where they enter --------------------------------------------------------


async def test_a_server_that_is_down_is_a_transient_error() -> None:
    gone = oncely.mcp_tools("http://127.0.0.1:9/mcp", name="shop", timeout=5)
    with pytest.raises(TransientError) as raised:
        await run_step(listing_workflow(gone), {"text": "x"})
    assert isinstance(raised.value, NotSent)
    assert "nothing sent" in str(raised.value)


@pytest.mark.parametrize(("status", "error"), [(503, TransientError), (401, PermanentError)])
async def test_a_status_is_an_outage_or_a_refusal(
    fake: FakeMCPServer, status: int, error: type[Exception]
) -> None:
    fake.fail_next(100, status)
    with pytest.raises(error) as raised:
        await run_step(listing_workflow(oncely.mcp_tools(fake.url, name="shop")), {"text": "x"})
    assert raised.value.status == status  # type: ignore[attr-defined]
    if status == 401:  # said in the message, where a person reads it
        assert "(HTTP 401: unauthorized, check its headers)" in str(raised.value)


async def test_a_call_past_its_timeout_is_transient_for_a_read_only_tool(
    fake: FakeMCPServer,
) -> None:
    shop = oncely.mcp_tools(fake.url, name="shop", timeout=0.5)
    with pytest.raises(TransientError, match="timeout"):
        await run_step(
            agent_workflow(oncely.Agent("support", "Help.", [shop])),
            {"text": "x"},
            answers=[ToolCalls(("lookup_order", {"order_id": "A1 [[fake:hang]]"})), "never"],
        )
    # Retried in process like a step (the fake counts every attempt).
    assert fake.calls()["calls"] > 1


async def test_a_destructive_call_past_its_timeout_is_sent_once_and_asked_about(
    fake: FakeMCPServer,
) -> None:
    """At most once: a refund sent and never answered is not sent again in
    process (the retry loop's cut comes after the session's own bound); the
    person's word (scripted) decides it."""
    shop = oncely.mcp_tools(fake.url, name="shop", timeout=0.5)
    run = await run_step(
        agent_workflow(oncely.Agent("support", "Help.", [shop])),
        {"text": "x"},
        answers=[ToolCalls(("refund", {"order_id": "A1 [[fake:hang]]", "cents": 100})), "Told."],
        uncertain={"refund": "failed"},
        job_id="job-1",
    )
    assert fake.calls()["calls"] == 1
    assert fake.calls()["by_key"] == {"job-1:support/refund/tool": 1}
    assert "support/refund/tool/uncertain" in run.steps
    assert run.result.tools == ["refund:error"]


# -- headers ------------------------------------------------------------------------


async def test_headers_are_sent_and_never_logged_or_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with FakeMCPServer(token=TOKEN) as fake:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        shop = oncely.mcp_tools(fake.url, name="shop", headers=headers)
        workflow = agent_workflow(oncely.Agent("support", "Help.", [shop]))
        with capture_logs() as logs:
            run = await run_step(
                workflow,
                {"text": "x"},
                answers=[ToolCalls(("lookup_order", {"order_id": "A1"})), "Shipped."],
            )
            fake.fail_next(100, 503)  # a failure, logged and raised, names no header either
            with pytest.raises(TransientError) as raised:
                await run_step(listing_workflow(shop), {"text": "x"})
        without = oncely.mcp_tools(fake.url, name="shop")
        fake.fail_next(0)
        with pytest.raises(PermanentError):
            await run_step(listing_workflow(without), {"text": "x"})
    assert run.result.tools == ["lookup_order:ok"], "sent: the server refuses calls without it"
    stored = json.dumps([c.value for c in run.checkpoints], default=str)
    shown = [repr(logs), caplog.text, stored, repr(shop), str(raised.value)]
    assert not [text for text in shown if TOKEN in text]


# -- through a real worker (Redis, PostgreSQL) ---------------------------------------


async def test_a_worker_retries_a_job_whose_server_is_down_then_it_is_done(custom) -> None:
    async with FakeMCPServer() as fake:
        shop = oncely.mcp_tools(fake.url, name="shop", timeout=5)
        agent = oncely.Agent("support", "Help.", [shop])
        harness = await custom(oncely.App([agent_workflow(agent, "mcpdesk")]))
        fake.fail_next(1000, 503)
        job_id = await harness.submit(
            "/v1/mcpdesk", {"text": 'Where is A1? [[fake:tool=lookup_order {"order_id": "A1"}]]'}
        )
        worker = harness.worker("mcpdesk", redelivery_base_s=0.01, redelivery_max_s=0.05)
        await drain(worker)
        # Refused, not dead: the delivery failed transiently and will come again.
        assert await harness.status(job_id) != "dead"
        assert fake.calls()["calls"] == 0

        fake.fail_next(0)

        async def done() -> bool:
            return await harness.status(job_id) == "done"

        await redeliver_until(harness, worker, "mcpdesk", done)
        body = await harness.get("/v1/mcpdesk", job_id)
    assert body["result"]["tools"] == ["lookup_order:ok"]
    assert body["result"]["results"][0]["status"] == "shipped"
    assert fake.calls()["by_key"] == {f"{job_id}:support/lookup_order/tool": 1}
    assert fake.calls()["lists"] == 1
    outcomes = await harness.rows(
        "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id", job_id
    )
    assert [o for (o,) in outcomes] == ["retry", "done"]


# -- a framework's agent ------------------------------------------------------------


async def test_a_pydantic_ai_agent_takes_a_toolset(fake: FakeMCPServer) -> None:
    from pydantic_ai import Agent as PydanticAgent

    from oncely.integrations import pydantic_ai as oncely_pai

    shop = oncely.mcp_tools(fake.url, name="shop")
    agent = PydanticAgent(name="support", toolsets=[oncely_pai.as_tool(shop)])

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        result = await oncely_pai.run(ctx, agent, request.text)
        return Answer(reply=str(result.output), tools=[])

    workflow = oncely.Workflow(
        name="support", route="/v1/support", request=Ask, result=Answer, step=step
    )
    refund = ToolCalls(("refund", {"order_id": "A1", "cents": 1200}))
    run = await run_step(
        workflow,
        {"text": "Where is A1? Refund it."},
        answers=[ToolCalls(("lookup_order", {"order_id": "A1"})), refund, "Refunded."],
        job_id="job-3",
    )
    assert run.result.reply == "Refunded."
    # Listed once in the run, each call a tool checkpoint with the key; the
    # destructive refund at most once (its intent stored first).
    assert run.steps.count("support/shop.tools") == 1
    assert "support/lookup_order/tool" in run.steps
    assert "support/refund/tool/intent" in run.steps
    assert fake.calls()["lists"] == 1
    assert fake.calls()["by_key"] == {
        "job-3:support/lookup_order/tool": 1,
        "job-3:support/refund/tool": 1,
    }
    assert fake.calls()["effects"] == 1
    told = [m.content for m in run.calls[1].messages if m.role == "tool"]
    assert '"shipped"' in told[0]


@pytest.mark.slow
async def test_a_stdio_command_is_a_server_too() -> None:
    from mcp import StdioServerParameters

    root = ROOT
    command = StdioServerParameters(
        command=sys.executable,
        args=["-m", "tests.mcp_stdio_server"],
        env={"PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"},
        cwd=str(root),
    )
    shop = oncely.mcp_tools(command, name="shop", timeout=30)
    run = await run_step(
        agent_workflow(oncely.Agent("support", "Help.", [shop])),
        {"text": "Where is A1?"},
        answers=[ToolCalls(("lookup_order", {"order_id": "A1"})), "It shipped."],
    )
    assert run.result.tools == ["lookup_order:ok"]
    assert run.result.results[0]["status"] == "shipped"
