"""Tools an agent's model may call (docs/agents.md).

Two kinds, one shape to the model (a name, a description, a JSON schema of
its arguments):

- **Function tools**, ``@oncely.tool`` on a function (sync or async): its
  name, its docstring, its parameters' type hints. It runs like
  ``ctx.step``: at least once, its value kept, never run again for the job
  once it answered. A parameter annotated ``ToolContext`` is filled in, not
  shown to the model: its ``key`` is stable across every retry and replay, to
  pass to an API that takes an idempotency key.
- **Call tools**, ``oncely.call_tool(topic, args=Model)``: the model's
  arguments are a call that answers (``ctx.call``), sent once by the relay;
  the receiver's answer is the tool's result. Exactly-once, with a receiver
  that dedupes on the key.

``approval=True`` on either makes the agent wait for a person's decision
before the tool runs; a function of the validated arguments
(``approval=lambda args: args.cents > 5000``) asks only when it says so.

A ``Toolset`` is tools an agent learns of only when a run starts (an MCP
server's, ``oncely.mcp_tools``): their arguments are a JSON schema the
server sent (``schema_args``), not type hints.

Inside ``oncely.testing.run_step`` only, a ``ToolScript`` answers tools by
name in place of running them, and lists toolsets without asking their
servers (``tools=``, ``toolsets=``: docs/testing.md); everywhere else there
is none and nothing changes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_type_hints, overload

from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from oncely.context import APPROVAL_TIMEOUT_S, Context, record_step, tool_key
from oncely.errors import CallFailed, PermanentError, short_errors
from oncely.llm.base import ToolSpec
from oncely.storable import UNSTORABLE_TEXT, unstorable

ToolStatus = Literal["ok", "error", "rejected"]

# How many characters of a tool's error the model is told.
ERROR_CHARS = 500

# A tool's name: what model APIs allow, and a checkpoint name too.
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


def valid_tool_name(name: str) -> bool:
    """Whether ``name`` may name a tool (1-63 of a-z, 0-9, _ and -, from a letter)."""
    return isinstance(name, str) and bool(_NAME.match(name))


@dataclass(frozen=True)
class ToolContext:
    """What a function tool may ask for by annotating a parameter with it.

    ``key`` is ``<job_id>:<checkpoint key>``: the same on every retry and
    replay of this tool call, and unique to it; pass it to an API that takes
    an idempotency key and the tool's effect happens once too."""

    key: str
    job_id: str
    tenant: str


class ToolArgs(BaseModel):
    """The base of the models built from a function tool's parameters."""

    model_config = ConfigDict(extra="forbid")


class SchemaArgs(BaseModel):
    """The base of the models of arguments a JSON schema describes (an MCP
    server's tool, ``schema_args``): any JSON object the schema accepts,
    checked by ``jsonschema``, kept as given and shown to the model as the
    schema itself."""

    model_config = ConfigDict(extra="allow", frozen=True)

    arguments_schema: ClassVar[dict[str, Any]] = {"type": "object"}
    arguments_validator: ClassVar[Any] = None

    @model_validator(mode="before")
    @classmethod
    def _valid_for_the_schema(cls, data: Any) -> Any:
        data = dict(data) if isinstance(data, Mapping) else data
        if cls.arguments_validator is not None:
            error = next(iter(cls.arguments_validator.iter_errors(data)), None)
            if error is not None:
                where = ".".join(str(part) for part in error.absolute_path)
                message = f"{where}: {error.message}" if where else error.message
                raise PydanticCustomError("json_schema", message[:200])
        return data

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return copy.deepcopy(cls.arguments_schema)


def schema_validator(schema: dict[str, Any]) -> Any:
    """What checks arguments against a tool's JSON ``schema`` (2020-12
    unless it says otherwise), wherever they are checked: the worker, and
    the API for a person's edits. ``jsonschema.SchemaError`` when ``schema``
    is no valid schema."""
    checker = validator_for(schema, default=Draft202012Validator)
    checker.check_schema(schema)
    return checker(schema)


