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
are the same on every replay however the calls interleave.

What the model is told of a tool that failed: a permanent error (a refused
call, a tool raising ``PermanentError``), an unknown tool or arguments that
fail the tool's schema give it ``{"error": ...}`` and the run goes on; a
rejected approval gives ``{"rejected": true, "reason"}``. Transient errors
are retried as a step's are, then redeliver the job.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from oncely import metrics
from oncely.context import Context, journal_of, record_step
from oncely.errors import CallFailed, PermanentError, short_errors
from oncely.journal import Scope, check_name
from oncely.llm.model import Reply, ToolCall
from oncely.tools import Tool, ToolContext
from oncely.usage.totals import summed

ToolStatus = Literal["ok", "error", "rejected"]

# How many characters of a tool's error the model is told.
_ERROR_CHARS = 500


class ApprovalDecision(BaseModel):
    """A person's decision on a tool call (``POST
    <route>/{job_id}/approvals/{call_id}``): approved or not, with edited
    ``arguments`` (they replace the model's) and a ``reason``."""

    approved: bool
    arguments: dict[str, Any] | None = None
    reason: str | None = None


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


class Agent:
    """An agent: a name (its checkpoints' scope), ``instructions`` (the
    system message), ``tools``, an optional structured ``output`` model, and
    limits checked before each turn. ``approval_timeout`` bounds a wait for
    a decision; ``on_approval_timeout`` says what no decision means."""

    def __init__(
        self,
        name: str,
        instructions: str,
        tools: Sequence[Tool] = (),
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
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"agent {name!r}: two tools share a name")
        # What every turn tells the model of the tools, worked out once.
        self._specs = tuple(t.spec for t in self.tools.values())
        if max_turns < 1:
            raise ValueError(f"agent {name!r}: max_turns must be at least 1")
        self.output = output
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.max_cost_usd = max_cost_usd
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
            while True:
                self._check_limits(run)
                reply = await self._turn(ctx, messages)
                run.turns += 1
                usages.append(reply.usage)
                run.usage = summed(usages)
                messages.append(_assistant(reply))
                if not reply.tool_calls:
                    finished, retry = self._final(reply)
                    if retry is None:
                        run.output = finished
                        return run
                    messages.append({"role": "user", "content": retry})
                    continue
                records = await self._tool_calls(ctx, reply.tool_calls)
                run.tool_calls.extend(records)
                for record in records:
                    messages.append(_tool_message(record))

    async def _turn(self, ctx: Context, messages: list[dict[str, Any]]) -> Reply:
        return await ctx.model.respond(
            messages,
            tools=self._specs,
            output=self.output,
            step="model",
        )

    def _check_limits(self, run: AgentRun) -> None:
        if run.turns >= self.max_turns:
            raise AgentLimitReached("max_turns", run)
        if self.max_tokens is not None and run.tokens >= self.max_tokens:
            raise AgentLimitReached("max_tokens", run)
        cost = run.usage.get("cost_usd")
        if self.max_cost_usd is not None and cost is not None and cost >= self.max_cost_usd:
            raise AgentLimitReached("max_cost_usd", run)

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

    async def _tool_calls(self, ctx: Context, calls: Sequence[ToolCall]) -> list[ToolCallRecord]:
        """Each call in a scope of its own, opened in the turn's order; run
        concurrently. A wait among them (a call tool, an approval) ends the
        run until it resumes: the others are done again then, or kept."""
        journal = journal_of(ctx)
        scopes = [
            journal.open_scope(call.name if call.name in self.tools else "unknown-tool")
            for call in calls
        ]
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(self._tool_call(ctx, call, scope))
                for call, scope in zip(calls, scopes, strict=True)
            ]
        return [task.result() for task in tasks]

    async def _tool_call(self, ctx: Context, call: ToolCall, scope: Scope) -> ToolCallRecord:
        with journal_of(ctx).within(scope):
            record = await self._answered(ctx, call, scope)
        metrics.TOOL_CALLS.labels(
            workflow=ctx.workflow, tool=record.tool, status=record.status
        ).inc()
        return record

    async def _answered(self, ctx: Context, call: ToolCall, scope: Scope) -> ToolCallRecord:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return _error(call, f"unknown tool {call.name!r}; the tools are: {known}")
        if call.malformed is not None:
            return _error(call, f"the arguments are not a JSON object: {call.malformed}")
        try:
            args = tool.args.model_validate(call.arguments)
        except ValidationError as exc:
            return _error(call, f"invalid arguments: {short_errors(exc)}")
        if tool.needs_approval(args):
            decision = await self._approval(ctx, call, tool)
            if not decision.approved:
                reason = decision.reason or "rejected by a person"
                return ToolCallRecord(
                    call.id,
                    tool.name,
                    call.arguments,
                    "rejected",
                    {"rejected": True, "reason": reason},
                )
            if decision.arguments is not None:
                try:
                    args = tool.args.model_validate(decision.arguments)
                except ValidationError as exc:
                    return _error(call, f"the approved arguments are invalid: {short_errors(exc)}")
        try:
            result = await self._run_tool(ctx, tool, args, scope)
        except CallFailed as exc:
            return _error(call, f"the call failed ({exc.reason}): {exc}", tool.name)
        except PermanentError as exc:
            return _error(call, f"{type(exc).__name__}: {exc}", tool.name)
        arguments = args.model_dump(mode="json")
        return ToolCallRecord(call.id, tool.name, arguments, "ok", result)

    async def _run_tool(self, ctx: Context, tool: Tool, args: BaseModel, scope: Scope) -> Any:
        if tool.topic is not None:
            answer = await ctx.call(tool.topic, args, step="call")
            return answer.model_dump(mode="json") if isinstance(answer, BaseModel) else answer
        assert tool.fn is not None
        key = f"{ctx.job_id}:{scope.path}tool"
        context = ToolContext(key=key, job_id=ctx.job_id, tenant=ctx.tenant)
        kwargs = tool.keyword_arguments(args, context)
        return await record_step(ctx, "tool", "tool", tool.fn, (), kwargs)

    async def _approval(self, ctx: Context, call: ToolCall, tool: Tool) -> ApprovalDecision:
        """Wait, holding nothing, for a person's decision on ``call``; no
        decision in time is ``on_approval_timeout``'s."""
        pending = {"call_id": call.id, "tool": tool.name, "arguments": dict(call.arguments or {})}
        if ctx.declares("approval.requested"):
            ctx.emit(
                "approval.requested",
                {"job_id": ctx.job_id, **pending},
                dedupe_key=f"approval.requested:{ctx.job_id}:{call.id}",
            )

        def decode(value: Any) -> ApprovalDecision:
            if value is None:
                approved = self.on_approval_timeout == "approve"
                return ApprovalDecision(approved=approved, reason="no decision in time")
            return ApprovalDecision.model_validate(value)

        return await journal_of(ctx).wait(
            "approval",
            "approval",
            approval_event(call.id),
            self.approval_timeout_s,
            decode,
            detail={"approval": pending},
        )


def approval_event(call_id: str) -> str:
    """The event a decision on ``call_id`` is stored as (and waited for)."""
    return f"approval:{call_id}"


def _error(call: ToolCall, message: str, tool: str | None = None) -> ToolCallRecord:
    return ToolCallRecord(
        call.id, tool or call.name, call.arguments, "error", {"error": message[:_ERROR_CHARS]}
    )


def _assistant(reply: Reply) -> dict[str, Any]:
    """The turn as the conversation's next assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.raw_arguments},
            }
            for c in reply.tool_calls
        ]
    return message


def _tool_message(record: ToolCallRecord) -> dict[str, Any]:
    content = json.dumps(record.result, separators=(",", ":"), default=str)
    return {"role": "tool", "tool_call_id": record.call_id, "content": content}
