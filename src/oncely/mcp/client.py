"""An MCP server's tools as an ``oncely.Toolset`` (docs/mcp.md).

``mcp_tools(server, name=...)`` connects to nothing when made. In a run,
its listing (``tools/list``) is a step checkpoint (``<name>.tools`` in the
agent's scope): a job in flight keeps the tools it saw, and a replay asks
the server nothing. Each tool is an ``oncely.Tool`` whose run is one
``tools/call`` carrying the call's stable key (``oncely.tool_key()``) in
``_meta["io.oncely/idempotency-key"]``.

What a server sends is untrusted: a tool whose name breaks the tool-name
rule (after ``prefix``) or whose input schema is no JSON schema is left out
and counted in a log line that names neither; text from the server reaches
the model only, cut short and on one line.

Each tool is retried like a step when its annotations say it is read-only
or idempotent, or when the server declares
``experimental["io.oncely/idempotency"]`` (it dedupes on the key: exactly
once); every other tool is at most once (``Tool(at_most_once=True)``:
never sent twice without a person or a reconcile saying so). ``at_most_once=``
and ``retry=`` override that for all tools or by the server's names.

Errors are translated where they enter: a server that cannot be reached,
answers 5xx, 408 or 429, or does not answer in ``timeout`` is a
``TransientError`` (``NotSent`` when the request surely never reached it);
a result with ``isError`` is ``MCPToolError`` (a ``PermanentError``: the
model is told it); any other refusal is a ``PermanentError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import ssl
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import httpx2
import structlog
from jsonschema.exceptions import SchemaError
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import (
    REQUEST_TIMEOUT,
    CallToolRequest,
    CallToolRequestParams,
    CallToolResult,
    Implementation,
    RequestParamsMeta,
    TextContent,
)
from mcp_types import Tool as ServerTool
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from oncely import __version__
from oncely.context import Context, current_context, tool_key
from oncely.errors import NotSent, OncelyError, PermanentError, TransientError
from oncely.retry import call_with_retries, retryable_status
from oncely.tools import Tool, Toolset, schema_args, scripted_listing, valid_tool_name

# The key a tools/call carries in ``_meta``, and the capability a server
# that dedupes on it declares under ``experimental`` (docs/mcp.md).
KEY_META = "io.oncely/idempotency-key"
CAPABILITY = "io.oncely/idempotency"

# How long after the session's own bound an at-most-once call's attempt is
# cut off by the retry loop (``_call``).
_CUT_AFTER_S = 0.5
# What a refusal's status means, where a person would ask.
_STATUS_WORD = {401: ": unauthorized, check its headers", 403: ": forbidden", 404: ": no such path"}
# How many pages of tools/list are read at most: a paginator that never
# ends cannot hold a run.
_MAX_PAGES = 50
# How much of a server's text the model is told.
_TEXT_CHARS = 2000
_PREFIX = re.compile(r"^[a-z][a-z0-9_-]{0,30}$")

log = structlog.get_logger("oncely.mcp")

Names = bool | Collection[str] | None


class OutcomeUnknown(OncelyError):
    """A tools/call was sent and no answer came (a timeout, a 5xx, a
    connection lost mid-call): whether it happened is unknown. Raised by
    at-most-once tools only, never retried in process: the at-most-once
    machinery asks a reconcile or a person (docs/mcp.md)."""


class MCPToolError(PermanentError):
    """The server answered the call with ``isError``: the model is told its text."""


@dataclass(frozen=True)
class Policy:
    """Which tools run at most once: ``at_most_once`` and ``retry`` name
    tools by the server's names, or say True (all) or False (none)."""

    at_most_once: Names = None
    retry: Names = None
    overrides: Mapping[str, bool] = field(init=False, default_factory=dict)
    default: bool | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        defaults = {_all(self.at_most_once, True), _all(self.retry, False)} - {None}
        if len(defaults) > 1:
            raise ValueError("at_most_once= and retry= say opposite things for every tool")
        amo, retried = _named(self.at_most_once), _named(self.retry)
        both = sorted(amo & retried)
        if both:
            raise ValueError(f"tool {both[0]!r} is named in both at_most_once= and retry=")
        for name in amo | retried:
            if not valid_tool_name(name):
                raise ValueError(f"at_most_once=/retry= name {name!r} is no tool name")
        overrides = {**dict.fromkeys(amo, True), **dict.fromkeys(retried, False)}
        object.__setattr__(self, "overrides", overrides)
        object.__setattr__(self, "default", next(iter(defaults), None))

    def at_most_once_for(self, tool: Mapping[str, Any], dedupes: bool) -> bool:
        """Whether ``tool`` (a listed entry) runs at most once on a server
        that does (``dedupes``) or does not honour the key."""
        name = tool["server_name"]
        if name in self.overrides:
            return self.overrides[name]
        if self.default is not None:
            return self.default
        if tool["read_only"] or tool["idempotent"]:
            return False
        return not dedupes


