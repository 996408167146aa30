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
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints, overload

from pydantic import BaseModel, ConfigDict, create_model

from oncely.llm.base import ToolSpec

# A tool's name: what model APIs allow, and a checkpoint name too.
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


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

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"tool name {self.name!r}: 1-63 of a-z, 0-9, _ and -, starting with a letter"
            )
        if (self.fn is None) == (self.topic is None):
            raise ValueError(f"tool {self.name!r}: a function or a call topic, not both")

    def needs_approval(self, args: BaseModel) -> bool:
        """Whether this call waits for a person first."""
        return self.approval(args) if callable(self.approval) else bool(self.approval)

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
        if self.context_param is not None:
            values[self.context_param] = context
        return values


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    approval: bool | Callable[[Any], bool] = False,
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    approval: bool | Callable[[Any], bool] = False,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """A function tool: ``@oncely.tool`` or ``@oncely.tool(approval=True)``.
    Its name is the function's (or ``name=``), its description the
    docstring (or ``description=``), its arguments' schema from the type
    hints (pydantic types and models welcome; a default makes an argument
    optional)."""

    def make(function: Callable[..., Any]) -> Tool:
        tool_name = name or function.__name__
        args, context_param = _arguments(tool_name, function)
        text = description if description is not None else inspect.getdoc(function) or ""
        return Tool(
            tool_name, text, args, fn=function, approval=approval, context_param=context_param
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
