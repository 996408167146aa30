"""Agents: a model that calls tools, durably (docs/agents.md).

``Agent.run(ctx, input)`` is plain code over the checkpoints every step has:
each model turn is a model checkpoint (``ctx.model.respond``), each tool call
the model asks for is a checkpoint of its own (a function tool's run, a call
tool's call, an approval's wait), so a run that crashes anywhere resumes
where it was, with nothing paid for or sent twice. The agent owns no table.

Keys. The run's checkpoints live in the agent's scope (``support/``): its
turns are ``support/model``, ``support/model#2``, ...; each tool call has a
scope of its own named after its tool (``support/lookup_order/``,
``support/lookup_order#2/`` for the second call of that tool), holding the
tool's checkpoints: ``tool`` (a function tool's run), ``call`` (a call
tool's call), ``approval`` (the decision before either). A turn's tool calls
run concurrently; their scopes are opened in the turn's order, so the keys
are the same on every replay however the calls interleave. A toolset's tools
(an MCP server's) are listed once per run, before its first turn, as a
checkpoint of its own (``support/shop.tools``): a run keeps the tools it saw.

What the model is told of a tool that failed: a permanent error (a refused
call, a tool raising ``PermanentError``), an unknown tool or arguments that
fail the tool's schema give it ``{"error": ...}`` and the run goes on; a
rejected approval gives ``{"rejected": true, "reason"}``. Transient errors
are retried as a step's are, then redeliver the job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from oncely import metrics
from oncely.context import Context
from oncely.errors import PermanentError, short_errors
from oncely.journal import Scope, check_name
from oncely.llm.base import ToolSpec
from oncely.llm.reply import Reply, ToolCall
from oncely.tools import ERROR_CHARS, Tool, Toolset, ToolStatus
from oncely.usage.totals import summed


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call of a run: what the model asked, and what came of it."""

    call_id: str
    tool: str
    arguments: Mapping[str, Any] | None
    status: ToolStatus
    result: Any

    def to_json(self) -> dict[str, Any]:
        return {
            "call_id": self.call_id,
            "tool": self.tool,
            "arguments": self.arguments,
            "status": self.status,
            "result": self.result,
        }


@dataclass
class AgentRun:
    """What a run did: its ``output`` (the final text, or the ``output``
    model), its model ``turns``, its ``tool_calls`` in order, and ``usage``
    (every turn's, summed)."""

    output: Any = None
    turns: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0)) + int(self.usage.get("completion_tokens", 0))


@dataclass(frozen=True)
class RunTools:
    """The tools of one run: the agent's own and its toolsets' (listed as
    the run starts), what the model is told of them, and each one's metric
    label (its name; a toolset's name for a tool a server named, so that a
    server cannot make labels up)."""

    by_name: Mapping[str, Tool]
    specs: tuple[ToolSpec, ...]
    labels: Mapping[str, str]


class AgentLimitReached(PermanentError):
    """A run reached one of its limits before a turn: ``reason`` is
    ``max_turns``, ``max_tokens`` or ``max_cost_usd``; ``run`` what it did.
    Uncaught, the job is dead with the error ``agent-limit: <reason>``."""

    # The job's dead-letter reason when nothing catches it.
    dead_reason = "agent-limit"

    def __init__(self, reason: str, run: AgentRun) -> None:
        super().__init__(f"{reason} ({run.turns} turns, {run.tokens} tokens)")
        self.reason = reason
        self.run = run


@dataclass(frozen=True)
class RunLimits:
    """What a run may spend, checked before each model turn: ``max_turns``,
    ``max_tokens`` (prompt + completion so far) and ``max_cost_usd`` (None:
    no limit). ``oncely.Agent`` and the framework integrations share them."""

    max_turns: int | None = 10
    max_tokens: int | None = None
    max_cost_usd: float | None = None

    def check(self, run: AgentRun) -> None:
        """``AgentLimitReached`` when ``run`` may not take another turn."""
        if self.max_turns is not None and run.turns >= self.max_turns:
            raise AgentLimitReached("max_turns", run)
        if self.max_tokens is not None and run.tokens >= self.max_tokens:
            raise AgentLimitReached("max_tokens", run)
        cost = run.usage.get("cost_usd")
        if self.max_cost_usd is not None and cost is not None and cost >= self.max_cost_usd:
            raise AgentLimitReached("max_cost_usd", run)