def _all(names: Names, means: bool) -> bool | None:
    """What a bool for every tool says of at most once (None: no bool)."""
    if isinstance(names, bool):
        return means if names else not means
    return None


def _named(names: Names) -> set[str]:
    if names is None or isinstance(names, bool):
        return set()
    if isinstance(names, str):
        return {names}
    return set(names)


class MCPToolset(Toolset):
    """The tools of one MCP server (``mcp_tools``)."""

    def __init__(
        self,
        server: str | Sequence[str] | StdioServerParameters,
        *,
        name: str,
        headers: Mapping[str, str] | None = None,
        prefix: str | None = None,
        at_most_once: Names = None,
        retry: Names = None,
        approval: Names = None,
        timeout: float = 60.0,
    ) -> None:
        if not valid_tool_name(name):
            raise ValueError(f"toolset name {name!r}: 1-63 of a-z, 0-9, _ and -, from a letter")
        if prefix is not None and not _PREFIX.match(prefix):
            raise ValueError(f"prefix {prefix!r}: 1-31 of a-z, 0-9, _ and -, from a letter")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.name = name
        self.prefix = prefix or ""
        self.timeout = float(timeout)
        self.policy = Policy(at_most_once, retry)
        self._approval = approval
        self.approval = bool(approval)
        self._server = _server(server)
        if headers and not isinstance(self._server, str):
            raise ValueError("headers= are sent to an HTTP server; a stdio server takes env")
        # Never logged, never stored: sent with each request only.
        self._headers = dict(headers or {})
        # Made on first use and shared by every request: making one costs
        # more than a local call (it loads the trusted certificates).
        self._tls: ssl.SSLContext | None = None

    def __repr__(self) -> str:
        return f"MCPToolset(name={self.name!r})"

    async def tools(self, ctx: Context) -> Sequence[Tool]:
        listed = await ctx.step(f"{self.name}.tools", self._listed)
        dedupes = bool(listed["dedupes"])
        mode = _mode(str(listed["protocol"]))
        return tuple(self._tool(entry, dedupes, mode) for entry in listed["tools"])

    # -- tools/list ----------------------------------------------------------

    async def _listed(self) -> dict[str, Any]:
        """The server's tools as the checkpoint keeps them: the usable ones,
        and whether the server dedupes on the key."""
        script = scripted_listing(self.name)
        if script is not None:
            return self._scripted(script)
        async with self._session(_Wire(), "auto") as client:
            experimental = client.server_capabilities.experimental or {}
            protocol = client.protocol_version
            found: list[ServerTool] = []
            cursor = None
            for _ in range(_MAX_PAGES):
                page = await client.list_tools(cursor=cursor)
                found.extend(page.tools)
                cursor = page.next_cursor
                if not cursor:
                    break
        tools, skipped = self._usable(found)
        if skipped:
            log.warning("mcp.tools_skipped", toolset=self.name, skipped=skipped)
        return {"dedupes": CAPABILITY in experimental, "protocol": protocol, "tools": tools}

    def _scripted(self, script: Any) -> dict[str, Any]:
        """The listing a test scripted (``run_step(toolsets=...)``,
        docs/testing.md): tools as ``tools/list`` answers them (a name alone
        is a tool without annotations that takes any object), or
        ``{"tools": [...], "idempotent": True}`` for a server that declares
        the capability. Asks the server nothing."""
        dedupes = False
        if isinstance(script, Mapping):
            dedupes = bool(script.get("idempotent", False))
            script = script.get("tools", ())
        if isinstance(script, str) or not isinstance(script, Sequence):
            raise TypeError(f"toolsets={{{self.name!r}: ...}}: a list of tools")
        found = [
            ServerTool(name=entry, input_schema={"type": "object"})
            if isinstance(entry, str)
            else entry
            if isinstance(entry, ServerTool)
            else ServerTool.model_validate(entry)
            for entry in script
        ]
        tools, skipped = self._usable(found)
        if skipped:
            raise ValueError(
                f"toolsets={{{self.name!r}: ...}}: {skipped} of the tools have a name that is"
                " no tool name, or twice, or a schema that is no JSON schema"
            )
        # No protocol version: a call to the server (a tool not scripted) shakes hands first.
        return {"dedupes": dedupes, "protocol": "", "tools": tools}

    def _usable(self, found: Sequence[ServerTool]) -> tuple[list[dict[str, Any]], int]:
        tools: list[dict[str, Any]] = []
        seen: set[str] = set()
        for tool in found:
            name = self.prefix + tool.name
            if not valid_tool_name(name) or name in seen or not _is_schema(name, tool.input_schema):
                continue
            seen.add(name)
            hints = tool.annotations
            tools.append(
                {
                    "name": name,
                    "server_name": tool.name,
                    "description": _text(tool.description or ""),
                    "schema": tool.input_schema,
                    "read_only": bool(hints and hints.read_only_hint),
                    "idempotent": bool(hints and hints.idempotent_hint),
                }
            )
        return tools, len(found) - len(tools)

    def _tool(self, entry: Mapping[str, Any], dedupes: bool, mode: str) -> Tool:
        server_name = str(entry["server_name"])
        at_most_once = self.policy.at_most_once_for(entry, dedupes)
        how = _How(server_name, at_most_once, mode)

        async def call(**arguments: Any) -> Any:
            return await self._call(how, arguments)

        return Tool(
            str(entry["name"]),
            str(entry["description"]),
            schema_args(str(entry["name"]), entry["schema"]),
            fn=call,
            approval=self._asks(server_name),
            at_most_once=at_most_once,
        )

    def _asks(self, server_name: str) -> bool:
        if isinstance(self._approval, bool) or self._approval is None:
            return bool(self._approval)
        return server_name in _named(self._approval)

    # -- tools/call ----------------------------------------------------------

    async def _call(self, how: _How, arguments: dict[str, Any]) -> Any:
        """One tools/call with the stable key. At most once, a request that
        never left is sent again here (nothing can happen twice), and one
        whose outcome is unknown is ``OutcomeUnknown``, never retried."""
        key = tool_key()
        if not how.at_most_once:
            return await self._sent(how, arguments, key, self.timeout)
        ctx = current_context()
        # The retry loop cuts an attempt off a little after the session's own
        # bound, so that a call sent and not answered ends in the session, as
        # ``OutcomeUnknown``, never as a timeout the loop would send again.
        policy = replace(ctx.model.policy, per_call_timeout_s=self.timeout + _CUT_AFTER_S)

        async def attempt(timeout_s: float) -> Any:
            return await self._sent(how, arguments, key, timeout_s - _CUT_AFTER_S)

        return await call_with_retries(
            attempt, policy=policy, deadline=ctx.model.deadline, what="mcp"
        )

    async def _sent(
        self,
        how: _How,
        arguments: dict[str, Any],
        key: str,
        timeout_s: float,
    ) -> Any:
        """The call, as the SDK's session sends it, within ``timeout_s``, but
        without the SDK's listing of the tools again to check the result's
        shape: a request after the effect, which could fail it."""
        request = CallToolRequest(
            params=CallToolRequestParams(
                name=how.server_name,
                arguments=arguments,
                _meta=cast(RequestParamsMeta, {KEY_META: key}),
            )
        )
        wire = _Wire(at_most_once=how.at_most_once)
        async with self._session(wire, how.mode, timeout_s) as client:
            wire.sent = True
            result = await client.session.send_request(
                request, CallToolResult, request_read_timeout_seconds=timeout_s
            )
        return _result(result)

    # -- the connection ------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _session(
        self, wire: _Wire, mode: str, timeout_s: float | None = None
    ) -> AsyncIterator[Client]:
        """A session with the server for one request, within ``timeout_s``
        (default: ``timeout``); what fails in it is translated to oncely's
        errors (``_translated``), a timeout included."""
        bound = self.timeout if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(bound), self._transport(wire, mode) as client:
                yield client
        except OncelyError:
            raise
        except Exception as exc:
            raise _translated(self.name, exc, wire) from None

    @contextlib.asynccontextmanager
    async def _transport(self, wire: _Wire, mode: str) -> AsyncIterator[Client]:
        options: dict[str, Any] = {
            "read_timeout_seconds": self.timeout,
            "client_info": Implementation(name="oncely", version=__version__),
            "cache": None,
            "mode": mode,
        }
        if not isinstance(self._server, str):
            async with Client(self._server, **options) as client:
                yield client
            return
        if self._tls is None:
            self._tls = httpx2.create_ssl_context()
        http = httpx2.AsyncClient(
            headers=self._headers,
            timeout=httpx2.Timeout(self.timeout),
            verify=self._tls,
            event_hooks={"response": [wire.saw]},
        )
        transport = streamable_http_client(self._server, http_client=http)
        async with http, Client(transport, **options) as client:
            yield client


