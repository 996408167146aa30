"""The OpenAI Agents SDK, with oncely's guarantees (docs/framework-openai-agents.md).

``await run(ctx, agent, input)`` runs the user's unchanged ``agents.Agent``
with ``Runner.run``: its loop, handoffs, output type and guardrails are the
SDK's own. Two things are put in place for that run only, through the SDK's
public extension points:

- **the model**: ``RunConfig(model=..., model_provider=...)`` gives every
  agent of the run (handoff targets too) oncely's ``agents.models.interface.Model``.
  Its ``get_response`` turns the SDK's input items (Responses-API items),
  tools, handoffs and output schema into the chat messages, ``ToolSpec``s
  and ``ResponseSchema`` that ``FrameworkRun.turn`` takes: one model
  checkpoint per turn (``support/model``, ``support/model#2``, ...), on the
  deployment's route, never paid for again once answered. The ``Reply``
  goes back as a ``ModelResponse`` whose function calls carry the Reply's ids.
- **the tools**: the agent and every agent it hands off to are cloned with
  each ``FunctionTool`` wrapped (``Agent.clone(tools=...)``; the user's
  objects are not changed). The wrapper runs the SDK's own invoker as a
  ``tool`` checkpoint in its call's scope (``support/lookup_order/tool``):
  at least once, its JSON value stored and handed back on every replay, never
  run again once answered; ``oncely.tool_key()`` inside it is the call's
  stable key. A tool's ``needs_approval`` (a bool, or the SDK's policy
  function) makes the call wait for an oncely approval, holding no worker,
  instead of the SDK's interruption: a rejection is the tool's result, so
  the model hears why.

``as_tool(oncely_tool)`` is a ``FunctionTool`` for an oncely tool: a call
tool (``oncely.call_tool``) is one call sent once by the relay, its
receiver's answer the tool's result.

Limits: ``max_turns`` is both the SDK's ``max_turns`` and oncely's; past it,
or past ``max_tokens`` / ``max_cost_usd``, the job is dead with
``agent-limit: <reason>``. The SDK's own persistence (sessions, server-side
conversations, resuming a ``RunState``) is refused: oncely is the one record.
The SDK's tracing is off for the run unless a ``run_config`` says otherwise.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import json
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Literal

from agents import (
    Agent,
    AgentOutputSchemaBase,
    FunctionTool,
    Handoff,
    MaxTurnsExceeded,
    Model,
    ModelProvider,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    RunConfig,
    Runner,
    RunResult,
    RunState,
    TResponseInputItem,
    Usage,
)
from agents import Tool as SdkTool
from agents.items import TResponseOutputItem
from agents.models.fake_id import FAKE_RESPONSES_ID
from agents.tool_context import ToolContext
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from openai.types.responses.response_prompt_param import ResponsePromptParam
from pydantic import BaseModel

from oncely.agent import AgentLimitReached, RunLimits
from oncely.context import APPROVAL_TIMEOUT_S, Context
from oncely.errors import OncelyError, PermanentError
from oncely.integrations.runs import FrameworkRun, current_run
from oncely.llm.base import ResponseSchema, ToolSpec
from oncely.llm.reply import Reply
from oncely.tools import Tool, ToolOutcome

FRAMEWORK = "openai_agents"

# The SDK's own ways of keeping a conversation: oncely keeps the run instead.
_PERSISTENCE = ("session", "previous_response_id", "conversation_id", "auto_previous_response_id")

# How far down an exception's causes an oncely error is looked for.
_CAUSES_READ = 8

# The invokers ``as_tool`` made: their tools are oncely's already, never wrapped again.
_ONCELY_INVOKERS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


async def run(
    ctx: Context,
    agent: Agent[Any],
    input: str | list[TResponseInputItem],
    *,
    name: str | None = None,
    max_turns: int | None = None,
    max_tokens: int | None = None,
    max_cost_usd: float | None = None,
    approval_timeout: float | timedelta = APPROVAL_TIMEOUT_S,
    on_approval_timeout: Literal["reject", "approve"] = "reject",
    **framework_kwargs: Any,
) -> RunResult:
    """Run ``agent`` on ``input`` as ``Runner.run`` would, for this job:
    every model turn a model checkpoint, every function tool a tool
    checkpoint (module docstring). ``name`` (default: the agent's) scopes
    the run's checkpoint keys. ``framework_kwargs`` go to ``Runner.run``
    (``context``, ``hooks``, ``run_config``, ``error_handlers``)."""
    _refuse_own_persistence(input, framework_kwargs)
    config = _run_config(framework_kwargs.pop("run_config", None))
    if max_turns is not None:
        framework_kwargs["max_turns"] = max_turns
    framework_run = FrameworkRun(
        ctx,
        name or agent.name,
        limits=RunLimits(max_turns, max_tokens, max_cost_usd),
        approval_timeout=approval_timeout,
        on_approval_timeout=on_approval_timeout,
    )
    with framework_run.running():
        try:
            result = await Runner.run(
                _CLONES.of(agent), input, run_config=config, **framework_kwargs
            )
        except MaxTurnsExceeded as exc:
            raise AgentLimitReached("max_turns", framework_run.run) from exc
        except Exception as exc:
            cause = _oncely_cause(exc)
            if cause is exc:
                raise
            raise cause from None
    if result.interruptions:
        # Only a tool the run could not wrap would interrupt it: never leave it half done.
        raise PermanentError(
            f"the run stopped for the SDK's approval of {result.interruptions[0].name!r}:"
            " oncely's approvals wait inside the run"
        )
    return result


def as_tool(tool: Tool) -> FunctionTool:
    """An oncely tool (``@oncely.tool``, ``oncely.call_tool(...)``) as the
    SDK's ``FunctionTool``: inside ``run`` it runs through
    ``FrameworkRun.invoke`` (its schema, its approval, its checkpoint; a call
    tool's call sent once by the relay); the result is its JSON."""

    async def invoke(context: ToolContext[Any], arguments: str) -> str:
        framework_run = current_run(FRAMEWORK)
        parsed = _json_object(arguments)
        if parsed is None:
            outcome = ToolOutcome.error("the arguments are not a JSON object")
        else:
            outcome = await framework_run.invoke(tool, context.tool_call_id, parsed)
        return _told(outcome.result)

    _ONCELY_INVOKERS.add(invoke)
    return FunctionTool(
        name=tool.name,
        description=tool.description,
        params_json_schema=tool.parameters,
        on_invoke_tool=invoke,
        # oncely checks the arguments against the tool's own schema.
        strict_json_schema=False,
    )


# -- the run's configuration -------------------------------------------------------


def _refuse_own_persistence(input: object, framework_kwargs: Mapping[str, Any]) -> None:
    """A second durable record would resume from a state oncely never saw."""
    given = [key for key in _PERSISTENCE if framework_kwargs.get(key)]
    if given:
        raise ValueError(
            f"oncely.integrations.{FRAMEWORK}.run keeps the run itself: drop {', '.join(given)}"
        )
    if isinstance(input, RunState):
        raise ValueError(
            f"oncely.integrations.{FRAMEWORK}.run resumes the job itself: pass the input, not"
            " a RunState (approvals wait inside the run)"
        )


def _run_config(given: RunConfig | None) -> RunConfig:
    """The user's run config (or one with the SDK's tracing off), with
    oncely's model for every agent of the run."""
    if given is None:
        # Built in one go: RunConfig() alone would build the SDK's default
        # MultiProvider, for replace() to drop.
        return RunConfig(tracing_disabled=True, model=_MODEL, model_provider=_PROVIDER)
    return dataclasses.replace(given, model=_MODEL, model_provider=_PROVIDER)


def _oncely_cause(exc: Exception) -> BaseException:
    """The oncely error the SDK wrapped (``UserError("Error running tool")``
    around a tool's transient failure), so the job retries or dies as oncely
    says; else the SDK's own exception."""
    seen: BaseException | None = exc
    for _ in range(_CAUSES_READ):
        if seen is None or isinstance(seen, OncelyError):
            break
        seen = seen.__cause__
    return seen if isinstance(seen, OncelyError) else exc


# -- the agents of the run, with their tools as checkpoints --------------------------


class _Clones:
    """Each agent's copy for oncely's runs, its function tools as checkpoints,
    and the copies of every agent it may hand off to (handoffs may go round
    in a circle). A copy is made once and used by every run after it, as the
    SDK lets one agent serve many runs: it holds nothing of a run (its tools
    find their run through ``current_run``). It is made again, with the
    copies of every agent it reaches, as soon as any of them, their tools or
    their handoffs were changed or replaced since: a run never sees a copy
    of an agent the user since changed, and never copies what did not change
    (the SDK's ``Agent`` and ``FunctionTool`` check their type hints and make
    each tool's schema strict again on every copy)."""

    def __init__(self) -> None:
        self._made: dict[int, _Made] = {}

    def of(self, agent: Agent[Any]) -> Agent[Any]:
        found = self._kept(agent, set())
        return found if found is not None else self._copied(agent, {})

    def _kept(self, agent: Agent[Any], seen: set[int]) -> Agent[Any] | None:
        """The copy made before, if neither the agent nor any agent it reaches
        changed since."""
        made = self._made.get(id(agent))
        if made is None or made.agent() is not agent or not _same(made.parts, _parts(agent)):
            return None
        if id(agent) not in seen:
            seen.add(id(agent))
            for target, copied in made.targets:
                found = target()
                if found is None or self._kept(found, seen) is not copied:
                    return None
        return made.clone

    def _copied(self, agent: Agent[Any], made: dict[int, Agent[Any]]) -> Agent[Any]:
        """A new copy of ``agent`` and of every agent it reaches (``made``:
        those copied so far by this call)."""
        found = made.get(id(agent))
        if found is not None:
            return found
        if agent.mcp_servers:
            raise ValueError(
                f"agent {agent.name!r}: tools of MCP servers would run outside oncely's"
                " checkpoints; give the agent function tools"
            )
        parts = _parts(agent)
        clone = agent.clone(tools=[_checkpointed(agent.name, t) for t in agent.tools])
        made[id(agent)] = clone
        targets: list[tuple[weakref.ref[Agent[Any]], Agent[Any]]] = []
        handoffs: list[Agent[Any] | Handoff[Any, Any]] = []
        for handoff in agent.handoffs:
            if isinstance(handoff, Agent):
                copied = self._copied(handoff, made)
                targets.append((weakref.ref(handoff), copied))
                handoffs.append(copied)
            else:
                handoffs.append(self._handoff(handoff))
        clone.handoffs = handoffs
        key = id(agent)
        if len(self._made) >= _KEPT_AT_MOST:
            # Agents made per job that hand off in a circle keep each other
            # alive (their parts hold one another): never more than this.
            self._made.clear()
        gone = functools.partial(self._forget, key)
        self._made[key] = _Made(weakref.ref(agent, gone), parts, clone, tuple(targets))
        return clone

    def _forget(self, key: int, agent: weakref.ref[Agent[Any]]) -> None:
        made = self._made.get(key)
        if made is not None and made.agent is agent:
            del self._made[key]

    def _handoff(self, handoff: Handoff[Any, Any]) -> Handoff[Any, Any]:
        original = handoff.on_invoke_handoff

        async def to_clone(context: Any, arguments: str) -> Any:
            target = await original(context, arguments)
            return self.of(target) if isinstance(target, Agent) else target

        wrapped = copy.copy(handoff)
        wrapped.on_invoke_handoff = to_clone
        return wrapped


@dataclasses.dataclass(frozen=True)
class _Made:
    """An agent's copy, and what it was made from."""

    agent: weakref.ref[Agent[Any]]
    parts: tuple[Any, ...]
    clone: Agent[Any]
    # The agents it hands off to, each with the copy it hands off to.
    targets: tuple[tuple[weakref.ref[Agent[Any]], Agent[Any]], ...]


def _parts(agent: Agent[Any]) -> tuple[Any, ...]:
    """What an agent's copy is made from: its fields, the entries of its
    tool and handoff lists and the fields of each (a list changed in place,
    a tool given other settings)."""
    return (
        *_fields_of(agent),
        *(part for tool in agent.tools for part in (tool, *_fields_of(tool))),
        *(part for handoff in agent.handoffs for part in (handoff, *_fields_of(handoff))),
    )


def _fields_of(value: Any) -> tuple[Any, ...]:
    kind: type = type(value)
    if not dataclasses.is_dataclass(kind):
        return ()
    return tuple(getattr(value, name) for name in _field_names(kind))


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(kind))


def _same(kept: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    """The same objects, one by one (an equal but new value counts as a change)."""
    return len(kept) == len(now) and all(a is b for a, b in zip(kept, now, strict=True))


# Every run's copies (``run``): made again only when an agent changed.
_CLONES = _Clones()
# The agents whose copies are kept at most (a deployment has a few).
_KEPT_AT_MOST = 256


def _checkpointed(agent: str, tool: SdkTool) -> SdkTool:
    """A function tool that runs as a tool checkpoint, its approval policy
    an oncely approval; an oncely tool (``as_tool``) as it is."""
    if not isinstance(tool, FunctionTool):
        raise ValueError(
            f"agent {agent!r}: the {type(tool).__name__} runs at the provider, not through"
            " oncely's model; give the agent function tools"
        )
    if tool.on_invoke_tool in _ONCELY_INVOKERS:
        if tool.needs_approval:
            raise ValueError(
                f"tool {tool.name!r} is an oncely tool: give it approval= instead of needs_approval"
            )
        return tool
    wrapped = copy.copy(tool)
    wrapped.on_invoke_tool = _invoker(tool)
    # The SDK would interrupt the run for it: oncely waits for a person instead.
    wrapped.needs_approval = False
    return wrapped


def _invoker(tool: FunctionTool) -> Callable[[ToolContext[Any], str], Awaitable[Any]]:
    original = tool.on_invoke_tool
    policy = tool.needs_approval

    async def invoke(context: ToolContext[Any], arguments: str) -> Any:
        framework_run = current_run(FRAMEWORK)
        parsed = _json_object(arguments)
        if parsed is None:
            return _told({"error": "the arguments are not a JSON object"})
        approval = await _needs_approval(policy, context, parsed)

        async def body(given: Mapping[str, Any]) -> Any:
            sent = arguments if given == parsed else json.dumps(dict(given))
            return _as_json(await original(context, sent))

        outcome = await framework_run.call_tool(
            tool.name,
            context.tool_call_id,
            body,
            parsed,
            approval=approval,
            schema=tool.params_json_schema,
        )
        return _told(outcome.result) if outcome.status == "rejected" else outcome.result

    return invoke


async def _needs_approval(
    policy: bool | Callable[..., Any], context: ToolContext[Any], arguments: dict[str, Any]
) -> bool:
    """The tool's ``needs_approval``: a bool, or the SDK's policy function
    of (run context, arguments, call id), sync or async."""
    if not callable(policy):
        return bool(policy)
    decided = policy(context, arguments, context.tool_call_id)
    if inspect.isawaitable(decided):
        decided = await decided
    return bool(decided)


def _as_json(value: Any) -> Any:
    """A tool's output as the JSON stored with its checkpoint: the SDK's
    structured outputs (``ToolOutputText``...) as their dicts, which it reads
    back the same; anything else JSON cannot hold as the text the SDK would
    make of it."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, list | tuple):
        return [_as_json(item) for item in value]
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def _told(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(text or "{}")
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


# -- oncely's model ---------------------------------------------------------------


class OncelyModel(Model):
    """The SDK's model interface over ``FrameworkRun.turn``: each
    ``get_response`` is one model checkpoint of the running job."""

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[SdkTool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff[Any, Any]],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        framework_run = current_run(FRAMEWORK)
        reply = await framework_run.turn(
            chat_messages(system_instructions, input),
            tools=tool_specs(tools, handoffs),
            tool_choice=_tool_choice(model_settings),
            output=_output(output_schema),
        )
        return model_response(reply)

    async def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[SdkTool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff[Any, Any]],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[Any]:
        raise PermanentError(f"oncely.integrations.{FRAMEWORK}.run answers whole turns only")
        yield  # an async generator, as the interface has it


class OncelyModelProvider(ModelProvider):
    """Every model name of the run is oncely's model: the deployment's route
    decides which model answers."""

    def get_model(self, model_name: str | None) -> Model:
        return _MODEL


_MODEL = OncelyModel()
_PROVIDER = OncelyModelProvider()


def _tool_choice(settings: ModelSettings) -> str:
    choice = settings.tool_choice
    return choice if isinstance(choice, str) else "auto"


def _output(schema: AgentOutputSchemaBase | None) -> ResponseSchema | None:
    if schema is None or schema.is_plain_text():
        return None
    return ResponseSchema(schema.name(), schema.json_schema())


def tool_specs(tools: Iterable[SdkTool], handoffs: Iterable[Handoff[Any, Any]]) -> list[ToolSpec]:
    """What the model is told of the agent's function tools and handoffs
    (a handoff is a tool call to the model)."""
    specs = []
    for tool in tools:
        if not isinstance(tool, FunctionTool):
            raise PermanentError(f"the {type(tool).__name__} cannot be called through oncely")
        specs.append(ToolSpec(tool.name, tool.description, tool.params_json_schema))
    for handoff in handoffs:
        specs.append(
            ToolSpec(handoff.tool_name, handoff.tool_description, handoff.input_json_schema)
        )
    return specs


def chat_messages(
    system_instructions: str | None, input: str | list[TResponseInputItem]
) -> list[dict[str, Any]]:
    """The SDK's Responses-API input items as OpenAI chat messages: the
    instructions, messages, function calls (gathered on the assistant
    message before them) and their outputs. Reasoning items are the
    provider's own and dropped; an item chat has no form for is refused."""
    messages: list[dict[str, Any]] = []
    if system_instructions:
        messages.append({"role": "system", "content": system_instructions})
    items = [{"role": "user", "content": input}] if isinstance(input, str) else input
    for item in items:
        _add_item(messages, _plain(item))
    return messages


def _add_item(messages: list[dict[str, Any]], item: Mapping[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise PermanentError(f"a message of role {role!r} cannot be sent through oncely")
        messages.append({"role": role, "content": _text(item.get("content"))})
    elif kind == "function_call":
        _assistant_turn(messages).setdefault("tool_calls", []).append(
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
            }
        )
    elif kind == "function_call_output":
        content = _text(item.get("output"))
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
    elif kind != "reasoning":
        raise PermanentError(f"an input item of type {kind!r} cannot be sent through oncely")


def _assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a function call belongs to: the last one, when
    nothing came after it, else a new one."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": None})
    return messages[-1]


def _text(content: Any) -> str:
    """A message's content as the text chat takes: a string, or the text of
    its parts (input_text, output_text, refusal)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        part = _plain(part)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise PermanentError(f"content of type {kind!r} cannot be sent through oncely")
    return "".join(texts)


def _plain(item: Any) -> Mapping[str, Any]:
    if isinstance(item, BaseModel):
        return item.model_dump(exclude_none=True)
    if isinstance(item, Mapping):
        return item
    raise PermanentError(f"an input item of type {type(item).__name__} cannot be read")


def model_response(reply: Reply) -> ModelResponse:
    """An oncely turn as the SDK's response: the text as an assistant
    message, each tool call as a function call under the Reply's id."""
    output: list[TResponseOutputItem] = []
    if reply.text:
        text = ResponseOutputText(type="output_text", text=reply.text, annotations=[])
        output.append(
            ResponseOutputMessage(
                id=FAKE_RESPONSES_ID,
                type="message",
                role="assistant",
                status="completed",
                content=[text],
            )
        )
    for call in reply.tool_calls:
        output.append(
            ResponseFunctionToolCall(
                id=FAKE_RESPONSES_ID,
                type="function_call",
                call_id=call.id,
                name=call.name,
                arguments=call.raw_arguments or "{}",
                status="completed",
            )
        )
    return ModelResponse(output=output, usage=_usage(reply.usage), response_id=None)


def _usage(spent: Mapping[str, Any]) -> Usage:
    prompt = int(spent.get("prompt_tokens") or 0)
    completion = int(spent.get("completion_tokens") or 0)
    return Usage(
        requests=1,
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=prompt + completion,
    )
