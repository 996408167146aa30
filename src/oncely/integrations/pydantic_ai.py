"""A Pydantic AI agent, unchanged, inside an oncely step (docs/framework-pydantic-ai.md).

``await run(ctx, agent, "...")`` runs ``agent`` (a ``pydantic_ai.Agent``)
for this job and returns its own ``AgentRunResult``. Pydantic AI keeps its
loop, its message history, its validation and retries; oncely takes the two
things that cost money or touch the world, through two public hooks of
Pydantic AI, for this run only (the agent object is not changed, so one
agent serves runs inside and outside oncely):

- **The model**: ``agent.run(..., model=OncelyModel())``. ``OncelyModel`` is
  a ``pydantic_ai.models.Model`` whose ``request`` turns Pydantic AI's
  message history into the conversation ``ctx.model.respond`` takes (tool
  definitions and output tools as ``ToolSpec``s, native structured output as
  a ``ResponseSchema``) and the ``Reply`` back into a ``ModelResponse`` of
  ``TextPart`` and ``ToolCallPart``s. Each request is one model checkpoint:
  once answered, never paid for again for the job.
- **The tools**: a capability passed to that run only, whose
  ``get_wrapper_toolset`` wraps the agent's assembled toolset (function
  tools, MCP servers, every toolset) in ``CheckpointedToolset``. Each call
  runs the real tool as a tool checkpoint: at least once, its JSON value
  stored, never run again once it answered; ``oncely.tool_key()`` inside it
  is the call's stable key. A ``ModelRetry`` or ``ToolFailed`` the tool
  raised is stored too and raised again on a replay, so Pydantic AI tells
  the model the same thing both times. A tool with
  ``requires_approval=True`` waits for an oncely approval (the job holds no
  worker) instead of ending the run with ``DeferredToolRequests``.

``OncelyAgent(agent)`` is the same in the form Pydantic AI's durable
execution takes (a wrapper agent, as its Temporal, DBOS and Prefect
integrations have been): ``await OncelyAgent(support).run("...")`` inside a
step runs ``run`` with the step's context (``oncely.current_context()``).

``as_tool(oncely_tool)`` gives Pydantic AI a tool that is an oncely tool
(``@oncely.tool``, ``oncely.call_tool(...)``): its schema, its approval and
its checkpoint are oncely's; a call tool's call is sent once by the relay.

Limits: ``max_turns``, ``max_tokens``, ``max_cost_usd`` are checked before
each request, and Pydantic AI's own ``usage_limits`` stay in force; past
either the job is dead with ``agent-limit: <reason>``. Pydantic AI's own
durable execution (a durability capability) must stay off the agent:
oncely is the one durable record.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, overload

from pydantic import ValidationError
from pydantic_ai import (
    Agent,
    ApprovalRequired,
    CallDeferred,
    ModelRetry,
    RunContext,
    ToolFailed,
    UsageLimitExceeded,
)
from pydantic_ai import Tool as PydanticTool
from pydantic_ai.agent import WrapperAgent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ModelResponsePart,
    RetryFeedbackPart,
    RetryPromptPart,
    SystemPromptPart,
    TextContent,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import (
    CompletedStreamedResponse,
    Model,
    ModelRequestParameters,
    StreamedResponse,
)
from pydantic_ai.profiles import ModelProfile
from pydantic_ai.run import AgentRunResult
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import AbstractToolset, WrapperToolset
from pydantic_ai.toolsets.abstract import ToolsetTool
from pydantic_ai.usage import RequestUsage
from pydantic_core import SchemaValidator, core_schema, to_jsonable_python

from oncely.agent import AgentLimitReached, RunLimits
from oncely.context import APPROVAL_TIMEOUT_S, Context, current_context
from oncely.errors import PermanentError, short_errors
from oncely.integrations.runs import FrameworkRun, current_run
from oncely.llm.base import ResponseSchema, ToolSpec
from oncely.llm.reply import Reply
from oncely.tools import Tool, Toolset

__all__ = [
    "CheckpointedToolset",
    "OncelyAgent",
    "OncelyCheckpoints",
    "OncelyModel",
    "OncelyToolset",
    "as_tool",
    "run",
]

_FRAMEWORK = "pydantic_ai"
# What a tool definition's metadata says, for the wrapper: this tool waits
# for an oncely approval; this tool is an oncely tool (its own checkpoints).
_NEEDS_APPROVAL = "oncely.approval"
_ONCELY_TOOL = "oncely.tool"
# Exceptions Pydantic AI handles itself (it tells the model): stored with the
# tool's checkpoint and raised again on a replay.
_KEPT: tuple[type[BaseException], ...] = (ModelRetry, ToolFailed)


async def run(
    ctx: Context,
    agent: Agent[Any, Any],
    input: str | Sequence[Any] | None,
    *,
    name: str | None = None,
    max_turns: int | None = None,
    max_tokens: int | None = None,
    max_cost_usd: float | None = None,
    approval_timeout: float | timedelta = APPROVAL_TIMEOUT_S,
    on_approval_timeout: Literal["reject", "approve"] = "reject",
    **framework_kwargs: Any,
) -> AgentRunResult[Any]:
    """Run ``agent`` on ``input`` for this job (``agent.run(input,
    **framework_kwargs)``) with oncely's model and its tools as checkpoints
    (module docstring); Pydantic AI's own result comes back. ``name``
    (default: the agent's name, else ``agent``) scopes the checkpoints:
    ``support/model``, ``support/lookup_order/tool``."""
    if "model" in framework_kwargs:
        raise ValueError("oncely's model answers every request: the route is the deployment's")
    _refuse_durability(agent)
    framework = FrameworkRun(
        ctx,
        name or agent.name or "agent",
        limits=RunLimits(max_turns, max_tokens, max_cost_usd),
        approval_timeout=approval_timeout,
        on_approval_timeout=on_approval_timeout,
    )
    capabilities = [*(framework_kwargs.pop("capabilities", None) or ()), OncelyCheckpoints()]
    with framework.running():
        try:
            return await agent.run(
                input, model=_MODEL, capabilities=capabilities, **framework_kwargs
            )
        except UsageLimitExceeded as exc:
            # Pydantic AI's own limits end the job as oncely's do.
            raise AgentLimitReached("usage_limits", framework.run) from exc


def _refuse_durability(agent: Agent[Any, Any]) -> None:
    """A Pydantic AI durability capability (Temporal, DBOS, Prefect) on the
    agent would be a second durable record, resuming from a state oncely
    never saw. Such a capability can only exist once its module is loaded."""
    durable_exec = sys.modules.get("pydantic_ai.durable_exec")
    if durable_exec is None:
        return
    durability = durable_exec.BaseDurabilityCapability
    found: list[str] = []
    agent.root_capability.apply(
        lambda c: found.append(type(c).__name__) if isinstance(c, durability) else None
    )
    if found:
        raise ValueError(
            f"agent {agent.name!r} has Pydantic AI's durable execution on ({', '.join(found)}):"
            " inside oncely, oncely is its one durable record; build it without"
        )


@overload
def as_tool(tool: Tool) -> PydanticTool[Any]: ...
@overload
def as_tool(tool: Toolset) -> AbstractToolset[Any]: ...
def as_tool(tool: Tool | Toolset) -> PydanticTool[Any] | AbstractToolset[Any]:
    """A Pydantic AI tool that is ``tool`` (``@oncely.tool``,
    ``oncely.call_tool(...)``): the model sees its name, description and
    schema; a call runs as ``Tool.invoke`` runs it (schema check, approval,
    its checkpoint or its call) and the model is told its outcome. For an
    oncely toolset (``oncely.mcp_tools(...)``), a Pydantic AI toolset, for
    the agent's ``toolsets=[...]``: ``OncelyToolset``."""
    if isinstance(tool, Toolset):
        return OncelyToolset(tool)

    async def invoke(ctx: RunContext[Any], **arguments: Any) -> Any:
        outcome = await current_run(_FRAMEWORK).invoke(tool, ctx.tool_call_id, arguments)
        return outcome.result

    made: PydanticTool[Any] = PydanticTool.from_schema(
        invoke, tool.name, tool.description, tool.parameters, takes_ctx=True
    )
    made.metadata = {_ONCELY_TOOL: True}
    return made


@dataclass
class OncelyToolset(AbstractToolset[Any]):
    """An oncely toolset (``oncely.mcp_tools(...)``) as a Pydantic AI
    toolset: its tools listed once per run (a checkpoint, as ``oncely.Agent``
    lists them), each call run as ``Tool.invoke`` runs it (the server's
    schema, approval, a tool checkpoint at most once or retried as the
    toolset's policy says)."""

    toolset: Toolset

    @property
    def id(self) -> str | None:
        return f"oncely-{self.toolset.name}"

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        tools = await current_run(_FRAMEWORK).listed(self.toolset)
        return {name: self._described(tool) for name, tool in tools.items()}

    def _described(self, tool: Tool) -> ToolsetTool[Any]:
        definition = ToolDefinition(
            name=tool.name,
            description=tool.description,
            parameters_json_schema=tool.parameters,
            metadata={_ONCELY_TOOL: True},
        )
        # Tool.invoke checks the arguments against the server's schema.
        return ToolsetTool(
            toolset=self, tool_def=definition, max_retries=1, args_validator=_ANY_ARGUMENTS
        )

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        run = current_run(_FRAMEWORK)
        found = (await run.listed(self.toolset))[name]
        outcome = await run.invoke(found, ctx.tool_call_id, tool_args, label=self.toolset.name)
        return outcome.result


_ANY_ARGUMENTS = SchemaValidator(core_schema.dict_schema())


# -- the model ------------------------------------------------------------------


class OncelyModel(Model):
    """Pydantic AI's model inside ``run``: each request is a turn of the
    running ``FrameworkRun`` (``ctx.model.respond``, a model checkpoint)."""

    def __init__(self) -> None:
        super().__init__(
            profile=ModelProfile(supports_tools=True, supports_json_schema_output=True)
        )

    @property
    def model_name(self) -> str:
        return "oncely"

    @property
    def system(self) -> str:
        return "oncely"

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        model_settings, params = self.prepare_request(model_settings, model_request_parameters)
        framework = current_run(_FRAMEWORK)
        tools = [_spec(t) for t in (*params.declared_function_tools, *params.output_tools)]
        reply = await framework.turn(
            conversation(messages, params),
            tools=tools,
            tool_choice="required" if tools and not params.allow_text_output else "auto",
            output=_output_schema(params),
        )
        return _response(reply)

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        """The turn as a stream of its parts, for an ``event_stream_handler``
        or ``run_stream``: the answer is a checkpoint, whole (a replay has no
        stream to give), so its events come once it answered."""
        response = await self.request(messages, model_settings, model_request_parameters)
        yield CompletedStreamedResponse(
            response, model_request_parameters=model_request_parameters, replay_events=True
        )


# One for every run, as an agent's own model serves all its runs: it holds
# nothing of a run (its requests find theirs through ``current_run``).
_MODEL = OncelyModel()


def conversation(
    messages: Sequence[ModelMessage], params: ModelRequestParameters | None = None
) -> list[dict[str, Any]]:
    """Pydantic AI's message history as the OpenAI-style messages
    ``ctx.model.respond`` takes: the instructions first, then each request's
    parts and each response's text and tool calls, in order. Parts with no
    text (files, images) are left out."""
    found: list[dict[str, Any]] = []
    instructions = _instructions(messages, params)
    if instructions:
        found.append({"role": "system", "content": instructions})
    for message in messages:
        if isinstance(message, ModelRequest):
            found.extend(m for part in message.parts if (m := _request_part(part)) is not None)
        elif (said := _assistant(message.parts)) is not None:
            found.append(said)
    return found


def _instructions(
    messages: Sequence[ModelMessage], params: ModelRequestParameters | None
) -> str | None:
    """The request's instructions: the agent's parts when it sent them,
    else the latest request's own (a history given by hand)."""
    if params is not None and params.instruction_parts is not None:
        return "\n\n".join(p.content for p in params.instruction_parts if p.content) or None
    for message in reversed(messages):
        if isinstance(message, ModelRequest) and message.instructions:
            return message.instructions
    return None


def _request_part(part: Any) -> dict[str, Any] | None:
    if isinstance(part, SystemPromptPart):
        return {"role": "system", "content": part.content}
    if isinstance(part, UserPromptPart):
        text = _text(part.content)
        return {"role": "user", "content": text} if text else None
    if isinstance(part, ToolReturnPart):
        content = part.model_response_str()
        return {"role": "tool", "tool_call_id": part.tool_call_id, "content": content}
    if isinstance(part, RetryFeedbackPart):
        return {"role": "user", "content": part.model_response()}
    if isinstance(part, RetryPromptPart) and part.tool_name:
        # A history stored by an older Pydantic AI.
        return {"role": "tool", "tool_call_id": part.tool_call_id, "content": part.model_response()}
    if isinstance(part, RetryPromptPart):
        return {"role": "user", "content": part.model_response()}
    return None


def _text(content: str | Sequence[Any]) -> str:
    """A user prompt's text: its strings and text items (structured values as
    the text Pydantic AI rendered them to); files and images are not sent."""
    if isinstance(content, str):
        return content
    texts = (item.content if isinstance(item, TextContent) else item for item in content)
    return "\n".join(text for text in texts if isinstance(text, str))


def _assistant(parts: Sequence[ModelResponsePart]) -> dict[str, Any] | None:
    text = "".join(p.content for p in parts if isinstance(p, TextPart))
    calls = [
        {
            "id": p.tool_call_id,
            "type": "function",
            "function": {"name": p.tool_name, "arguments": p.args_as_json_str()},
        }
        for p in parts
        if isinstance(p, ToolCallPart)
    ]
    if not text and not calls:
        return None
    said: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        said["tool_calls"] = calls
    return said


def _spec(tool: ToolDefinition) -> ToolSpec:
    return ToolSpec(tool.name, tool.description or "", tool.parameters_json_schema)


def _output_schema(params: ModelRequestParameters) -> ResponseSchema | None:
    """Native structured output (``NativeOutput``) as oncely's schema; tool
    output goes as tools, prompted output in the instructions."""
    if params.output_mode != "native" or params.output_object is None:
        return None
    found = params.output_object
    return ResponseSchema(found.name or "output", found.json_schema)


def _response(reply: Reply) -> ModelResponse:
    """The turn as Pydantic AI's response, with the ids of the Reply (the
    ones the turn opened the calls' scopes for)."""
    parts: list[ModelResponsePart] = []
    if reply.text:
        parts.append(TextPart(reply.text))
    for call in reply.tool_calls:
        arguments: str | dict[str, Any] = call.raw_arguments or dict(call.arguments or {})
        parts.append(ToolCallPart(call.name, arguments, tool_call_id=call.id))
    usage = reply.usage
    return ModelResponse(
        parts,
        usage=RequestUsage(
            input_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
        ),
        model_name=str(usage.get("model") or "oncely"),
    )


# -- the tools ------------------------------------------------------------------


@dataclass
class OncelyCheckpoints(AbstractCapability[Any]):
    """The capability ``run`` adds to its run: the agent's toolset, whole,
    wrapped in ``CheckpointedToolset``."""

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return CheckpointedToolset(toolset)


@dataclass
class CheckpointedToolset(WrapperToolset[Any]):
    """Each tool call of the wrapped toolset as a tool checkpoint of the
    running ``FrameworkRun``; ``requires_approval`` as an oncely approval."""

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        tools = await self.wrapped.get_tools(ctx)
        return {name: _approved_by_oncely(tool) for name, tool in tools.items()}

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        metadata = tool.tool_def.metadata or {}
        if metadata.get(_ONCELY_TOOL):
            # An oncely tool keeps checkpoints of its own (as_tool).
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        given = to_jsonable_python(tool_args)

        async def work(arguments: Mapping[str, Any]) -> Any:
            args = tool_args
            if arguments != given:
                args = _edited(tool, arguments)
            try:
                value = await self.wrapped.call_tool(name, args, ctx, tool)
            except (ApprovalRequired, CallDeferred) as exc:
                raise PermanentError(_deferred(name, exc)) from None
            # Stored as JSON, and handed back as that JSON the first time too.
            return to_jsonable_python(value)

        outcome = await current_run(_FRAMEWORK).call_tool(
            name,
            ctx.tool_call_id,
            work,
            given,
            approval=bool(metadata.get(_NEEDS_APPROVAL)),
            keep=_KEPT,
            schema=tool.tool_def.parameters_json_schema,
        )
        return outcome.result


def _deferred(tool: str, exc: Exception) -> str:
    """Why a tool that defers itself cannot run inside oncely: the decision
    would have to come from a later run, and oncely resumes this one."""
    if isinstance(exc, ApprovalRequired):
        return (
            f"tool {tool!r} raised ApprovalRequired: inside oncely, declare it with"
            " requires_approval=True (or make it an oncely tool with approval=)"
        )
    return f"tool {tool!r} raised CallDeferred: inside oncely, make it a call that answers"


def _edited(tool: ToolsetTool[Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A person's edited arguments, checked as the model's were; the model
    is told when they do not pass (the tool does not run)."""
    try:
        args: dict[str, Any] = tool.args_validator.validate_python(dict(arguments))
    except ValidationError as exc:
        raise ToolFailed(f"the approved arguments are invalid: {short_errors(exc)}") from None
    return args


def _approved_by_oncely(tool: ToolsetTool[Any]) -> ToolsetTool[Any]:
    """A ``requires_approval`` tool as a plain one that waits for an oncely
    approval when called: Pydantic AI would end the run instead, asking for
    ``DeferredToolResults`` the next run would have to bring."""
    if tool.tool_def.kind != "unapproved":
        return tool
    metadata = {**(tool.tool_def.metadata or {}), _NEEDS_APPROVAL: True}
    tool_def = dataclasses.replace(tool.tool_def, kind="function", metadata=metadata)
    return dataclasses.replace(tool, tool_def=tool_def)


class OncelyAgent(WrapperAgent[Any, Any]):
    """``agent`` made durable by oncely, in the form Pydantic AI's durable
    execution takes: ``await OncelyAgent(support).run("...")`` inside a step
    is ``run(oncely.current_context(), support, "...")``, with the limits
    and approval settings given here. Only ``run`` is durable: ``iter``,
    ``run_stream`` and ``run_sync`` would step around oncely, and refuse."""

    def __init__(
        self,
        agent: Agent[Any, Any],
        *,
        name: str | None = None,
        max_turns: int | None = None,
        max_tokens: int | None = None,
        max_cost_usd: float | None = None,
        approval_timeout: float | timedelta = APPROVAL_TIMEOUT_S,
        on_approval_timeout: Literal["reject", "approve"] = "reject",
    ) -> None:
        super().__init__(agent)
        self._settings: dict[str, Any] = {
            "name": name,
            "max_turns": max_turns,
            "max_tokens": max_tokens,
            "max_cost_usd": max_cost_usd,
            "approval_timeout": approval_timeout,
            "on_approval_timeout": on_approval_timeout,
        }

    async def run(
        self, user_prompt: str | Sequence[Any] | None = None, **kwargs: Any
    ) -> AgentRunResult[Any]:
        agent = self.wrapped
        assert isinstance(agent, Agent)
        return await run(current_context(), agent, user_prompt, **self._settings, **kwargs)

    def iter(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("OncelyAgent: only run() is durable; await agent.run(...)")

    def run_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("OncelyAgent: only run() is durable; await agent.run(...)")

    def run_sync(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("OncelyAgent: only run() is durable; await agent.run(...)")
