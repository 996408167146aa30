"""What a step gets back from the model, with no driver behind it: the
usage a delivery spent (``Usage``), one model turn (``Reply``) and the tool
calls it asked for (``ToolCall``), and the conversion of OpenAI-style
message dicts into the model seam's messages (``conversation``).

Nothing here imports the ledger, the cooldown, Redis or PostgreSQL: code
that only reads a turn (``oncely.agent``, the framework integrations) loads
none of them. ``oncely.llm.model`` re-exports every name.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from oncely.llm.base import Message, ResponseSchema, ToolRequest, ToolSpec

# How much of a tool call's arguments that are not JSON the model is shown.
_MALFORMED_CHARS = 200


@dataclass
class Usage:
    """What one delivery spent on the model: attempts made, tokens reported,
    the wall-clock time spent in model calls (``model_ms``, what shadow
    reports compare), the cost (``cost_usd``, None once a call's model has
    no price) and the model that answered last. Equality compares the
    counts that do not vary between two runs of the same work: not the
    time, the cost or the model."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_calls: int = 0
    model_ms: int = field(default=0, compare=False)
    # Of the prompt tokens, those the provider served from its cache (and
    # those it wrote to it, Anthropic's); of the completion tokens, those
    # spent reasoning (reported by some only).
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float | None = field(default=0.0, compare=False)
    model: str | None = field(default=None, compare=False)
    cache_write_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "model_calls": self.model_calls,
            "model_ms": self.model_ms,
            "cost_usd": None if self.cost_usd is None else round(self.cost_usd, 10),
            "model": self.model,
        }
        if self.cached_tokens:
            found["cached_tokens"] = self.cached_tokens
        if self.cache_write_tokens:
            found["cache_write_tokens"] = self.cache_write_tokens
        if self.reasoning_tokens:
            found["reasoning_tokens"] = self.reasoning_tokens
        return found

    def add_cost(self, cost: float | None) -> None:
        self.cost_usd = None if self.cost_usd is None or cost is None else self.cost_usd + cost


@dataclass(frozen=True)
class ToolCall:
    """A tool the model asked to call: ``arguments`` as a dict, or, when the
    provider sent something that is not a JSON object, None with what it
    sent in ``malformed`` (cut short): the caller answers the model with an
    error instead of failing. ``raw_arguments`` is the text as sent."""

    id: str
    name: str
    arguments: dict[str, Any] | None
    raw_arguments: str = ""
    malformed: str | None = None

    @classmethod
    def of(cls, request: ToolRequest) -> ToolCall:
        try:
            parsed = json.loads(request.arguments or "{}")
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            shown = request.arguments[:_MALFORMED_CHARS]
            return cls(request.id, request.name, None, request.arguments, shown or "(nothing)")
        return cls(request.id, request.name, parsed, request.arguments)


@dataclass(frozen=True)
class Reply:
    """One model turn (``ctx.model.respond``): its ``text``, the
    ``tool_calls`` it asked for, and ``usage`` (what the turn spent, its
    retries and fallbacks included)."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    usage: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """What the turn's checkpoint stores."""
        return {
            "text": self.text,
            "tool_calls": [
                {"id": c.id, "name": c.name, "arguments": c.raw_arguments} for c in self.tool_calls
            ],
            "usage": self.usage,
        }

    @classmethod
    def from_json(cls, value: Any) -> Reply:
        """A stored turn, read as the turn that was answered."""
        requests = [ToolRequest(c["id"], c["name"], c["arguments"]) for c in value["tool_calls"]]
        calls = tuple(ToolCall.of(r) for r in requests)
        return cls(value["text"], calls, dict(value.get("usage") or {}))


def conversation(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """OpenAI-style message dicts as the model seam's messages; ValueError
    for a message that is none of system, user, assistant, tool."""
    found = []
    for message in messages:
        role = message.get("role")
        content = message.get("content") or ""
        if not isinstance(content, str):
            content = json.dumps(content)
        if role == "tool":
            found.append(Message("tool", content, tool_call_id=str(message.get("tool_call_id"))))
        elif role == "assistant":
            calls = tuple(_tool_request(c) for c in message.get("tool_calls") or ())
            found.append(Message("assistant", content, tool_calls=calls))
        elif role in ("system", "user"):
            found.append(Message(role, content))
        else:
            raise ValueError(f"a message's role must be system, user, assistant or tool: {role!r}")
    return found


def _tool_request(call: Mapping[str, Any]) -> ToolRequest:
    function = call.get("function") or {}
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return ToolRequest(str(call.get("id") or ""), str(function.get("name")), arguments)


def tool_spec(spec: ToolSpec | Mapping[str, Any]) -> ToolSpec:
    """A tool as a ``ToolSpec``, given as one or as ``{"name", "description",
    "parameters"}``."""
    if isinstance(spec, ToolSpec):
        return spec
    return ToolSpec(str(spec["name"]), str(spec.get("description", "")), spec["parameters"])


@functools.cache
def response_schema(result: type[BaseModel]) -> ResponseSchema:
    """The structured-output request for ``result``, worked out once per class."""
    return ResponseSchema(name=result.__name__, schema=result.model_json_schema())
