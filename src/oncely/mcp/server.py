"""An MCP server you own, honouring oncely's key (docs/mcp.md, "Servers you own").

``idempotent(server, dsn)`` adds a middleware to an ``mcp`` SDK server
(``MCPServer``, the SDK's FastMCP, or its low-level ``Server``) that

- declares ``experimental["io.oncely/idempotency"]`` in what ``initialize``
  and ``server/discover`` answer, so oncely retries the server's tools with
  the same key instead of running them at most once;
- runs a ``tools/call`` carrying ``_meta["io.oncely/idempotency-key"]`` in
  a PostgreSQL transaction that first inserts the key's row
  (``oncely_mcp_keys``), then runs the call, then stores its result: a
  repeat finds the row and is answered the stored result without running
  the tool; a concurrent repeat waits on the row's lock for the first to
  end; a call that fails, or answers ``isError``, stores nothing (its
  transaction rolls back), so a repeat runs it again. A key reused with
  other arguments is refused (``INVALID_PARAMS``).

The table lives in the server's database (``dsn``), not oncely's: the
helper creates it on its first keyed call. Rows are kept
``ONCELY_MCP_KEYS_TTL_S`` (7 days), then swept. A keyed call holds one
pooled connection while it runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.mcp.client import CAPABILITY, KEY_META
from oncely.sql import query

# The longest key taken: oncely's are ``<job id>:<checkpoint key>``.
KEY_MAX_CHARS = 1024
# How often expired rows are deleted, at most.
_SWEEP_EVERY_S = 60.0
# How many times a claim is tried when the row it lost to vanished (swept).
_CLAIMS = 3

log = structlog.get_logger("oncely.mcp.server")


class _NotKept(Exception):
    """Rolls back a call's transaction: its outcome is not stored."""

    def __init__(self, result: HandlerResult) -> None:
        super().__init__("not kept")
        self.result = result


class IdempotentCalls:
    """The middleware ``idempotent`` adds (module docstring). ``aclose()``
    closes its connection pool."""

    def __init__(self, dsn: str, *, ttl_s: float, pool_size: int = 10) -> None:
        self.ttl_s = ttl_s
        self._pool = AsyncConnectionPool(
            dsn, min_size=1, max_size=pool_size, open=False, kwargs={"autocommit": True}
        )
        self._opened = False
        self._opening = asyncio.Lock()
        self._swept_at = 0.0

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if ctx.method in ("initialize", "server/discover"):
            return _declaring(await call_next(ctx))
        key = _key_of(ctx.params) if ctx.method == "tools/call" else None
        if key is None:
            return await call_next(ctx)
        return await self.once(key, _fingerprint(ctx.params or {}), lambda: call_next(ctx))

    async def once(
        self, key: str, fingerprint: str, run: Callable[[], Awaitable[HandlerResult]]
    ) -> HandlerResult:
        """``run()``'s result for ``key``: stored, or run now and stored."""
        await self._ready()
        for _ in range(_CLAIMS):
            try:
                async with self._pool.connection() as conn, conn.transaction():
                    claimed = await conn.execute(
                        query("mcp_key_claim"),
                        {"key": key, "fingerprint": fingerprint, "ttl_s": self.ttl_s},
                    )
                    if await claimed.fetchone() is None:
                        found = await conn.execute(query("mcp_key_stored"), {"key": key})
                        stored = await found.fetchone()
                        if stored is None:
                            continue  # swept meanwhile: claim again
                        return _stored(stored, fingerprint)
                    result = await run()
                    if not _keepable(result):
                        raise _NotKept(result)
                    await conn.execute(query("mcp_key_done"), {"key": key, "result": Jsonb(result)})
                    return result
            except _NotKept as not_kept:
                return not_kept.result
        # The key's row kept vanishing under us: never run it without one
        # (a repeat could run it again). The client retries with the key.
        raise MCPError(INTERNAL_ERROR, f"{KEY_META} could not be claimed; try again")

    async def _ready(self) -> None:
        """The pool open and the table there (once), expired rows swept
        (at most once a minute)."""
        if not self._opened:
            async with self._opening:
                if not self._opened:
                    await self._pool.open(wait=True)
                    async with self._pool.connection() as conn:
                        await conn.execute(query("mcp_keys_create"))
                    self._opened = True
        if time.monotonic() - self._swept_at > _SWEEP_EVERY_S:
            self._swept_at = time.monotonic()
            async with self._pool.connection() as conn:
                swept = await conn.execute(query("mcp_keys_sweep"), {"ttl_s": self.ttl_s})
            if swept.rowcount:
                log.info("mcp.keys_swept", rows=swept.rowcount)

    async def aclose(self) -> None:
        await self._pool.close()


def idempotent(server: Any, dsn: str, *, ttl_s: float | None = None) -> IdempotentCalls:
    """Make ``server`` (an ``mcp`` SDK ``MCPServer`` or low-level ``Server``)
    honour oncely's idempotency key, its results kept in the PostgreSQL
    database ``dsn`` for ``ttl_s`` seconds (``ONCELY_MCP_KEYS_TTL_S`` by
    default). Returns the middleware added, whose ``aclose()`` closes its
    pool. Connects to nothing until the first keyed call."""
    middleware = getattr(server, "middleware", None)
    if not isinstance(middleware, list):
        raise TypeError("idempotent(server, dsn): an mcp SDK MCPServer or Server")
    if ttl_s is None:
        from oncely.settings import Settings

        ttl_s = Settings().mcp_keys_ttl_s
    calls = IdempotentCalls(dsn, ttl_s=ttl_s)
    middleware.append(calls)
    return calls


def _declaring(result: HandlerResult) -> HandlerResult:
    """An ``initialize`` or ``server/discover`` answer with the capability."""
    if isinstance(result, dict) and isinstance(result.get("capabilities"), dict):
        capabilities = dict(result["capabilities"])
        capabilities["experimental"] = {**(capabilities.get("experimental") or {}), CAPABILITY: {}}
        return {**result, "capabilities": capabilities}
    return result


def _key_of(params: Mapping[str, Any] | None) -> str | None:
    """The call's key, or None (no key: the call runs as any other)."""
    meta = (params or {}).get("_meta")
    key = meta.get(KEY_META) if isinstance(meta, Mapping) else None
    if key is None:
        return None
    if not isinstance(key, str) or not 0 < len(key) <= KEY_MAX_CHARS:
        raise MCPError(INVALID_PARAMS, f"{KEY_META} must be 1-{KEY_MAX_CHARS} characters")
    return key


def _fingerprint(params: Mapping[str, Any]) -> str:
    """What a repeat must ask again: the tool and its arguments."""
    asked = {"name": params.get("name"), "arguments": params.get("arguments") or {}}
    text = json.dumps(asked, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _stored(row: tuple[Any, ...], fingerprint: str) -> HandlerResult:
    stored_fingerprint, result = row
    if stored_fingerprint != fingerprint:
        raise MCPError(INVALID_PARAMS, f"{KEY_META} was used for another call")
    return dict(result)


def _keepable(result: HandlerResult) -> bool:
    """A complete result that is no error: what a repeat is answered."""
    return (
        isinstance(result, dict)
        and not result.get("isError")
        and result.get("resultType", "complete") == "complete"
    )
