"""The chat-completions wire format both model clients share, and what its
answers mean to oncely: the request's ``response_format``, a status turned
into ``TransientError`` or ``PermanentError``, and a 200's answer turned into
a ``Completion``. Imports no SDK, so the lean client (``oncely.llm.lean``)
loads none.

Messages are short and never carry the prompt: a provider's error code is
cut to a few dozen characters, its message is never read.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from typing import Any

from oncely.errors import OncelyError, PermanentError, ProviderQuota, Refused, TransientError
from oncely.llm.base import Completion, Message, ResponseSchema, ToolChoice, ToolRequest, ToolSpec
from oncely.retry import retry_after_from_headers, retryable_status

# Enough of a provider's error code to tell errors apart, never a whole message.
# An error code or type a provider sent, as oncely repeats it in an
# error's message, a log line or a batch line's row (``plain_code``).
_ERROR_CODE = re.compile(r"[A-Za-z0-9_.:-]{1,60}")
# OpenAI's codes for an account with no credit left or at its hard limit
# (a 429 that no wait will cure: docs/providers.md, Dry accounts).
# OpenAI's codes, and Anthropic's error type (which a batch line's error keeps).
_DRY_CODES = frozenset({"insufficient_quota", "billing_hard_limit_reached", "billing_error"})


def response_format(schema: ResponseSchema) -> dict[str, Any]:
    """Structured output: ``{"type": "json_schema", ...}``."""
    return {
        "type": "json_schema",
        "json_schema": {"name": schema.name, "schema": dict(schema.schema)},
    }


def messages_param(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as chat completions take it: an assistant message's
    tool calls as ``tool_calls`` (its content null when it has none), a tool
    result with its ``tool_call_id``."""
    return [_message(m) for m in messages]


def _message(message: Message) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    if not message.tool_calls:
        return {"role": message.role, "content": message.content}
    return {
        "role": "assistant",
        "content": message.content or None,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ],
    }


