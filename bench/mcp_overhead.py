"""What an MCP tool call costs through oncely (docs/mcp.md), against the same
call made straight with the ``mcp`` SDK, to the fake MCP server in process:

- ``sdk_session``: one SDK session kept open, ``call_tool`` after
  ``call_tool`` (the floor: no connection set up per call);
- ``sdk_fresh``: a new SDK ``Client`` per call, as a one-off caller makes it
  (the SDK probes the server, then lists the tools again to check the result);
- ``oncely``: an ``oncely.mcp_tools`` tool run by ``Tool.invoke`` in a step
  (``oncely.testing``: the checkpoints are kept in memory, so this is the
  client's cost, without PostgreSQL's).

Each prints p50 and p99 in milliseconds over ``--calls`` calls of the
read-only ``lookup_order``.

    .venv/bin/python -m bench.mcp_overhead --calls 300
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from mcp import Client
from mcp_types import RequestParamsMeta
from pydantic import BaseModel

import oncely
from oncely.fakes.mcp import FakeMCPServer
from oncely.mcp import KEY_META
from oncely.testing import run_step


class _Ask(BaseModel):
    text: str


class _Done(BaseModel):
    calls: int


def _ms(times: list[float], share: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] * 1000


async def _timed(calls: int, one: Callable[[int], Awaitable[Any]]) -> list[float]:
    times = []
    for n in range(calls):
        start = time.perf_counter()
        await one(n)
        times.append(time.perf_counter() - start)
    return times


def _meta(n: int) -> RequestParamsMeta:
    return cast(RequestParamsMeta, {KEY_META: f"bench:{n}"})


async def _sdk_session(url: str, calls: int) -> list[float]:
    async with Client(url, cache=None) as client:
        await client.list_tools()

        async def one(n: int) -> Any:
            return await client.call_tool("lookup_order", {"order_id": f"A{n}"}, meta=_meta(n))

        return await _timed(calls, one)


async def _sdk_fresh(url: str, calls: int) -> list[float]:
    async def one(n: int) -> Any:
        async with Client(url, cache=None) as client:
            return await client.call_tool("lookup_order", {"order_id": f"A{n}"}, meta=_meta(n))

    return await _timed(calls, one)


async def _oncely(url: str, calls: int) -> list[float]:
    shop = oncely.mcp_tools(url, name="shop")
    measured: list[float] = []

    async def step(request: _Ask, ctx: oncely.Context) -> _Done:
        tool = {t.name: t for t in await shop.tools(ctx)}["lookup_order"]

        async def one(n: int) -> Any:
            with ctx.scope(f"call{n}"):
                return await tool.invoke(ctx, {"order_id": f"A{n}"})

        measured.extend(await _timed(calls, one))
        return _Done(calls=calls)

    workflow = oncely.Workflow(
        name="bench", route="/v1/bench", request=_Ask, result=_Done, step=step
    )
    await run_step(workflow, {"text": "x"})
    return measured


async def main(calls: int) -> None:
    async with FakeMCPServer() as fake:
        for name, way in (
            ("sdk_session", _sdk_session),
            ("sdk_fresh", _sdk_fresh),
            ("oncely", _oncely),
        ):
            times = await way(fake.url, calls)
            print(f"{name:12} p50 {_ms(times, 0.5):7.2f} ms   p99 {_ms(times, 0.99):7.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    asyncio.run(main(parser.parse_args().calls))