class Agent:
    """An agent: a name (its checkpoints' scope), ``instructions`` (the
    system message), ``tools`` (tools and toolsets, mixed), an optional
    structured ``output`` model, and limits checked before each turn.
    ``approval_timeout`` bounds a wait for a decision;
    ``on_approval_timeout`` says what no decision means."""

    def __init__(
        self,
        name: str,
        instructions: str,
        tools: Sequence[Tool | Toolset] = (),
        *,
        output: type[BaseModel] | None = None,
        max_turns: int = 10,
        max_tokens: int | None = None,
        max_cost_usd: float | None = None,
        approval_timeout: float | timedelta = timedelta(hours=48),
        on_approval_timeout: Literal["reject", "approve"] = "reject",
    ) -> None:
        self.name = check_name(name)
        self.instructions = instructions
        own = [t for t in tools if not isinstance(t, Toolset)]
        self.tools = {t.name: t for t in own}
        if len(self.tools) != len(own):
            raise ValueError(f"agent {name!r}: two tools share a name")
        self.toolsets = tuple(t for t in tools if isinstance(t, Toolset))
        if len({t.name for t in self.toolsets}) != len(self.toolsets):
            raise ValueError(f"agent {name!r}: two toolsets share a name")
        # What every turn tells the model of its own tools, worked out once.
        self._own = RunTools(
            self.tools, tuple(t.spec for t in self.tools.values()), {n: n for n in self.tools}
        )
        if max_turns < 1:
            raise ValueError(f"agent {name!r}: max_turns must be at least 1")
        self.output = output
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.max_cost_usd = max_cost_usd
        self.limits = RunLimits(max_turns, max_tokens, max_cost_usd)
        self.approval_timeout_s = (
            approval_timeout.total_seconds()
            if isinstance(approval_timeout, timedelta)
            else float(approval_timeout)
        )
        self.on_approval_timeout = on_approval_timeout

    @property
    def topics(self) -> frozenset[str]:
        """The call topics its call tools send (the workflow declares them)."""
        return frozenset(t.topic for t in self.tools.values() if t.topic is not None)

    @property
    def asks_approval(self) -> bool:
        """Whether any of its tools may wait for a person's decision."""
        return any(t.approval for t in self.tools.values()) or any(
            t.approval for t in self.toolsets
        )

    async def run(self, ctx: Context, input: str | Sequence[Mapping[str, Any]]) -> AgentRun:
        """Loop: a model turn, then each tool call it asked for (concurrently),
        their results back to the model, until a turn calls no tool; with
        ``output``, that last answer validated as the output model."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}]
        if isinstance(input, str):
            messages.append({"role": "user", "content": input})
        else:
            messages.extend(dict(m) for m in input)
        run = AgentRun()
        usages: list[Mapping[str, Any]] = []
        with ctx.scope(self.name):
            tools = await self._run_tools(ctx)
            while True:
                self.limits.check(run)
                reply = await self._turn(ctx, messages, tools)
                run.turns += 1
                usages.append(reply.usage)
                run.usage = summed(usages)
                calls = with_conversation_ids(reply.tool_calls)
                messages.append(_assistant(reply.text, calls))
                if not calls:
                    finished, retry = self._final(reply)
                    if retry is None:
                        run.output = finished
                        return run
                    messages.append({"role": "user", "content": retry})
                    continue
                records = await self._tool_calls(ctx, calls, tools)
                run.tool_calls.extend(records)
                for record in records:
                    messages.append(_tool_message(record))

    async def _run_tools(self, ctx: Context) -> RunTools:
        """The agent's own tools and its toolsets', each toolset listed in
        order (a checkpoint each). A toolset's tool named as another tool is
        refused: ``prefix=`` tells them apart."""
        if not self.toolsets:
            return self._own
        by_name = dict(self.tools)
        labels = dict(self._own.labels)
        for toolset in self.toolsets:
            for tool in await toolset.tools(ctx):
                if tool.name in by_name:
                    raise PermanentError(
                        f"agent {self.name!r}: toolset {toolset.name!r} has a tool named"
                        f" {tool.name!r}, as another of the agent's tools: give it prefix="
                    )
                by_name[tool.name] = tool
                labels[tool.name] = toolset.name
        return RunTools(by_name, tuple(t.spec for t in by_name.values()), labels)

    async def _turn(self, ctx: Context, messages: list[dict[str, Any]], tools: RunTools) -> Reply:
        return await ctx.model.respond(
            messages,
            tools=tools.specs,
            output=self.output,
            step="model",
        )

    def _final(self, reply: Reply) -> tuple[Any, str | None]:
        """The run's output, or what to tell the model when it does not
        validate (the run then goes on: a turn more)."""
        if self.output is None:
            return reply.text, None
        try:
            return self.output.model_validate_json(reply.text), None
        except ValidationError as exc:
            return None, (
                f"Your answer is not valid {self.output.__name__} JSON: {short_errors(exc)}."
                " Answer again with JSON valid for the schema."
            )

    # -- tool calls -------------------------------------------------------------

    async def _tool_calls(
        self, ctx: Context, calls: Sequence[ToolCall], tools: RunTools
    ) -> list[ToolCallRecord]:
        """Each call in a scope of its own, opened in the turn's order; run
        concurrently. A wait among them (a call tool, an approval) ends the
        run until it resumes: the others are done again then, or kept."""
        scopes = [
            ctx.open_scope(call.name if call.name in tools.by_name else "unknown-tool")
            for call in calls
        ]
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(self._tool_call(ctx, call, scope, tools))
                for call, scope in zip(calls, scopes, strict=True)
            ]
        return [task.result() for task in tasks]

    async def _tool_call(
        self, ctx: Context, call: ToolCall, scope: Scope, tools: RunTools
    ) -> ToolCallRecord:
        with ctx.within(scope):
            record = await self._answered(ctx, call, tools)
        # A name the model made up is no label: labels are bounded and ours.
        tool = tools.labels.get(record.tool, "unknown-tool")
        metrics.TOOL_CALLS.labels(workflow=ctx.workflow, tool=tool, status=record.status).inc()
        return record

    async def _answered(self, ctx: Context, call: ToolCall, tools: RunTools) -> ToolCallRecord:
        tool = tools.by_name.get(call.name)
        if tool is None:
            known = ", ".join(sorted(tools.by_name)) or "none"
            return _error(call, f"unknown tool {call.name!r}; the tools are: {known}")
        if call.malformed is not None:
            return _error(call, f"the arguments are not a JSON object: {call.malformed}")
        outcome = await tool.invoke(
            ctx,
            call.arguments or {},
            approval_timeout=self.approval_timeout_s,
            on_approval_timeout=self.on_approval_timeout,
        )
        return ToolCallRecord(call.id, tool.name, outcome.arguments, outcome.status, outcome.result)


def with_conversation_ids(calls: Sequence[ToolCall]) -> tuple[ToolCall, ...]:
    """The turn's calls, each with an id its result can answer to: the
    provider's where it is a usable one, unique within the turn; else one of
    oncely's (``oncely_call_<n>``). Providers send none, or repeat one; the
    conversation would then pair results with the wrong calls."""
    seen: set[str] = set()
    fixed = []
    for n, call in enumerate(calls, 1):
        usable = bool(call.id) and call.id != "None" and call.id not in seen
        seen.add(call.id)
        fixed.append(call if usable else dataclasses.replace(call, id=f"oncely_call_{n}"))
    return tuple(fixed)


def _error(call: ToolCall, message: str) -> ToolCallRecord:
    return ToolCallRecord(
        call.id, call.name, call.arguments, "error", {"error": message[:ERROR_CHARS]}
    )


def _assistant(text: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The turn as the conversation's next assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.raw_arguments},
            }
            for c in calls
        ]
    return message


def _tool_message(record: ToolCallRecord) -> dict[str, Any]:
    content = json.dumps(record.result, separators=(",", ":"), default=str)
    return {"role": "tool", "tool_call_id": record.call_id, "content": content}
