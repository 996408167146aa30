"""An MCP server you own, honouring oncely's key (``oncely.mcp.idempotent``,
docs/mcp.md): written with the ``mcp`` SDK, served over streamable HTTP,
its keys in real PostgreSQL. The first call with a key runs and its result
is stored; a repeat, concurrent or later, is answered the stored result and
the tool's effect happens once; failures store nothing; the capability is
declared, so oncely retries its tools instead of asking a person."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import RequestParamsMeta, ToolAnnotations
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

import oncely
from oncely.fakes.mcp import MCP_PATH, Served
from oncely.mcp import CAPABILITY, KEY_META, IdempotentCalls, idempotent
from oncely.testing import ToolCalls, run_step
from tests.durable import until_async


@dataclass
class Shop:
    """A payment tool that does not dedupe by itself: each run is a refund."""

    refunds: list[tuple[str, int]] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event | None = None
    fail_next: int = 0

    def server(self) -> MCPServer:
        server = MCPServer("shop", log_level="WARNING")

        async def refund(order_id: str, cents: int) -> dict[str, Any]:
            """Refund part of an order."""
            self.started.set()
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_next:
                self.fail_next -= 1
                raise ToolError("the bank is down")
            self.refunds.append((order_id, cents))
            return {"refund": len(self.refunds), "cents": cents}

        server.add_tool(refund, annotations=ToolAnnotations(destructive_hint=True))
        return server


@dataclass
class Owned:
    shop: Shop
    calls: IdempotentCalls
    url: str
    pool: AsyncConnectionPool

    async def call(self, key: str | None, cents: int = 500) -> dict[str, Any]:
        """One tools/call through the SDK's client, with ``key`` in ``_meta``."""
        meta = cast(RequestParamsMeta, {KEY_META: key}) if key is not None else None
        async with Client(self.url, cache=None) as client:
            result = await client.call_tool("refund", {"order_id": "A1", "cents": cents}, meta=meta)
        answer: dict[str, Any] = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        return answer

    async def waiting_on_locks(self, n: int) -> bool:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            row = await cur.fetchone()
        return row is not None and row[0] == n

    async def rows(self) -> list[tuple[Any, ...]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT key, result IS NOT NULL FROM oncely_mcp_keys")
            return await cur.fetchall()


@pytest.fixture
async def owned(database_url: str, pool: AsyncConnectionPool) -> AsyncIterator[Owned]:
    shop = Shop()
    server = shop.server()
    calls = idempotent(server, database_url, ttl_s=3600)
    app = server.streamable_http_app(json_response=True, stateless_http=True)
    async with Served(app) as served:
        yield Owned(shop, calls, served.base_url + MCP_PATH, pool)
    await calls.aclose()


def structured(answer: dict[str, Any]) -> Any:
    return answer.get("structuredContent")


async def test_a_repeat_is_answered_from_storage_and_the_effect_happens_once(
    owned: Owned,
) -> None:
    first = await owned.call("job-1:support/refund/tool")
    again = await owned.call("job-1:support/refund/tool")
    assert structured(first) == structured(again) == {"refund": 1, "cents": 500}
    assert owned.shop.refunds == [("A1", 500)]
    assert await owned.rows() == [("job-1:support/refund/tool", True)]

    # Another key is another call; no key, no storing.
    await owned.call("job-2:support/refund/tool")
    await owned.call(None)
    await owned.call(None)
    assert len(owned.shop.refunds) == 4
    assert len(await owned.rows()) == 2


async def test_concurrent_repeats_wait_for_the_first(owned: Owned) -> None:
    owned.shop.gate = asyncio.Event()
    first = asyncio.create_task(owned.call("job-1:k"))
    await asyncio.wait_for(owned.shop.started.wait(), 10)
    repeats = [asyncio.create_task(owned.call("job-1:k")) for _ in range(3)]
    # Each repeat waits in PostgreSQL, on the first call's row.
    await until_async(lambda: owned.waiting_on_locks(3))
    owned.shop.gate.set()
    answers = await asyncio.gather(first, *repeats)
    assert owned.shop.refunds == [("A1", 500)]
    assert [structured(a) for a in answers] == [{"refund": 1, "cents": 500}] * 4


async def test_a_failed_call_stores_nothing_and_a_repeat_runs_it(owned: Owned) -> None:
    owned.shop.fail_next = 1
    failed = await owned.call("job-1:k")
    assert failed["isError"] is True
    assert await owned.rows() == []
    answer = await owned.call("job-1:k")
    assert structured(answer) == {"refund": 1, "cents": 500}
    assert owned.shop.refunds == [("A1", 500)]


async def test_a_key_reused_for_other_arguments_is_refused(owned: Owned) -> None:
    await owned.call("job-1:k", cents=500)
    with pytest.raises(Exception) as raised:  # the SDK raises a group: unwrapped below
        await owned.call("job-1:k", cents=9999)
    refusal = raised.value
    while isinstance(refusal, BaseExceptionGroup):
        refusal = refusal.exceptions[0]
    assert isinstance(refusal, MCPError) and "another call" in str(refusal)
    assert owned.shop.refunds == [("A1", 500)]


async def test_an_expired_key_is_a_new_call(owned: Owned) -> None:
    await owned.call("job-1:k")
    async with owned.pool.connection() as conn:
        await conn.execute("UPDATE oncely_mcp_keys SET created_at = now() - interval '2 hours'")
    await owned.call("job-1:k")
    assert len(owned.shop.refunds) == 2
    assert await owned.rows() == [("job-1:k", True)]


async def test_the_capability_is_declared_and_oncely_retries_its_tools(owned: Owned) -> None:
    async with Client(owned.url, cache=None) as client:
        assert CAPABILITY in (client.server_capabilities.experimental or {})

    class Ask(BaseModel):
        text: str

    class Answer(BaseModel):
        tools: list[str]

    shop = oncely.mcp_tools(owned.url, name="shop")
    agent = oncely.Agent("support", "Help.", [shop])

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        listed = [f"{t.name}:{t.at_most_once}" for t in await shop.tools(ctx)]
        run = await agent.run(ctx, request.text)
        return Answer(tools=listed + [f"{c.tool}:{c.status}" for c in run.tool_calls])

    workflow = oncely.Workflow(
        name="support", route="/v1/support", request=Ask, result=Answer, step=step, agents=[agent]
    )
    refund = ToolCalls(("refund", {"order_id": "A1", "cents": 500}))
    # Two deliveries of one job that both reach the call (the first one's
    # checkpoint lost with its worker): the same key, one refund.
    for _ in range(2):
        run = await run_step(workflow, {"text": "x"}, answers=[refund, "Done."], job_id="job-7")
        assert run.result.tools == ["refund:False", "refund:ok"]
        assert "support/refund/tool/intent" not in run.steps
    assert owned.shop.refunds == [("A1", 500)]
    assert await owned.rows() == [("job-7:support/refund/tool", True)]
