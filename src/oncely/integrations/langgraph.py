"""LangGraph, with oncely's guarantees (docs/framework-langgraph.md).

A LangGraph graph compiles its model and its tools into itself, so oncely
cannot swap them in at run time as it does for Pydantic AI or the OpenAI
Agents SDK. The graph is built with oncely's pieces instead, through
LangChain's own extension points:

- ``chat_model()`` is a LangChain chat model (a ``BaseChatModel``
  subclass, the documented way to bring a model to LangChain) that answers
  through ``FrameworkRun.turn``: one model checkpoint per request, on the
  deployment's route, never paid for again once answered. ``bind_tools``
  and ``with_structured_output`` work as on any chat model;
- ``as_tool(tool)`` is a LangChain tool (a ``BaseTool`` subclass) around a
  plain function, a LangChain tool or an oncely tool; its every run is a
  tool checkpoint in the scope its turn opened for the ``ToolCall`` id
  ``ToolNode`` passes: at least once, its JSON value stored, never run
  again for the job once it answered (``oncely.tool_key()`` inside it is
  the key to give an API that dedupes). An oncely call tool is a call that
  answers: sent once by the relay.

``run(ctx, graph, input)`` runs the compiled graph with ``ainvoke`` inside
one ``FrameworkRun`` and returns its final state. Everything between
checkpoints (the graph's nodes, edges, reducers) runs again on a replay and
must take the same path. The graph's own persistence stays off: a graph
compiled with a checkpointer is refused; oncely is the one durable record.

``interrupt()`` becomes an oncely wait a person answers: with
``run(..., interrupts="review")`` the job waits for the workflow's event
``review`` (holding no worker) and the graph resumes with its body. Resuming
takes a checkpointer, so such a run gets one of its own, in memory, that
outlives nothing: on a replay the graph runs again over the job's
checkpoints to the same interrupt, the stored answer resumes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ToolMessage,
    convert_to_openai_messages,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool, ToolException
from langchain_core.tools import tool as langchain_tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.errors import GraphRecursionError
from langgraph.pregel import Pregel
from langgraph.types import Command, Interrupt
from pydantic import BaseModel, ConfigDict
from pydantic_core import to_jsonable_python

from oncely.agent import AgentLimitReached, RunLimits
from oncely.context import APPROVAL_TIMEOUT_S, Context
from oncely.errors import PermanentError
from oncely.integrations.runs import FrameworkRun, current_run
from oncely.llm.base import ResponseSchema, ToolSpec
from oncely.llm.reply import Reply
from oncely.tools import Tool, ToolOutcome

__all__ = ["OncelyChatModel", "as_tool", "chat_model", "run"]

FRAMEWORK = "langgraph"

# The ToolCall id ToolNode passed to the tool now running (BaseTool.ainvoke
# receives it; _arun, where the work is done, does not).
_CALL_ID: ContextVar[str | None] = ContextVar("oncely_langgraph_call_id", default=None)

# A tool decides whether a call needs a person: always, or by its arguments.
Approval = bool | Callable[[Mapping[str, Any]], bool]


async def run(
    ctx: Context,
    graph: Pregel[Any, Any, Any, Any],
    input: Any,
    *,
    name: str | None = None,
    max_turns: int | None = None,
    max_tokens: int | None = None,
    max_cost_usd: float | None = None,
    approval_timeout: float | timedelta = APPROVAL_TIMEOUT_S,
    on_approval_timeout: Literal["reject", "approve"] = "reject",
    interrupts: str | Sequence[str] = (),
    **framework_kwargs: Any,
) -> Any:
    """Run the compiled ``graph`` (``graph.ainvoke(input, **framework_kwargs)``)
    for this job and return its final state. Its ``chat_model()`` turns and
    ``as_tool`` tools are checkpoints in the scope ``name`` (default: the
    graph's name). Past a limit, or past LangGraph's own ``recursion_limit``,
    ``oncely.AgentLimitReached``: the job is dead with ``agent-limit``.

    ``interrupts`` names the workflow's events (``Workflow(events=...)``)
    that answer the graph's ``interrupt()`` calls, the n-th event the n-th
    call: the job waits for it, holding no worker, and the graph resumes
    with its body as JSON (None past ``ONCELY_WAIT_MAX_S``). An
    ``interrupt()`` no event is named for is a ``PermanentError``."""
    if isinstance(graph.checkpointer, BaseCheckpointSaver):
        raise ValueError(
            f"graph {graph.name!r} is compiled with a checkpointer: inside oncely the"
            " job's checkpoints are the one durable record; compile it without one"
        )
    framework = FrameworkRun(
        ctx,
        name or graph.name,
        limits=RunLimits(max_turns, max_tokens, max_cost_usd),
        approval_timeout=approval_timeout,
        on_approval_timeout=on_approval_timeout,
    )
    with framework.running():
        try:
            events = [interrupts] if isinstance(interrupts, str) else list(interrupts or ())
            return await _answering(ctx, graph, input, events, framework_kwargs)
        except GraphRecursionError as exc:
            raise AgentLimitReached("recursion_limit", framework.run) from exc
        except _Escaping as exc:
            raise exc.escaped from None


async def _answering(
    ctx: Context,
    graph: Pregel[Any, Any, Any, Any],
    input: Any,
    events: Sequence[str],
    kwargs: dict[str, Any],
) -> Any:
    """The graph run to its end, its n-th ``interrupt()`` answered by the
    n-th of ``events`` (a job receives an event of a name once)."""
    if not events:
        state = await graph.ainvoke(input, **kwargs)
        if _asked(state):
            raise PermanentError(
                f"graph {graph.name!r} called interrupt(): name the event that answers"
                " it with oncely.integrations.langgraph.run(..., interrupts=...)"
            )
        return state
    # Opened before the graph runs, while this task is the run scope's own
    # (once the graph's tasks entered it, this task would be a branch).
    waits = ctx.open_scope("interrupt")
    answering = iter(events)
    resumable, kwargs = _resumable(graph, kwargs)
    state = await resumable.ainvoke(input, **kwargs)
    while asked := _asked(state):
        # One wait per interrupt, in the order the graph asked: the same
        # keys on every replay (the graph runs again to the same interrupts).
        answers = {}
        for interrupt in asked:
            event = next(answering, None)
            if event is None:
                raise PermanentError(
                    f"graph {graph.name!r} called interrupt() more often than"
                    f" interrupts= names events ({len(events)})"
                )
            with ctx.within(waits):
                answers[interrupt.id] = to_jsonable_python(await ctx.wait_for_event(event))
        state = await resumable.ainvoke(Command(resume=answers), **kwargs)
    return state


def _resumable(
    graph: Pregel[Any, Any, Any, Any], kwargs: dict[str, Any]
) -> tuple[Pregel[Any, Any, Any, Any], dict[str, Any]]:
    """The graph with a checkpointer of this run's own, in memory: what
    ``Command(resume=...)`` needs to go on from an interrupt within this
    run. It outlives nothing; on a replay the graph runs again over the
    job's checkpoints to the same interrupt. Written only when it stops."""
    config = dict(kwargs.get("config") or {})
    config["configurable"] = {**config.get("configurable", {}), "thread_id": "oncely"}
    given = {"durability": "exit", **kwargs, "config": config}
    # What it reads back it wrote itself, in this process: any type is safe.
    saver = InMemorySaver(serde=JsonPlusSerializer(allowed_msgpack_modules=True))
    return graph.copy(update={"checkpointer": saver}), given


def _asked(state: Any) -> list[Interrupt]:
    if not isinstance(state, Mapping):
        return []
    return list(state.get("__interrupt__") or ())


# -- the model -------------------------------------------------------------------


def chat_model() -> OncelyChatModel:
    """The chat model a graph run by ``run`` is built with."""
    return OncelyChatModel()


class OncelyChatModel(BaseChatModel):
    """A LangChain chat model that answers through the job's ``ctx.model``
    (only inside ``run``, only asynchronously: ``ainvoke``). Tool
    definitions, tool calls and structured output round-trip as LangChain
    types; the route, its fallbacks and its prices are the deployment's."""

    # A cached answer would skip the turn's checkpoint and its limits.
    cache: bool | None = False

    @property
    def _llm_type(self) -> str:
        return "oncely"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        raise RuntimeError(
            "oncely's chat model answers only asynchronously: run the graph with"
            " oncely.integrations.langgraph.run(ctx, graph, input)"
        )

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if stop:
            raise ValueError("oncely's chat model takes no stop sequences")
        try:
            reply = await current_run(FRAMEWORK).turn(
                openai_messages(messages),
                tools=[_spec(t) for t in kwargs.get("tools") or ()],
                tool_choice=_choice(kwargs.get("tool_choice")),
                output=_schema(kwargs.get("response_format")),
            )
        except Exception:
            raise
        except BaseException as exc:
            raise _Escaping(exc) from None
        return ChatResult(generations=[ChatGeneration(message=ai_message(reply))])

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """The model with ``tools`` (any form LangChain converts to an
        OpenAI tool) told to every turn."""
        # Whether a turn's calls come together is the route's to decide.
        kwargs.pop("parallel_tool_calls", None)
        formatted = [convert_to_openai_tool(t) for t in tools]
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: Literal["json_schema", "function_calling"] = "json_schema",
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Answers as ``schema``: by default JSON valid for it (an
        ``oncely.ResponseSchema``, the route's structured output);
        ``method="function_calling"`` forces a tool call instead."""
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if include_raw or kwargs:
            raise ValueError("oncely's structured output takes only schema and method")
        function = convert_to_openai_tool(schema)["function"]
        bound = self.bind(
            response_format={"name": function["name"], "schema": function.get("parameters", {})},
            ls_structured_output_format={"kwargs": {"method": method}, "schema": schema},
        )
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return bound | PydanticOutputParser(pydantic_object=schema)
        return bound | JsonOutputParser()


class _Escaping(RuntimeError):
    """What is not an ``Exception`` (oncely's wait for a person or an
    answer, a cancelled task), carried out of a model turn: LangChain's
    ``agenerate`` gathers turns with ``return_exceptions=True`` and then
    fails on any other ``BaseException`` with an ``AttributeError``.
    ``run`` raises it again as it was. A ``RuntimeError``, which LangGraph's
    default retry policy never retries."""

    def __init__(self, escaped: BaseException) -> None:
        super().__init__(f"{type(escaped).__name__} carried out of a model turn")
        self.escaped = escaped


def openai_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the OpenAI-style dicts ``ctx.model.respond`` takes."""
    return [_plain(m) for m in convert_to_openai_messages(list(messages), text_format="string")]


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """Only what a provider is told: a message's role, text, tool calls."""
    fields = ("role", "content", "tool_calls", "tool_call_id")
    kept: dict[str, Any] = {k: message[k] for k in fields if k in message}
    if not isinstance(kept.get("content", ""), str):
        kept["content"] = json.dumps(kept["content"])
    return kept


def ai_message(reply: Reply) -> AIMessage:
    """A turn as LangChain's ``AIMessage``: its tool calls carry the ids the
    turn's scopes were opened for, arguments that are not a JSON object are
    an invalid tool call (as LangChain reads them from any provider)."""
    usage = reply.usage
    return AIMessage(
        content=reply.text,
        tool_calls=[
            tool_call(name=c.name, args=c.arguments, id=c.id)
            for c in reply.tool_calls
            if c.arguments is not None
        ],
        invalid_tool_calls=[
            invalid_tool_call(name=c.name, args=c.raw_arguments, id=c.id, error=c.malformed)
            for c in reply.tool_calls
            if c.arguments is None
        ],
        usage_metadata=_usage(usage),
        response_metadata={"model_name": usage.get("model")},
    )


def _usage(usage: Mapping[str, Any]) -> UsageMetadata:
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    found = UsageMetadata(
        input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion
    )
    if usage.get("cached_tokens"):
        found["input_token_details"] = {"cache_read": int(usage["cached_tokens"])}
    if usage.get("reasoning_tokens"):
        found["output_token_details"] = {"reasoning": int(usage["reasoning_tokens"])}
    return found


def _spec(tool: Mapping[str, Any]) -> ToolSpec:
    function = tool.get("function", tool)
    return ToolSpec(
        str(function["name"]), str(function.get("description", "")), function["parameters"]
    )


def _choice(choice: Any) -> str:
    """LangChain's tool choice as oncely's: ``auto``, ``none``, ``required`` or a name."""
    if choice is None or choice == "auto":
        return "auto"
    if choice is True or choice == "any":
        return "required"
    if isinstance(choice, Mapping):
        return str(choice.get("function", choice).get("name"))
    return str(choice)


def _schema(response_format: Any) -> ResponseSchema | None:
    if response_format is None:
        return None
    return ResponseSchema(str(response_format["name"]), response_format["schema"])


# -- tools -----------------------------------------------------------------------


def as_tool(tool: Tool | BaseTool | Callable[..., Any], *, approval: Approval = False) -> BaseTool:
    """A LangChain tool whose every run is an oncely checkpoint: ``tool`` is
    an oncely tool (``@oncely.tool``, ``oncely.call_tool``: its own
    ``approval=`` applies), a LangChain tool, or a plain function (made one
    by LangChain's ``@tool``). ``approval`` (True, or a function of the
    arguments) makes a call wait for a person's decision first."""
    if isinstance(tool, Tool):
        if approval:
            raise ValueError(f"tool {tool.name!r}: give an oncely tool its approval= itself")
        return _OncelyTool(name=tool.name, description=tool.description, tool=tool)
    inner = tool if isinstance(tool, BaseTool) else langchain_tool(tool)
    return _CheckpointedTool(
        name=inner.name,
        description=inner.description,
        args_schema=inner.tool_call_schema,
        inner=inner,
        approval=approval,
        handle_tool_error=inner.handle_tool_error,
        handle_validation_error=inner.handle_validation_error,
    )


class _Checkpointed(BaseTool):
    """A tool that knows the ToolCall id it was invoked with."""

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        called = isinstance(input, dict) and input.get("type") == "tool_call"
        token = _CALL_ID.set(str(input.get("id")) if called else None)
        try:
            return await super().ainvoke(input, config, **kwargs)
        finally:
            _CALL_ID.reset(token)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"tool {self.name!r} runs only asynchronously, inside"
            " oncely.integrations.langgraph.run(ctx, graph, input)"
        )


class _CheckpointedTool(_Checkpointed):
    """A LangChain tool run as a tool checkpoint."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inner: BaseTool
    approval: Approval = False

    async def _arun(self, config: RunnableConfig, **kwargs: Any) -> Any:
        arguments = to_jsonable_python(kwargs)
        call_id = _CALL_ID.get()

        async def work(given: Mapping[str, Any]) -> Any:
            return await self._answer(dict(given), call_id, config)

        asks = self.approval(arguments) if callable(self.approval) else self.approval
        outcome = await current_run(FRAMEWORK).call_tool(
            self.name,
            call_id,
            work,
            arguments,
            approval=asks,
            keep=(ToolException,),
            schema=_arguments_schema(self.inner) if asks else None,
            scripted=_scripted_message if call_id is not None else None,
        )
        if outcome.status != "ok" or call_id is None:
            return _told(self.name, call_id, outcome)
        answered = outcome.result
        return ToolMessage(
            answered["content"], tool_call_id=call_id, name=self.name, status=answered["status"]
        )

    async def _answer(self, arguments: dict[str, Any], call_id: str | None, config: Any) -> Any:
        """What the LangChain tool answers, as JSON: for a model's call, the
        content and status of the ``ToolMessage`` it makes (its artifact is
        not kept); called without one, its value."""
        if call_id is None:
            return to_jsonable_python(await self.inner.ainvoke(arguments, config))
        call = {"type": "tool_call", "id": call_id, "name": self.name, "args": arguments}
        answer = await self.inner.ainvoke(call, config)
        if not isinstance(answer, ToolMessage):
            raise PermanentError(
                f"tool {self.name!r} answered a {type(answer).__name__}: inside oncely a"
                " tool answers content (a Command would change the graph's state unrecorded)"
            )
        return {"content": answer.content, "status": answer.status}


class _OncelyTool(_Checkpointed):
    """An oncely tool (``@oncely.tool``, ``oncely.call_tool``) as a
    LangChain tool: its schema, approval and checkpoint are oncely's own."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    tool: Tool

    def model_post_init(self, context: Any, /) -> None:
        # The JSON schema as the model is told it: LangChain passes the
        # arguments through as sent and Tool.invoke checks them, telling the
        # model what was wrong as oncely.Agent does.
        self.args_schema = dict(self.tool.parameters)

    async def _arun(self, **arguments: Any) -> Any:
        call_id = _CALL_ID.get()
        outcome = await current_run(FRAMEWORK).invoke(self.tool, call_id, arguments)
        return _told(self.name, call_id, outcome)


def _scripted_message(value: Any) -> dict[str, Any]:
    """A test's scripted value for a LangChain tool the model called, as
    ``_answer`` keeps what the tool answered: its ``ToolMessage``'s content
    (text as it is, anything else as JSON, as LangChain makes a tool's
    value content) and status."""
    content = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return {"content": content, "status": "success"}


def _told(name: str, call_id: str | None, outcome: ToolOutcome) -> Any:
    """What the graph gets: the tool's value; a call a person rejected (or
    oncely refused) as LangChain says a tool failed, a ``ToolMessage`` with
    ``status="error"`` whose content is what the model is told."""
    if outcome.status == "ok" or call_id is None:
        return outcome.result
    content = json.dumps(outcome.result, separators=(",", ":"))
    return ToolMessage(content, tool_call_id=call_id, name=name, status="error")


def _arguments_schema(tool: BaseTool) -> dict[str, Any] | None:
    """The JSON schema of what the model passes ``tool`` (none known: None)."""
    schema = tool.tool_call_schema
    if isinstance(schema, dict):
        return schema
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema()
    return None