@dataclass(frozen=True)
class _How:
    """How one listed tool is called: its name on the server, whether at
    most once, and the protocol mode (``_mode``)."""

    server_name: str
    at_most_once: bool
    mode: str


@dataclass
class _Wire:
    """What one request went through: the last error status an HTTP server
    answered (the SDK reports every one as the same JSON-RPC error, and
    only the status tells an outage, 5xx, from a refusal, 401), and whether
    the tools/call was sent (the session was up)."""

    at_most_once: bool = False
    sent: bool = False
    status: int | None = None

    async def saw(self, response: httpx2.Response) -> None:
        if response.status_code >= 400:
            self.status = response.status_code


def _translated(toolset: str, exc: Exception, wire: _Wire) -> OncelyError:
    """What a failure of a request to the server is, by what the SDK raised
    (the first of a group), the status seen and whether the call was sent."""
    leaf = _first_leaf(exc)
    where = f"MCP server {toolset!r}"
    reason = _reason(leaf, wire.status)
    if reason is None:
        if wire.sent and wire.at_most_once and not isinstance(leaf, MCPError):
            # Sent, and answered with something unreadable: it may have happened.
            return OutcomeUnknown(f"{where}: a tools/call answered {type(leaf).__name__}")
        message = _text(str(leaf), 300) if isinstance(leaf, MCPError) else type(leaf).__name__
        said = (
            ""
            if wire.status is None
            else f" (HTTP {wire.status}{_STATUS_WORD.get(wire.status, '')})"
        )
        return PermanentError(f"{where} refused the request{said}: {message}", status=wire.status)
    refused = isinstance(leaf, httpx2.ConnectError | httpx2.ConnectTimeout | ConnectionRefusedError)
    if not wire.sent or refused:
        return NotSent(f"{where} is unavailable, nothing sent ({reason})", status=wire.status)
    if wire.at_most_once:
        return OutcomeUnknown(f"{where}: a tools/call got no answer ({reason})")
    return TransientError(f"{where} is unavailable ({reason})", status=wire.status)


