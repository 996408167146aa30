"""The fake model's Responses API side: ``POST /v1/responses`` (and the
background responses' ``GET /v1/responses/{id}`` and ``POST
/v1/responses/{id}/cancel``) in OpenAI's wire format (docs/fakes.md). Pure
functions on JSON documents: the fake (``oncely.fakes.llm``) reads a
request through ``read_request``, works out its answer as for chat
completions, and sends it through ``response`` (or, streamed, ``events``);
a background response's states through ``pending``, ``failed`` and
``cancelled``. Errors are chat completions' (OpenAI's ``error.code``).

What differs from chat completions, as OpenAI sends it: the conversation as
``input`` items (messages of a role; ``function_call`` and
``function_call_output`` items), ``instructions`` as a system message, the
schema in ``text.format``; the answer as ``output`` items (a ``message``
with ``output_text`` or ``refusal`` parts, ``function_call`` items with
their ``call_id``); usage as ``input_tokens`` (``cached_tokens`` in its
details) and ``output_tokens`` (``reasoning_tokens`` in its details); a
stream as named server-sent events, each with its ``sequence_number``, from
``response.created`` to ``response.completed``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# A stream's pieces of text: a word and the space after it.
_PIECE = re.compile(r"\S+\s*|\s+")
# The reasoning tokens the fake reports for each reasoning effort asked for.
REASONING_TOKENS = {"minimal": 0, "low": 8, "medium": 16, "high": 32}


@dataclass(frozen=True)
class Read:
    """What the fake needs of a Responses API request (as
    ``oncely.fakes.messages.Read``): the conversation as (role, text) pairs,
    the tool calls answered, the schema asked for, the reasoning effort, and
    whether it asks for background mode or a stream."""

    model: str
    roles: list[tuple[str, str]]
    answered: frozenset[str]
    tool_results: int
    schema: Mapping[str, Any] | None
    tools: bool
    stream: bool
    background: bool
    reasoning: str


def read_request(body: Any) -> Read:
    """A request's body as the fake reads it; KeyError, TypeError or
    ValueError for one the API would not take."""
    roles: list[tuple[str, str]] = []
    if body.get("instructions"):
        roles.append(("system", _text(body["instructions"])))
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    answered: set[str] = set()
    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call_output":
            answered.add(str(item["call_id"]))
            roles.append(("tool", _text(item.get("output"))))
        elif kind == "function_call":
            roles.append(("assistant", ""))
        elif kind == "message":
            role = item["role"]
            if role not in ("system", "developer", "user", "assistant"):
                raise ValueError("a message's role must be system, developer, user or assistant")
            roles.append(("system" if role == "developer" else role, _text(item["content"])))
        else:
            raise ValueError(f"unknown input item type {kind!r}")
    schema = _schema(body.get("text"))
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return Read(
        str(body.get("model", "oncely-fake")),
        roles,
        frozenset(answered),
        len(answered),
        schema,
        bool(body.get("tools")),
        body.get("stream") is True,
        body.get("background") is True,
        effort if isinstance(effort, str) else "",
    )


def _schema(text: object) -> Mapping[str, Any] | None:
    """The schema ``text.format`` asks for (``json_schema``), else None."""
    found = text.get("format") if isinstance(text, dict) else None
    if not isinstance(found, dict) or found.get("type") != "json_schema":
        return None
    schema = found["schema"]
    if not isinstance(schema, dict):
        raise TypeError("text.format.schema must be an object")
    return schema


def _text(content: object) -> str:
    """An item's text: a string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    raise TypeError("content must be a string or a list of parts")


def _head(response_id: str, model: str, status: str) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }


def pending(response_id: str, model: str, status: str = "queued") -> dict[str, Any]:
    """A response not done yet: ``queued`` or ``in_progress``."""
    return _head(response_id, model, status)


def failed(response_id: str, model: str, code: str, message: str) -> dict[str, Any]:
    """A response that failed with ``code`` (``server_error``, say)."""
    return {**_head(response_id, model, "failed"), "error": {"code": code, "message": message}}


def cancelled(response_id: str, model: str) -> dict[str, Any]:
    """A response cancelled before it was done."""
    return _head(response_id, model, "cancelled")


def response(
    answer: Mapping[str, Any], response_id: str, *, cached: int = 0, reasoning: int = 0
) -> dict[str, Any]:
    """A chat completion the fake worked out, as a completed response: its
    text (or refusal) as a message item, its tool calls as
    ``function_call`` items; of its prompt tokens ``cached`` were read from
    the cache, and ``reasoning`` tokens more were spent thinking."""
    said = answer["choices"][0]["message"]
    output: list[dict[str, Any]] = []
    message: dict[str, Any] = {
        "type": "message",
        "id": f"msg_{response_id}",
        "role": "assistant",
        "status": "completed",
    }
    if said.get("refusal"):
        output.append({**message, "content": [{"type": "refusal", "refusal": said["refusal"]}]})
    elif said.get("content"):
        part = {"type": "output_text", "text": said["content"], "annotations": []}
        output.append({**message, "content": [part]})
    for number, call in enumerate(said.get("tool_calls") or (), start=1):
        function = call["function"]
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{number}",
                "call_id": call.get("id") or "",
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    usage = answer["usage"]
    completion_tokens = usage["completion_tokens"] + reasoning
    return {
        **_head(response_id, answer["model"], "completed"),
        "output": output,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["prompt_tokens"] + completion_tokens,
        },
    }


def events(whole: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A response as the API streams it: ``response.created``, each output
    item (a message's text a word a delta, a function call's arguments in
    two pieces), ``response.completed`` with the whole response; each event
    numbered (``sequence_number``)."""
    started = pending(whole["id"], whole["model"], "in_progress")
    found: list[dict[str, Any]] = [{"type": "response.created", "response": started}]
    for index, item in enumerate(whole["output"]):
        found += _item_events(index, item)
    found.append({"type": "response.completed", "response": dict(whole)})
    return [{**event, "sequence_number": number} for number, event in enumerate(found)]


def _item_events(index: int, item: Mapping[str, Any]) -> list[dict[str, Any]]:
    opening = {"type": "response.output_item.added", "output_index": index}
    done = {"type": "response.output_item.done", "output_index": index, "item": dict(item)}
    if item["type"] == "function_call":
        arguments = item["arguments"]
        half = len(arguments) // 2
        pieces = [
            {
                "type": "response.function_call_arguments.delta",
                "output_index": index,
                "item_id": item["id"],
                "delta": part,
            }
            for part in (arguments[:half], arguments[half:])
        ]
        return [{**opening, "item": {**item, "arguments": ""}}, *pieces, done]
    deltas: list[dict[str, Any]] = []
    for part in item["content"]:
        if part["type"] == "output_text":
            deltas += [
                {
                    "type": "response.output_text.delta",
                    "output_index": index,
                    "item_id": item["id"],
                    "content_index": 0,
                    "delta": piece,
                }
                for piece in _PIECE.findall(part["text"])
            ]
        else:
            deltas.append(
                {
                    "type": "response.refusal.delta",
                    "output_index": index,
                    "item_id": item["id"],
                    "content_index": 0,
                    "delta": part["refusal"],
                }
            )
    return [{**opening, "item": {**item, "content": []}}, *deltas, done]


def sse(event: Mapping[str, Any]) -> bytes:
    """One event as the API writes it: its name, then its data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
