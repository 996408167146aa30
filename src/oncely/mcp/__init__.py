"""Tools from MCP servers, and MCP servers that honour oncely's key (docs/mcp.md).

- ``oncely.mcp_tools(server, name=...)`` (``oncely.mcp.client``): an MCP
  server's tools as an ``oncely.Toolset`` for ``oncely.Agent``: listed once
  per run, each call a tool checkpoint carrying the stable key in
  ``_meta["io.oncely/idempotency-key"]``, at most once unless the tool or
  the server says it is safe to send again.
- ``oncely.mcp.idempotent(server, dsn)`` (``oncely.mcp.server``): a server
  written with the ``mcp`` SDK runs each key's call once, its result kept in
  PostgreSQL, and says so (``experimental["io.oncely/idempotency"]``).

Needs the extra ``oncely[mcp]`` (the official ``mcp`` SDK); ``import
oncely`` imports neither module, and neither connects to anything when
imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.lazy import exports

_EXPORTS = {
    "CAPABILITY": "oncely.mcp.client",
    "KEY_META": "oncely.mcp.client",
    "MCPToolError": "oncely.mcp.client",
    "MCPToolset": "oncely.mcp.client",
    "NotSent": "oncely.errors",
    "OutcomeUnknown": "oncely.mcp.client",
    "mcp_tools": "oncely.mcp.client",
    "IdempotentCalls": "oncely.mcp.server",
    "idempotent": "oncely.mcp.server",
}

__all__ = [
    "CAPABILITY",
    "KEY_META",
    "IdempotentCalls",
    "MCPToolError",
    "MCPToolset",
    "NotSent",
    "OutcomeUnknown",
    "idempotent",
    "mcp_tools",
]

if TYPE_CHECKING:
    from oncely.errors import NotSent
    from oncely.mcp.client import (
        CAPABILITY,
        KEY_META,
        MCPToolError,
        MCPToolset,
        OutcomeUnknown,
        mcp_tools,
    )
    from oncely.mcp.server import IdempotentCalls, idempotent

__getattr__ = exports(globals(), _EXPORTS)


def __dir__() -> list[str]:
    return __all__
