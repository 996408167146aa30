"""The fake MCP server (docs/fakes.md): real streamable HTTP, served by the
official ``mcp`` SDK (the extra ``oncely[mcp]``), with a shop's two tools.

- ``lookup_order(order_id)``, annotated read-only: the order, no effect.
- ``refund(order_id, cents)``, annotated destructive and not idempotent:
  each call is a refund (an effect), unless the server runs with
  ``idempotent=True`` (``oncely fake-mcp --idempotent``): then it declares
  ``experimental["io.oncely/idempotency"]`` and a call whose
  ``_meta["io.oncely/idempotency-key"]`` it has seen is answered the first
  call's result, with no new refund (a repeat while the first runs waits
  for it).

Faults, written in any string argument (counted per call, not per key):

- ``[[fake:error]]``: the call answers ``isError``, nothing happens;
- ``[[fake:slow]]``: the call takes ``slow_s`` more, after its effect;
- ``[[fake:hang]]``: the effect happens, the answer never comes (the
  client's timeout ends the call: what a crash mid-call looks like).

Routes besides ``/mcp``:

- ``GET /_calls``: ``{"lists", "calls", "by_key", "by_tool", "effects",
  "refunds"}``: every tools/list and tools/call counted (a call ``by_key``
  by its idempotency key, under ``""`` with none), and the refunds made.
- ``POST /_faults {"fail_next": N, "status": 503}``: the next N requests to
  ``/mcp`` are answered that status (a server that is down).
- ``POST /_reset`` forgets everything.

With ``token`` set, a request to ``/mcp`` without ``Authorization: Bearer
<token>`` is answered 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import structlog
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from oncely.mcp.client import CAPABILITY, KEY_META

MCP_PATH = "/mcp"
DEFAULT_SLOW_S = 2.0

log = structlog.get_logger(__name__)


@dataclass
class MCPState:
    """What the fake remembers."""

    idempotent: bool = False
    slow_s: float = DEFAULT_SLOW_S
    token: str | None = None
    calls: int = 0
    lists: int = 0
    by_key: Counter[str] = field(default_factory=Counter)
    by_tool: Counter[str] = field(default_factory=Counter)
    refunds: list[dict[str, Any]] = field(default_factory=list)
    # The first result per key (an idempotent server's), done or running.
    answers: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    fail_next: int = 0
    fail_status: int = 503

    def counted(self) -> dict[str, Any]:
        return {
            "lists": self.lists,
            "calls": self.calls,
            "by_key": dict(self.by_key),
            "by_tool": dict(self.by_tool),
            "effects": len(self.refunds),
            "refunds": list(self.refunds),
        }

    def count(self, tool: str, key: str) -> None:
        self.calls += 1
        self.by_key[key] += 1
        self.by_tool[tool] += 1

    def reset(self) -> None:
        self.calls, self.lists, self.fail_next = 0, 0, 0
        self.by_key.clear()
        self.by_tool.clear()
        self.refunds.clear()
        self.answers.clear()


def make_server(state: MCPState) -> MCPServer:
    """The SDK server with the shop's tools, counting into ``state``."""
    server: MCPServer = MCPServer("oncely-fake-mcp", log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def lookup_order(order_id: str, ctx: Context) -> dict[str, Any]:
        """Look an order up by its id: its status and total."""
        state.count("lookup_order", _key(ctx))
        _refuse_if_asked(order_id)
        await _delay_if_asked(state, order_id)
        return {"order_id": order_id, "status": "shipped", "total_cents": 4200}

    @server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=False))
    async def refund(order_id: str, cents: int, ctx: Context) -> dict[str, Any]:
        """Refund part of an order: money leaves the shop."""
        key = _key(ctx)
        state.count("refund", key)
        if state.idempotent and key:
            first = state.answers.get(key)
            if first is not None:
                return await asyncio.shield(first)
            state.answers[key] = asyncio.get_running_loop().create_future()
        try:
            answer = await _refunded(state, order_id, cents, key)
        except BaseException as exc:
            _settle(state, key, exc)
            raise
        _settle(state, key, answer)
        return answer

    async def counting(ctx: Any, call_next: Any) -> Any:
        """Counts listings; an idempotent fake declares the capability."""
        if ctx.method == "tools/list":
            state.lists += 1
        result = await call_next(ctx)
        declares = state.idempotent and ctx.method in ("initialize", "server/discover")
        if declares and isinstance(result, dict):
            capabilities = result.setdefault("capabilities", {})
            capabilities.setdefault("experimental", {})[CAPABILITY] = {}
        return result

    server.middleware.append(counting)
    return server