def tools_param(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """``tools``: each a function with its name, description and parameters."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": dict(t.parameters),
            },
        }
        for t in tools
    ]


def tool_choice_param(choice: ToolChoice) -> str | dict[str, Any]:
    """``auto``, ``none`` and ``required`` as they are; a tool's name as the
    choice of that function."""
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def request_body(
    model: str,
    messages: Sequence[Message],
    schema: ResponseSchema | None,
    tools: Sequence[ToolSpec],
    tool_choice: ToolChoice | None,
    service_tier: str | None = None,
) -> dict[str, Any]:
    """A chat completion request's body, as both clients send it
    (``service_tier``: ``flex`` for a flex-lane call, docs/lanes.md)."""
    body: dict[str, Any] = {"model": model, "messages": messages_param(messages)}
    if schema is not None:
        body["response_format"] = response_format(schema)
    if tools:
        body["tools"] = tools_param(tools)
        if tool_choice is not None:
            body["tool_choice"] = tool_choice_param(tool_choice)
    if service_tier is not None:
        body["service_tier"] = service_tier
    return body


def status_error(status: int, code: object, headers: Mapping[str, str]) -> OncelyError:
    """408, 409, 429 and 5xx: a ``TransientError`` with the status and the
    wait from ``retry-after-ms`` / ``Retry-After``; any other status a
    ``PermanentError``; a code saying the account cannot pay
    (``insufficient_quota``, Anthropic's ``billing_error``), whatever its
    status, ``ProviderQuota``.
    ``code``: the body's ``error.code``, when a string."""
    message = f"model answered {status}"
    code = plain_code(code)
    if code:
        message += f" ({code})"
    if code in _DRY_CODES:
        return ProviderQuota(
            f"{message}: the provider account's credit or spend limit is exhausted", status=status
        )
    if retryable_status(status):
        return TransientError(
            message, status=status, retry_after_s=retry_after_from_headers(headers)
        )
    return PermanentError(message, status=status)


def no_content(why: str) -> PermanentError:
    """A 200 without an answer: a retry will not change it."""
    return PermanentError(f"model returned no content ({why})")


async def post_json(
    client: Any,
    path: str,
    body: Mapping[str, Any] | None,
    timeout: float,  # noqa: ASYNC109 (a socket read's: the call's wall clock is the caller's)
    *,
    method: str = "post",
) -> dict[str, Any]:
    """One request (``method``: ``post``, or ``get`` without a body) through
    a provider's SDK client (the openai and anthropic SDKs ask alike), its
    answer read as plain JSON: a typed object per answer would cost CPU for
    nothing. A 200 that is no JSON object is no content."""
    options = {"timeout": timeout}
    try:
        if method == "get":
            data = await client.get(path, cast_to=object, options=options)
        else:
            data = await client.post(path, cast_to=object, body=body, options=options)
    except json.JSONDecodeError as exc:  # a 200 that says it is JSON and is not
        raise no_content("not JSON") from exc
    if not isinstance(data, dict):  # another content type: the SDK's text
        raise no_content("not JSON")
    return data


def read_answer(data: object) -> Completion:
    """A 200's JSON document: the first choice's content and the usage.
    Anything else than an answer is ``no_content`` (with the finish reason,
    "refused", or what was missing)."""
    if not isinstance(data, dict):
        raise no_content("not a completion")
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        raise no_content("no choices")
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    content = message.get("content")
    calls = tool_requests(message.get("tool_calls"))
    if not calls and (not isinstance(content, str) or not content):
        if message.get("refusal"):
            raise Refused("model returned no content (refused)", tokens=_tokens(data))
        raise no_content(str(choice.get("finish_reason")))
    usage = data.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return Completion(
        content if isinstance(content, str) else "",
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        tool_calls=calls,
        cached_tokens=_count(_detail(usage, "prompt_tokens_details", "cached_tokens")),
        reasoning_tokens=_count(_detail(usage, "completion_tokens_details", "reasoning_tokens")),
    )


def _tokens(data: Mapping[str, Any]) -> tuple[int, int]:
    usage = data.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def tool_requests(calls: object) -> tuple[ToolRequest, ...]:
    """An answer's ``tool_calls`` (function calls; any other kind is left
    out). Arguments stay the text the provider sent: whether it is JSON is
    the caller's to judge, never a reason to lose the answer."""
    if not isinstance(calls, list):
        return ()
    found = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        found.append(ToolRequest(str(call.get("id") or ""), function["name"], arguments))
    return tuple(found)


def _detail(usage: Mapping[str, Any], details: str, name: str) -> object:
    found = usage.get(details)
    return found.get(name) if isinstance(found, dict) else None


def error_code(data: object) -> object:
    """``error.code`` of an error answer's JSON document, if it has one."""
    error = data.get("error") if isinstance(data, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def stream_body(body: dict[str, Any]) -> dict[str, Any]:
    """A request body asking for the answer as server-sent chunks, the usage
    in the last one."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


async def stream_chunks(received: AsyncIterable[bytes]) -> AsyncIterator[Any]:
    """A streamed answer's chunks (each ``data:`` line's JSON document), as
    its bytes arrive in whatever pieces the transport gives, until ``data:
    [DONE]`` or the end; lines that are not data, or not JSON, are skipped."""
    rest = b""
    async for data in received:
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            try:
                yield json.loads(payload)
            except ValueError:
                continue


class StreamedAnswer:
    """A streamed answer's chunks (each its JSON document), gathered into the
    ``Completion`` the whole answer would have been: the text, the tool calls
    (their pieces joined by index), the usage of the last chunk."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._usage: dict[str, Any] = {}
        self._finish: str | None = None
        self._refused = False

    def add(self, chunk: object) -> str:
        """Take one chunk; the text it adds (empty if none). An ``error``
        chunk (a provider failing mid-answer) is a ``TransientError``."""
        if not isinstance(chunk, dict):
            raise no_content("not a completion chunk")
        if isinstance(chunk.get("error"), dict):
            raise status_error(503, error_code(chunk), {})
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, dict):
            return ""
        if isinstance(choice.get("finish_reason"), str):
            self._finish = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return ""
        self._refused = self._refused or bool(delta.get("refusal"))
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict):
                self._add_call(call)
        text = delta.get("content")
        if not isinstance(text, str) or not text:
            return ""
        self._text.append(text)
        return text

    def _add_call(self, piece: dict[str, Any]) -> None:
        index = piece.get("index")
        call = self._calls.setdefault(
            index if isinstance(index, int) else len(self._calls),
            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if isinstance(piece.get("id"), str):
            call["id"] = piece["id"]
        function = piece.get("function")
        if isinstance(function, dict):
            for part in ("name", "arguments"):
                if isinstance(function.get(part), str):
                    call["function"][part] += function[part]

    def completion(self) -> Completion:
        """The answer, once the stream ended. One that ended before its
        finish reason was cut off: a ``TransientError``, as a dropped
        connection is."""
        if self._finish is None:
            raise TransientError("model stream cut off before the answer's end")
        message: dict[str, Any] = {
            "content": "".join(self._text),
            "tool_calls": [self._calls[i] for i in sorted(self._calls)],
            "refusal": self._refused,
        }
        choice = {"message": message, "finish_reason": self._finish}
        return read_answer({"choices": [choice], "usage": self._usage})


# What a provider's id (a response, a batch, a file) may look like before
# oncely keeps it or puts it in a URL path.
_PROVIDER_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")


def plain_code(found: object) -> str | None:
    """An error's code or type as a provider sent it, when it is a plain
    token of at most 60 characters; else None (a newline, a sentence, a
    control character never reach a message or a log line)."""
    if isinstance(found, str) and _ERROR_CODE.fullmatch(found) is not None:
        return found
    return None


def provider_id(found: object) -> str:
    """An id a provider sent, checked whole (no newline, no slash, no dot)
    before it is stored or put in a path."""
    if not isinstance(found, str) or _PROVIDER_ID.fullmatch(found) is None:
        raise PermanentError("the provider sent an id that is not a plain token")
    return found