def _reason(leaf: BaseException, status: int | None) -> str | None:
    """Why a request may succeed later, or None when it will not."""
    if status is not None:
        return f"HTTP {status}" if retryable_status(status) else None
    if isinstance(leaf, TimeoutError | httpx2.TimeoutException):
        # The call's own bound or the socket read's: the same wait, one word.
        return "timeout"
    if isinstance(leaf, MCPError):
        return "timeout" if leaf.code == REQUEST_TIMEOUT else None
    if isinstance(leaf, httpx2.TransportError | OSError):
        return type(leaf).__name__
    return None


def _mode(protocol: str) -> str:
    """How a call connects to a server that listed its tools speaking
    ``protocol``: a modern version is adopted without a probe (one round
    trip a call), an older one takes the initialize handshake."""
    return protocol if protocol in MODERN_PROTOCOL_VERSIONS else "legacy"


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _result(result: CallToolResult) -> Any:
    """What the model is told of a call's result: its structured content, or
    its text, or its content blocks as JSON; ``isError`` is an error."""
    if result.is_error:
        text = " ".join(c.text for c in result.content if isinstance(c, TextContent))
        raise MCPToolError(_text(text) or "the tool failed")
    if result.structured_content is not None:
        return result.structured_content
    if all(isinstance(c, TextContent) for c in result.content):
        return "\n".join(c.text for c in result.content if isinstance(c, TextContent))
    return [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in result.content]