async def _refunded(state: MCPState, order_id: str, cents: int, key: str) -> dict[str, Any]:
    _refuse_if_asked(order_id)
    refund = {
        "order_id": order_id,
        "cents": cents,
        "key": key,
        "id": f"re_{len(state.refunds) + 1}",
    }
    state.refunds.append(refund)
    await _delay_if_asked(state, order_id)
    return {"refunded": True, "id": refund["id"], "cents": cents}


def _settle(state: MCPState, key: str, outcome: dict[str, Any] | BaseException) -> None:
    """The first call's outcome to the repeats that wait for it; a failure
    forgets the key (a repeat runs again)."""
    future = state.answers.get(key) if state.idempotent and key else None
    if future is None or future.done():
        return
    if isinstance(outcome, BaseException):
        del state.answers[key]
        future.cancel()
    else:
        future.set_result(outcome)


def _refuse_if_asked(text: str) -> None:
    """``[[fake:error]]``: a failure the SDK answers as a result with ``isError``."""
    if "[[fake:error]]" in text:
        raise ToolError("the shop refused: no such order")


async def _delay_if_asked(state: MCPState, text: str) -> None:
    if "[[fake:slow]]" in text:
        await asyncio.sleep(state.slow_s)
    if "[[fake:hang]]" in text:
        await asyncio.Event().wait()


def _key(ctx: Context) -> str:
    meta = ctx.request_context.meta or {}
    key = meta.get(KEY_META)
    return key if isinstance(key, str) else ""


class _Gate:
    """The fake's own routes and faults in front of the SDK's app."""

    def __init__(self, app: ASGIApp, state: MCPState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = await self._answer(Request(scope, receive))
        if response is None:
            await self.app(scope, receive, send)
        else:
            await response(scope, receive, send)

    async def _answer(self, request: Request) -> Response | None:
        state, path = self.state, request.url.path
        if path == "/_calls" and request.method == "GET":
            return JSONResponse(state.counted())
        if path == "/_faults" and request.method == "POST":
            body = json.loads(await request.body() or b"{}")
            state.fail_next = int(body.get("fail_next", 0))
            state.fail_status = int(body.get("status", 503))
            return JSONResponse({"fail_next": state.fail_next, "status": state.fail_status})
        if path == "/_reset" and request.method == "POST":
            state.reset()
            return JSONResponse(state.counted())
        if path != MCP_PATH:
            return None
        if state.fail_next > 0:
            state.fail_next -= 1
            return PlainTextResponse("down", status_code=state.fail_status)
        wanted = f"Bearer {state.token}"
        if state.token is not None and request.headers.get("authorization") != wanted:
            return PlainTextResponse("unauthorized", status_code=401)
        return None


def make_app(state: MCPState, host: str = "127.0.0.1") -> ASGIApp:
    server = make_server(state)
    sdk_app = server.streamable_http_app(
        streamable_http_path=MCP_PATH, json_response=True, stateless_http=True, host=host
    )
    return _Gate(sdk_app, state)


class Served:
    """An ASGI app served by uvicorn on ``host`` and ``port`` (0: a free
    one) for the span of an ``async with``: the fake's, or a test's own MCP
    server's. ``base_url`` once started."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None
        self.base_url = ""

    async def __aenter__(self) -> Served:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise RuntimeError("the server stopped as it started")
            await asyncio.sleep(0.01)
        bound_host, bound_port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.base_url = f"http://{bound_host}:{bound_port}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def wait(self) -> None:
        """Until the server stops; a cancelled wait leaves it to ``stop``."""
        if self._task is not None:
            await asyncio.shield(self._task)


async def serve_fake_mcp(
    host: str,
    port: int,
    *,
    idempotent: bool = False,
    slow_s: float = DEFAULT_SLOW_S,
    token: str | None = None,
) -> None:
    """Serve until cancelled."""
    state = MCPState(idempotent=idempotent, slow_s=slow_s, token=token)
    async with Served(make_app(state, host), host, port) as served:
        log.info("fake_mcp.listening", url=served.base_url + MCP_PATH, idempotent=idempotent)
        await served.wait()


class FakeMCPServer:
    """The fake on 127.0.0.1 and a free port, for the span of an ``async with``."""

    def __init__(
        self, *, idempotent: bool = False, slow_s: float = DEFAULT_SLOW_S, token: str | None = None
    ) -> None:
        self.state = MCPState(idempotent=idempotent, slow_s=slow_s, token=token)
        self._served = Served(make_app(self.state))

    @property
    def base_url(self) -> str:
        return self._served.base_url

    @property
    def url(self) -> str:
        return self.base_url + MCP_PATH

    def calls(self) -> dict[str, Any]:
        """What ``GET /_calls`` answers."""
        return self.state.counted()

    def fail_next(self, n: int, status: int = 503) -> None:
        """What ``POST /_faults`` scripts."""
        self.state.fail_next, self.state.fail_status = n, status

    async def __aenter__(self) -> FakeMCPServer:
        await self._served.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._served.stop()