def schema_args(name: str, schema: Mapping[str, Any]) -> type[SchemaArgs]:
    """The arguments model of tool ``name`` whose arguments ``schema``
    describes (``schema_validator``)."""
    given = copy.deepcopy(dict(schema))
    model = create_model(f"{_camel(name)}Args", __base__=SchemaArgs)
    model.arguments_validator = schema_validator(given)
    model.arguments_schema = given
    return model


@dataclass(frozen=True)
class ToolOutcome:
    """What came of one tool call, as the model is told it: ``ok`` with the
    tool's ``result``; ``error`` with ``{"error": ...}`` (bad arguments, a
    refused call, a tool raising ``PermanentError``); ``rejected`` with
    ``{"rejected": true, "reason"}`` (a person said no). ``arguments``: what
    it ran with (a person's edits included), None when they cannot be kept."""

    status: ToolStatus
    result: Any
    arguments: Mapping[str, Any] | None = None

    @classmethod
    def error(cls, message: str, arguments: Mapping[str, Any] | None = None) -> ToolOutcome:
        return cls("error", {"error": message[:ERROR_CHARS]}, arguments)


@dataclass(frozen=True)
class Tool:
    """A tool as the agent holds it: what the model sees (``name``,
    ``description``, ``args``' JSON schema) and how it runs (``fn``, or the
    call ``topic``)."""

    name: str
    description: str
    args: type[BaseModel]
    fn: Callable[..., Any] | None = None
    topic: str | None = None
    approval: bool | Callable[[Any], bool] = False
    # The parameter a ToolContext is passed as (function tools).
    context_param: str | None = None
    # An effect no receiver dedupes (docs/at-most-once.md): its intent is
    # stored before it runs, and a delivery that finds the intent without a
    # result never runs it again on its own: ``reconcile(args, key)`` says
    # what happened (``oncely.NOT_DONE``: run it), else a person does.
    at_most_once: bool = False
    reconcile: Callable[[Any, str], Any] | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"tool name {self.name!r}: 1-63 of a-z, 0-9, _ and -, starting with a letter"
            )
        if (self.fn is None) == (self.topic is None):
            raise ValueError(f"tool {self.name!r}: a function or a call topic, not both")
        if self.reconcile is not None and not self.at_most_once:
            raise ValueError(f"tool {self.name!r}: reconcile= goes with at_most_once=True")
        if self.at_most_once and self.topic is not None:
            raise ValueError(
                f"tool {self.name!r}: a call tool is sent once by the relay; at_most_once="
                " is for function tools"
            )

    def needs_approval(self, args: BaseModel) -> bool:
        """Whether this call waits for a person first."""
        return self.approval(args) if callable(self.approval) else bool(self.approval)

    async def invoke(
        self,
        ctx: Context,
        arguments: Mapping[str, Any],
        *,
        approval_timeout: float = APPROVAL_TIMEOUT_S,
        on_approval_timeout: Literal["reject", "approve"] = "reject",
    ) -> ToolOutcome:
        """Run this tool for the model's ``arguments``, in the running scope
        (an agent opens one per tool call): checked against its schema, a
        person's decision first when it needs one (``ctx.approval``), then a
        tool checkpoint (a function tool) or a call that answers (a call
        tool). What the model should be told comes back as a
        ``ToolOutcome``; a transient failure is raised (the job retries)."""
        if unstorable(arguments) is not None:
            return ToolOutcome.error(f"the arguments: {UNSTORABLE_TEXT}")
        try:
            args = self.args.model_validate(arguments)
        except ValidationError as exc:
            return ToolOutcome.error(f"invalid arguments: {short_errors(exc)}", arguments)
        if self.needs_approval(args):
            # A schema's arguments are known to no workflow: the wait keeps it,
            # so that a person's edits are checked against it (422).
            schema = self.parameters if issubclass(self.args, SchemaArgs) else None
            decision = await ctx.approval(
                self.name,
                arguments,
                timeout=approval_timeout,
                on_timeout=on_approval_timeout,
                schema=schema,
            )
            if not decision.approved:
                reason = decision.reason or "rejected by a person"
                return ToolOutcome("rejected", {"rejected": True, "reason": reason}, arguments)
            if decision.arguments is not None:
                try:
                    args = self.edited(decision.arguments)
                except ValidationError as exc:
                    message = f"the approved arguments are invalid: {short_errors(exc)}"
                    return ToolOutcome.error(message, arguments)
        try:
            result = await self._run(ctx, args)
        except CallFailed as exc:
            return ToolOutcome.error(f"the call failed ({exc.reason}): {exc}", arguments)
        except PermanentError as exc:
            return ToolOutcome.error(f"{type(exc).__name__}: {exc}", arguments)
        return ToolOutcome("ok", result, args.model_dump(mode="json"))

    async def _run(self, ctx: Context, args: BaseModel) -> Any:
        if self.topic is not None:
            _not_scripted_call(self)
            answer = await ctx.call(self.topic, args, step="call")
            return answer.model_dump(mode="json") if isinstance(answer, BaseModel) else answer
        assert self.fn is not None
        function = self.fn
        answer = scripted_answer(self.name)
        if answer is not None:
            function = answer

        def run() -> Any:
            context = ToolContext(key=tool_key(), job_id=ctx.job_id, tenant=ctx.tenant)
            return function(**self.keyword_arguments(args, context))

        async def run_async() -> Any:
            return await run()

        return await record_step(
            ctx,
            "tool",
            "tool",
            run_async if inspect.iscoroutinefunction(function) else run,
            (),
            {},
            at_most_once=self.at_most_once,
            reconcile=self.reconcile,
            label=self.name,
            arguments=args,
        )

    def edited(self, arguments: Mapping[str, Any]) -> BaseModel:
        """Arguments a person edited (an approval), checked strictly: no
        field the schema does not name, no value of another type coerced
        (``true`` is not 1 cent). ``ValidationError`` otherwise."""
        model = self.args
        if issubclass(model, SchemaArgs):
            return model.model_validate(dict(arguments))  # the schema says what is extra
        known = {f.alias or name for name, f in model.model_fields.items()} | set(
            model.model_fields
        )
        extra = [
            InitErrorDetails(type="extra_forbidden", loc=(name,), input=value)
            for name, value in arguments.items()
            if name not in known
        ]
        if extra:
            raise ValidationError.from_exception_data(model.__name__, extra)
        return model.model_validate_json(json.dumps(dict(arguments)), strict=True)

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the tool's arguments, as the model is told it."""
        return _schema(self.args)

    @property
    def spec(self) -> ToolSpec:
        """The tool as a model is told it."""
        return ToolSpec(self.name, self.description, self.parameters)

    def keyword_arguments(self, args: BaseModel, context: ToolContext) -> dict[str, Any]:
        """What a function tool is called with: the validated arguments by
        name, and the context where it asks for one."""
        values = {name: getattr(args, name) for name in type(args).model_fields}
        values.update(args.model_extra or {})  # a schema's arguments (SchemaArgs)
        if self.context_param is not None:
            values[self.context_param] = context
        return values