def _text(text: str, limit: int = _TEXT_CHARS) -> str:
    """A server's text on one line, without control characters, cut short."""
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _is_schema(name: str, schema: Mapping[str, Any]) -> bool:
    try:
        schema_args(name, schema)
    except (SchemaError, TypeError, ValueError):
        return False
    return True


def _server(server: str | Sequence[str] | StdioServerParameters) -> str | StdioServerParameters:
    """A streamable-HTTP URL, or the parameters of a stdio command."""
    if isinstance(server, StdioServerParameters):
        return server
    if isinstance(server, str) and server.startswith(("http://", "https://")):
        return server
    command = shlex.split(server) if isinstance(server, str) else [str(part) for part in server]
    if not command:
        raise ValueError("server: a streamable-HTTP URL or a stdio command")
    return StdioServerParameters(command=command[0], args=command[1:])


def mcp_tools(
    server: str | Sequence[str] | StdioServerParameters,
    *,
    name: str,
    headers: Mapping[str, str] | None = None,
    prefix: str | None = None,
    at_most_once: Names = None,
    retry: Names = None,
    approval: Names = None,
    timeout: float = 60.0,
) -> Toolset:
    """The tools of the MCP server ``server`` (a streamable-HTTP URL, or a
    stdio command as a string or a list) as an ``oncely.Toolset`` for
    ``oncely.Agent(tools=[...])`` (docs/mcp.md). ``name`` names its listing
    checkpoint and its metrics; ``headers`` go with every HTTP request
    (an ``Authorization`` from your settings: never logged, never stored);
    ``prefix`` goes before every tool's name. ``at_most_once`` / ``retry``:
    True for every tool, or the server's names of some, overriding what
    the tools' annotations and the server's capability say; ``approval``:
    True or names, those tools wait for a person first. ``timeout``: the
    seconds one request may take. Connects to nothing until a run lists it."""
    return MCPToolset(
        server,
        name=name,
        headers=headers,
        prefix=prefix,
        at_most_once=at_most_once,
        retry=retry,
        approval=approval,
        timeout=timeout,
    )
