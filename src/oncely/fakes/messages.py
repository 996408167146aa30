"""The fake model's Anthropic side: ``POST /v1/messages`` in the Messages
API's wire format (docs/fakes.md). Pure functions on JSON documents: the
fake (``oncely.fakes.llm``) reads a request through ``read_request``, works
out its answer as for chat completions, and sends it through ``message``
(or, streamed, ``events``); its errors through ``error_body``.

What differs from chat completions, as Anthropic sends it: ``system`` apart
from the messages; tool calls as ``tool_use`` blocks (input an object),
tool results as ``tool_result`` blocks of a user message; ``stop_reason``
``end_turn``, ``tool_use``, ``max_tokens``, ``refusal``, ``pause_turn``;
usage as ``input_tokens`` (without the cache's), ``output_tokens``,
``cache_creation_input_tokens`` and ``cache_read_input_tokens``; errors
as ``{"type": "error", "error": {"type", "message"}}``; a stream as named
server-sent events from ``message_start`` to ``message_stop``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The error ``type`` Anthropic sends with each status the fake answers.
_ERROR_TYPES = {
    400: "invalid_request_error",
    402: "billing_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
    529: "overloaded_error",
}
_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
# A stream's pieces of text: a word and the space after it.
_PIECE = re.compile(r"\S+\s*|\s+")


@dataclass(frozen=True)
class Read:
    """What the fake needs of a Messages API request: the conversation as
    (role, text) pairs (a user message of tool results only is a ``tool``
    one), the tool calls answered, the schema asked for, and the text of an
    assistant message the request ends with (a paused turn continued)."""

    model: str
    roles: list[tuple[str, str]]
    answered: frozenset[str]
    tool_results: int
    schema: Mapping[str, Any] | None
    tools: bool
    stream: bool
    continued: str


def read_request(body: Any) -> Read:
    """A request's body as the fake reads it; KeyError, TypeError or
    ValueError for one no Messages API would take."""
    roles: list[tuple[str, str]] = []
    system = body.get("system")
    if system:
        roles.append(("system", _text(system)))
    answered: set[str] = set()
    results = 0
    for message in body["messages"]:
        role, content = message["role"], message["content"]
        if role not in ("user", "assistant"):
            raise ValueError("a message's role must be user or assistant")
        blocks = content if isinstance(content, list) else []
        ids = [str(b.get("tool_use_id")) for b in blocks if b.get("type") == "tool_result"]
        answered.update(ids)
        results += len(ids)
        text = _text(content)
        roles.append(("tool" if ids and not text else role, text))
    last = body["messages"][-1]
    continued = _text(last["content"]) if last["role"] == "assistant" else ""
    output = body.get("output_config")
    schema = None
    if isinstance(output, dict) and isinstance(output.get("format"), dict):
        found = output["format"].get("schema")
        if not isinstance(found, dict):
            raise TypeError("output_config.format.schema must be an object")
        schema = found
    return Read(
        str(body.get("model", "oncely-fake")),
        roles,
        frozenset(answered),
        results,
        schema,
        bool(body.get("tools")),
        body.get("stream") is True,
        continued,
    )


def _text(content: object) -> str:
    """A message's text: a string, or its text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text"
        )
    raise TypeError("content must be a string or a list of blocks")


def message(
    answer: Mapping[str, Any], *, cache_write: int = 0, cache_read: int = 0, pause: bool = False
) -> dict[str, Any]:
    """A chat completion the fake worked out, as the Messages API's message:
    its text and tool calls as blocks, its refusal as ``stop_reason:
    "refusal"``, ``pause``: the first half of its text and ``pause_turn``.
    Of its prompt tokens, ``cache_write`` were written to the cache and
    ``cache_read`` read from it (``input_tokens`` counts the rest)."""
    choice = answer["choices"][0]
    said = choice["message"]
    content: list[dict[str, Any]] = []
    text = said.get("content") or ""
    stop = _STOP_REASONS.get(choice["finish_reason"], "end_turn")
    if pause:
        words = _PIECE.findall(text)
        text, stop = "".join(words[: max(1, len(words) // 2)]), "pause_turn"
    if text:
        content.append({"type": "text", "text": text})
    for call in said.get("tool_calls") or ():
        arguments = call["function"]["arguments"]
        try:
            given: Any = json.loads(arguments)
        except ValueError:
            given = arguments  # [[fake:badargs]]: kept as text
        block = {"type": "tool_use", "id": call.get("id") or "", "name": call["function"]["name"]}
        content.append({**block, "input": given})
    if said.get("refusal"):
        content, stop = [], "refusal"
    usage = answer["usage"]
    return {
        "id": str(answer["id"]).replace("chatcmpl", "msg"),
        "type": "message",
        "role": "assistant",
        "model": answer["model"],
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {
            "input_tokens": max(0, usage["prompt_tokens"] - cache_write - cache_read),
            "cache_creation_input_tokens": cache_write,
            "cache_read_input_tokens": cache_read,
            "output_tokens": usage["completion_tokens"],
        },
    }


def events(whole: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A message as the API streams it: ``message_start`` (the input usage),
    a ``ping``, each block (text a word a delta, a tool's input in two JSON
    pieces), ``message_delta`` (the stop reason, the output tokens),
    ``message_stop``."""
    usage = dict(whole["usage"])
    output_tokens = usage.pop("output_tokens")
    start = {**whole, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    found: list[dict[str, Any]] = [{"type": "message_start", "message": start}, {"type": "ping"}]
    for index, block in enumerate(whole["content"]):
        found += _block_events(index, block)
    found.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": output_tokens},
        }
    )
    found.append({"type": "message_stop"})
    return found


def _block_events(index: int, block: Mapping[str, Any]) -> list[dict[str, Any]]:
    def delta(piece: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": index, "delta": piece}

    opening: dict[str, Any]
    if block["type"] == "text":
        opening = {"type": "text", "text": ""}
        pieces = [delta({"type": "text_delta", "text": p}) for p in _PIECE.findall(block["text"])]
    else:
        opening = {**block, "input": {}}
        given = block["input"]
        text = given if isinstance(given, str) else json.dumps(given)
        half = len(text) // 2
        pieces = [
            delta({"type": "input_json_delta", "partial_json": part})
            for part in (text[:half], text[half:])
        ]
    start = {"type": "content_block_start", "index": index, "content_block": opening}
    return [start, *pieces, {"type": "content_block_stop", "index": index}]


def sse(event: Mapping[str, Any]) -> bytes:
    """One event as the API writes it: its name, then its data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error as the API sends it, its ``type`` the status's."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