class Toolset(ABC):
    """Tools an agent learns of when a run starts (an MCP server's:
    ``oncely.mcp_tools``). ``oncely.Agent(tools=[...])`` takes toolsets and
    tools mixed. ``tools(ctx)`` answers them in the running scope, its
    listing a checkpoint of the run, so a job in flight keeps the tools it
    saw; ``name`` names that checkpoint; ``approval`` says whether any of
    them may ask a person first (the workflow then has an approvals route)."""

    name: str
    approval: bool = False

    @abstractmethod
    async def tools(self, ctx: Context) -> Sequence[Tool]:
        """This run's tools, listed once per run (a checkpoint)."""


@dataclass(frozen=True)
class ToolScript:
    """What ``oncely.testing.run_step`` answers in place of tools and of
    toolsets' servers (docs/testing.md): ``results`` by tool name (the
    value the tool returns, or an exception it raises), ``listings`` by
    toolset name (what the toolset lists, in its own terms: an MCP toolset
    takes tools as ``tools/list`` answers them)."""

    results: Mapping[str, Any] = field(default_factory=dict)
    listings: Mapping[str, Any] = field(default_factory=dict)


_SCRIPT: ContextVar[ToolScript | None] = ContextVar("oncely_tool_script", default=None)


@contextlib.contextmanager
def scripted(script: ToolScript) -> Iterator[None]:
    """``script`` answers tools and listings within the block (run_step's)."""
    token = _SCRIPT.set(script)
    try:
        yield
    finally:
        _SCRIPT.reset(token)


