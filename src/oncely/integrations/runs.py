"""One run of a framework's agent inside a job: what every integration shares.

A ``FrameworkRun`` is the adapter's side of the checkpoint kit
(docs/frameworks.md). The framework keeps its own loop; the integration
hands its model requests to ``turn`` and its tool calls to ``call_tool``:

- ``running()`` opens the run's scope (``support/``), as ``oncely.Agent``
  does, so a framework agent's checkpoints read like an oncely agent's;
- ``turn(messages, ...)`` checks the run's limits, asks the model through
  ``ctx.model.respond`` (checkpoint ``support/model``, ``support/model#2``,
  ...: fallbacks, cooldown, limiter, budgets, ledger) and, in the turn's
  order, opens a scope for each tool call the model asked for: however the
  framework then interleaves the calls, each gets the same keys on every
  replay (``support/lookup_order/tool``). Tool-call ids the provider left
  out or repeated are replaced, so the framework pairs results rightly;
- ``call_tool(name, call_id, fn)`` runs the framework's tool in its call's
  scope as a tool checkpoint (a person's decision first when asked):
  ``oncely.tool_key()`` inside it is the call's stable key.

Values cross as JSON: a tool's result is stored as JSON and handed back as
that JSON on the first run and on every replay alike, so the framework sees
the same thing both times. The run owns no table and nothing outlives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, Literal

from oncely import metrics
from oncely.agent import AgentRun, RunLimits, with_conversation_ids
from oncely.context import APPROVAL_TIMEOUT_S, Context
from oncely.journal import Scope
from oncely.llm.base import ResponseSchema, ToolSpec
from oncely.llm.reply import Reply, ToolCall
from oncely.tools import Tool, ToolOutcome, Toolset, scripted_answer
from oncely.usage.totals import summed

_RUN: ContextVar[FrameworkRun | None] = ContextVar("oncely_framework_run", default=None)

# What a checkpoint name may be (oncely.journal), for tool names made into one.
_NOT_IN_NAME = re.compile(r"[^a-z0-9_.-]+")
# What a stored value says of an exception the framework handles itself.
_RAISED = "oncely.raised"


def current_run(framework: str) -> FrameworkRun:
    """The framework run the calling code is part of, or a ``RuntimeError``
    saying where it must be called from."""
    run = _RUN.get()
    if run is None:
        raise RuntimeError(
            f"oncely's {framework} model and tools answer only inside"
            f" oncely.integrations.{framework}.run(ctx, ...)"
        )
    return run


@functools.lru_cache(maxsize=512)
def scope_name(tool: str) -> str:
    """A framework's tool name as a checkpoint name: lower case, other
    characters as ``-``, led by a letter, at most 63 characters. Names are
    untrusted input (a model may call any): they only ever name a scope
    (and the few an agent's tools have are made once, not per call)."""
    name = _NOT_IN_NAME.sub("-", tool.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"t-{name}"
    return name[:63]


class FrameworkRun:
    """One run of a framework's agent in a job (module docstring)."""

    def __init__(
        self,
        ctx: Context,
        name: str,
        *,
        limits: RunLimits | None = None,
        approval_timeout: float | timedelta = APPROVAL_TIMEOUT_S,
        on_approval_timeout: Literal["reject", "approve"] = "reject",
    ) -> None:
        self.ctx = ctx
        self.name = scope_name(name)
        self.limits = limits or RunLimits(max_turns=None)
        self.approval_timeout = approval_timeout
        self.on_approval_timeout = on_approval_timeout
        # What the run did so far: turns, usage, tool calls.
        self.run = AgentRun()
        self._usages: list[Mapping[str, Any]] = []
        self._scope: Scope | None = None
        # The scopes the last turns opened for their tool calls, by call id,
        # and by tool name in the turn's order (a call the framework makes
        # under an id of its own).
        self._by_id: dict[str, Scope] = {}
        self._by_name: dict[str, deque[Scope]] = {}
        # Each toolset's tools, listed once in the run (``listed``).
        self._listed: dict[str, Mapping[str, Tool]] = {}

    @contextlib.contextmanager
    def running(self) -> Iterator[FrameworkRun]:
        """The run's scope, and the run as the one its model and tools find."""
        self._scope = self.ctx.open_scope(self.name, shared=True)
        token = _RUN.set(self)
        try:
            with self.ctx.within(self._scope):
                yield self
        finally:
            _RUN.reset(token)

    async def turn(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[ToolSpec] = (),
        tool_choice: str = "auto",
        output: ResponseSchema | None = None,
    ) -> Reply:
        """One model turn, as a model checkpoint in the run's scope, after the
        run's limits are checked (``AgentLimitReached``). Its tool calls come
        back with ids the framework can pair results with."""
        self.limits.check(self.run)
        with self._in_run_scope():
            reply = await self.ctx.model.respond(
                messages, tools=tools, tool_choice=tool_choice, output=output, step="model"
            )
            calls = with_conversation_ids(reply.tool_calls)
            for call in calls:
                self._open_call(call)
        self.run.turns += 1
        self._usages.append(reply.usage)
        self.run.usage = summed(self._usages)
        return dataclasses.replace(reply, tool_calls=calls)

    async def call_tool(
        self,
        tool: str,
        call_id: str | None,
        fn: Callable[[Mapping[str, Any]], Awaitable[Any]],
        arguments: Mapping[str, Any],
        *,
        approval: bool = False,
        keep: tuple[type[BaseException], ...] = (),
        schema: Mapping[str, Any] | None = None,
        scripted: Callable[[Any], Any] | None = None,
    ) -> ToolOutcome:
        """The framework's tool ``fn(arguments)`` as a tool checkpoint, in the
        scope its turn opened for ``call_id``. With ``approval``, a person's
        decision first: a rejection is the outcome ``rejected`` (``fn`` never
        runs), edited arguments are what ``fn`` gets. An exception of a type
        in ``keep`` (one the framework handles itself: "retry with other
        arguments") is stored with the checkpoint and raised again, as that
        type, on the first run and on replays. ``schema``: the tool's
        arguments' JSON schema, which a person's edits must pass (the API
        checks them against it). ``scripted``: a test's scripted answer for
        the tool (docs/testing.md), the tool's value, as ``fn`` would return
        it (None: as it is)."""
        fn = _scripted(tool, scripted) or fn
        with self.ctx.within(self._scope_for(tool, call_id)):
            given = dict(arguments)
            if approval:
                decision = await self.ctx.approval(
                    tool,
                    given,
                    timeout=self.approval_timeout,
                    on_timeout=self.on_approval_timeout,
                    schema=schema,
                )
                if not decision.approved:
                    reason = decision.reason or "rejected by a person"
                    self._count(tool, "rejected")
                    return ToolOutcome("rejected", {"rejected": True, "reason": reason}, given)
                given = dict(decision.arguments) if decision.arguments is not None else given
            value = await self.ctx.tool(_kept(fn, given, keep))
        try:
            _raise_kept(value, keep)
        except BaseException:
            self._count(tool, "error")  # the framework's own kind of failure
            raise
        self._count(tool, "ok")
        return ToolOutcome("ok", value, given)

    async def invoke(
        self,
        tool: Tool,
        call_id: str | None,
        arguments: Mapping[str, Any],
        *,
        label: str | None = None,
    ) -> ToolOutcome:
        """An oncely tool (``@oncely.tool``, ``oncely.call_tool``, a
        toolset's) the framework calls, in the scope its turn opened for
        ``call_id``: its schema, its approval, its checkpoint (a call tool's
        call is sent once by the relay) as ``Tool.invoke`` runs them.
        ``label``: its metric label when not its name (a toolset's)."""
        with self.ctx.within(self._scope_for(tool.name, call_id)):
            outcome = await tool.invoke(
                self.ctx,
                arguments,
                approval_timeout=_seconds(self.approval_timeout),
                on_approval_timeout=self.on_approval_timeout,
            )
        self._count(label or tool.name, outcome.status)
        return outcome

    async def listed(self, toolset: Toolset) -> Mapping[str, Tool]:
        """A toolset's tools (``oncely.mcp_tools``), by name: listed the
        first time the run asks (a checkpoint in the run's scope, as
        ``oncely.Agent`` lists them), the same tools after that."""
        found = self._listed.get(toolset.name)
        if found is None:
            with self._in_run_scope():
                found = {t.name: t for t in await toolset.tools(self.ctx)}
            self._listed[toolset.name] = found
        return found

    def _count(self, tool: str, status: str) -> None:
        """``oncely_tool_calls_total``, as ``oncely.Agent`` counts its calls.
        The tool is one the framework found on the agent (it refuses names a
        model made up), or a toolset's under the toolset's name, so the
        label is bounded."""
        labels = {"workflow": self.ctx.workflow, "tool": scope_name(tool), "status": status}
        metrics.TOOL_CALLS.labels(**labels).inc()

    @contextlib.contextmanager
    def _in_run_scope(self) -> Iterator[None]:
        """Turns are the run's own checkpoints even when the framework asks
        from a task of its own (not a branch of the step's task)."""
        if self._scope is None:
            raise RuntimeError("FrameworkRun.turn outside FrameworkRun.running()")
        with self.ctx.within(self._scope):
            yield

    def _open_call(self, call: ToolCall) -> None:
        scope = self.ctx.open_scope(scope_name(call.name))
        self._by_id[call.id] = scope
        self._by_name.setdefault(call.name, deque()).append(scope)

    def _scope_for(self, tool: str, call_id: str | None) -> Scope:
        """The scope the turn opened for this call; one opened now for a call
        no turn announced (a framework calling a tool on its own)."""
        scope = self._by_id.pop(call_id, None) if call_id is not None else None
        queued = self._by_name.get(tool)
        if scope is None and queued:
            scope = queued.popleft()
        elif scope is not None and queued and scope in queued:
            queued.remove(scope)
        if scope is not None:
            return scope
        with self._in_run_scope():
            return self.ctx.open_scope(scope_name(tool))


def _scripted(
    tool: str, shape: Callable[[Any], Any] | None
) -> Callable[[Mapping[str, Any]], Awaitable[Any]] | None:
    """A test's scripted answer in place of ``tool``'s work, shaped as the
    work returns it; None when the test scripted none."""
    answer = scripted_answer(tool)
    if answer is None or shape is None:
        return answer
    scripted = answer

    async def shaped(given: Mapping[str, Any]) -> Any:
        return shape(await scripted(given))

    return shaped


def _kept(
    fn: Callable[[Mapping[str, Any]], Awaitable[Any]],
    arguments: Mapping[str, Any],
    keep: tuple[type[BaseException], ...],
) -> Callable[[], Awaitable[Any]]:
    async def work() -> Any:
        try:
            return await fn(arguments)
        except keep as exc:
            kind = type(exc)
            return {_RAISED: f"{kind.__module__}:{kind.__qualname__}", "message": str(exc)}

    return work


def _raise_kept(value: Any, keep: tuple[type[BaseException], ...]) -> None:
    """Raise again the exception a tool's stored value says it raised."""
    if not (isinstance(value, dict) and _RAISED in value and keep):
        return
    module, _, qualname = str(value[_RAISED]).partition(":")
    for kind in keep:
        if (kind.__module__, kind.__qualname__) == (module, qualname):
            raise kind(str(value.get("message", "")))
    raise keep[0](str(value.get("message", "")))


def _seconds(duration: float | timedelta) -> float:
    return duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