def scripted_listing(toolset: str) -> Any | None:
    """The listing a test scripted for ``toolset``, or None (list it)."""
    script = _SCRIPT.get()
    return None if script is None else script.listings.get(toolset)


def scripted_answer(tool: str) -> Callable[..., Awaitable[Any]] | None:
    """A function that answers tool ``tool`` as a test scripted it (any
    arguments), or None (run the tool)."""
    script = _SCRIPT.get()
    if script is None or tool not in script.results:
        return None
    given = script.results[tool]

    async def answer(*_args: Any, **_kwargs: Any) -> Any:
        if isinstance(given, BaseException):
            raise given
        if isinstance(given, BaseModel):
            return given.model_dump(mode="json")
        return copy.deepcopy(given)

    return answer


def _not_scripted_call(tool: Tool) -> None:
    script = _SCRIPT.get()
    if script is not None and tool.name in script.results:
        raise AssertionError(
            f"tool {tool.name!r} is a call tool: its receiver answers it; script that"
            f" answer with calls={{{tool.topic!r}: ...}}, not tools="
        )


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    approval: bool | Callable[[Any], bool] = False,
    at_most_once: bool = False,
    reconcile: Callable[[Any, str], Any] | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    approval: bool | Callable[[Any], bool] = False,
    at_most_once: bool = False,
    reconcile: Callable[[Any, str], Any] | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """A function tool: ``@oncely.tool`` or ``@oncely.tool(approval=True)``.
    Its name is the function's (or ``name=``), its description the
    docstring (or ``description=``), its arguments' schema from the type
    hints (pydantic types and models welcome; a default makes an argument
    optional). ``at_most_once=True`` for an effect no receiver dedupes:
    never run twice without ``reconcile(args, key)`` or a person saying so
    (docs/at-most-once.md)."""

    def make(function: Callable[..., Any]) -> Tool:
        tool_name = name or function.__name__
        args, context_param = _arguments(tool_name, function)
        text = description if description is not None else inspect.getdoc(function) or ""
        return Tool(
            tool_name,
            text,
            args,
            fn=function,
            approval=approval,
            context_param=context_param,
            at_most_once=at_most_once,
            reconcile=reconcile,
        )

    return make(fn) if fn is not None else make


def call_tool(
    topic: str,
    *,
    args: type[BaseModel],
    description: str,
    name: str | None = None,
    approval: bool | Callable[[Any], bool] = False,
) -> Tool:
    """A tool that is a call that answers: the model's arguments, validated
    by ``args``, are sent to ``topic``'s receiver (declare it with
    ``webhook(topic, returns=...)``) and its answer is the tool's result.
    The name defaults to the topic with ``.`` as ``_`` (``refund.issue`` →
    ``refund_issue``): model APIs allow only letters, digits, ``_`` and ``-``."""
    if not (isinstance(args, type) and issubclass(args, BaseModel)):
        raise ValueError(f"call_tool({topic!r}): args must be a pydantic model")
    return Tool(name or topic.replace(".", "_"), description, args, topic=topic, approval=approval)


def _arguments(name: str, function: Callable[..., Any]) -> tuple[type[BaseModel], str | None]:
    """The model of ``function``'s parameters, and the one a ToolContext goes to."""
    hints = get_type_hints(function)
    fields: dict[str, Any] = {}
    context_param = None
    for param in inspect.signature(function).parameters.values():
        annotation = hints.get(param.name, Any)
        if annotation is ToolContext:
            context_param = param.name
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"tool {name!r}: *args and **kwargs cannot be described to a model")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, default)
    model = create_model(f"{_camel(name)}Args", __base__=ToolArgs, **fields)
    return model, context_param


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[_-]", name))


@functools.cache
def _schema(args: type[BaseModel]) -> dict[str, Any]:
    """A model's JSON schema, worked out once per class."""
    return args.model_json_schema()
