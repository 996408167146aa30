"""The ``anthropic:`` dialect: Claude through Anthropic's Messages API and
the official ``anthropic`` SDK (the ``oncely[anthropic]`` extra;
docs/providers.md).

The SDK runs on its aiohttp transport with its own retries off
(``max_retries=0``): ``oncely.retry`` owns the policy. The base URL is
written as OpenAI's, ending in ``/v1`` (``https://api.anthropic.com/v1``,
the fake model's ``http://127.0.0.1:8101/v1``): the call posts to
``<base>/messages``.

What a call sends, from the model seam's messages:

- system messages go in ``system`` (joined by a blank line);
- an assistant message's tool calls are ``tool_use`` blocks (arguments that
  are not a JSON object go as ``{}``: the tool's error result says why);
- tool results are ``tool_result`` blocks of the next user message (the
  results of one turn's parallel calls in one message, as the API asks);
- tools go as ``{"name", "description", "input_schema"}``; ``tool_choice``
  ``auto``, ``none``, ``required`` (the API's ``any``) or a tool's name;
- structured output is Anthropic's own (``output_config.format``, a JSON
  schema), not a forced tool: it leaves ``tool_choice`` to the tools of a
  turn that has both, and the answer stays text. The schema goes through
  the SDK's ``transform_schema`` (the subset the API takes: constraints it
  does not enforce move into descriptions); oncely validates the answer
  against the full schema as for every dialect, and asks again if it fails;
- ``max_tokens`` (which the API requires) is ``ONCELY_LLM_MAX_TOKENS``.

What comes back:

- the text blocks' text, the ``tool_use`` blocks as tool calls (their input
  as JSON text); thinking blocks are not part of the answer;
- usage: ``prompt_tokens`` is every input token, the cache's reads
  (``cached_tokens``) and writes (``cache_write_tokens``) included, as chat
  completions count them (Anthropic's ``input_tokens`` leaves both out);
- ``stop_reason: "refusal"`` is ``oncely.Refused`` (permanent, with the
  tokens billed); ``pause_turn`` (a server tool's long turn) is continued:
  the paused content goes back as the assistant's and the model asked again,
  up to ``_CONTINUATIONS`` times, the pieces' text and usage joined;
- a 200 with neither text nor tool calls is a ``PermanentError``.

Errors translate here and nowhere else (no SDK error type leaves this
module):

- a status whose body says the account's credit is spent or a spend limit
  is reached (``billing_error``, a spend-limit ``error_code``, a 402, or a
  400/403/429 saying so) is ``ProviderQuota``: permanent for the route, no
  retry and no cooldown (docs/providers.md, Dry accounts);
- 529 and ``overloaded_error`` are transient, as are 408, 409, 429 and 5xx,
  with the wait of ``retry-after-ms`` / ``Retry-After``; any other status
  is a ``PermanentError``;
- the SDK's read timeout is a plain ``TimeoutError``; a connection that
  failed a ``TransientError``; any other SDK error a ``PermanentError``.

With ``on_text`` the answer comes streamed (``stream: true``): each text
delta goes to ``on_text`` as it arrives and the events are gathered into the
same message; an ``error`` event or a stream that ends before
``message_stop`` is a ``TransientError``. Messages are short and never carry
the prompt; the SDK error stays the cause.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import aiohttp
import anthropic
import httpx2

from oncely.errors import OncelyError, PermanentError, ProviderQuota, Refused, TransientError
from oncely.llm import wire
from oncely.llm.base import (
    ClosedOnExit,
    Completion,
    Message,
    ResponseSchema,
    ToolChoice,
    ToolRequest,
    ToolSpec,
)

_TRANSPORT_ERRORS: tuple[type[Exception], ...] = (httpx2.TransportError, aiohttp.ClientError)
_SDK_ERRORS: tuple[type[Exception], ...] = (anthropic.AnthropicError, *_TRANSPORT_ERRORS)
# The Messages API, below the SDK's base URL (the host, without /v1).
_PATH = "/v1/messages"
# What ``max_tokens`` is when nobody says (ONCELY_LLM_MAX_TOKENS).
DEFAULT_MAX_TOKENS = 4096
# How many times one call continues a paused turn before it gives up.
_CONTINUATIONS = 8
# Anthropic's error codes for an account whose spend limit is reached.
_SPEND_CODES = frozenset(
    {
        "contract_spend_limit_reached",
        "enforced_spend_limit_reached",
        "linked_organization_spend_limit_reached",
        "linked_organization_billing_unavailable",
    }
)
# What a 400, 403 or 429 says when the account cannot pay (the API's older
# errors carry nothing else): matched, never logged.
_DRY_WORDS = ("credit balance", "spend limit", "usage limit")
# An error that comes without its status (an event mid-stream, a batch's
# errored line), as the status it stands for.
_ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


class AnthropicMessages(ClosedOnExit):
    """The ``LLM`` protocol over Anthropic's Messages API (module doc)."""

    dialect = "anthropic"
    # It takes Anthropic's Message Batches (docs/lanes.md), no flex tier.
    lanes = ("standard", "batch")

    def __init__(
        self, client: anthropic.AsyncAnthropic, model: str, *, max_tokens: int = DEFAULT_MAX_TOKENS
    ) -> None:
        self._client = client
        self.model = model
        self.max_tokens = max_tokens

    @classmethod
    def connect(
        cls, base_url: str, api_key: str, model: str, *, max_tokens: int = DEFAULT_MAX_TOKENS
    ) -> AnthropicMessages:
        """Build the client; no connection opens until the first call."""
        client = anthropic.AsyncAnthropic(
            base_url=sdk_base_url(base_url),
            api_key=api_key,
            max_retries=0,
            http_client=anthropic.DefaultAioHttpClient(),
        )
        return cls(client, model, max_tokens=max_tokens)

    def with_model(self, model: str) -> AnthropicMessages:
        """The same endpoint and connections, asking for another model."""
        if model == self.model:
            return self
        return AnthropicMessages(self._client, model, max_tokens=self.max_tokens)

    async def complete(
        self,
        messages: Sequence[Message],
        timeout: float,  # noqa: ASYNC109 (LLM protocol)
        *,
        schema: ResponseSchema | None = None,
        tools: Sequence[ToolSpec] = (),
        tool_choice: ToolChoice | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Completion:
        # The SDK's timeout bounds each socket read; the call's wall clock is
        # the caller's (``call_with_retries`` runs every attempt under one).
        body = request_body(self.model, self.max_tokens, messages, schema, tools, tool_choice)
        turn = _Turn()
        for _ in range(_CONTINUATIONS + 1):
            try:
                if on_text is not None:
                    message = await self._streamed(body, timeout, on_text)
                else:
                    message = await wire.post_json(self._client, _PATH, body, timeout)
            except _SDK_ERRORS as exc:
                raise translate_error(exc) from exc
            if turn.add(message) != "pause_turn":
                return turn.completion()
            # A server tool's long turn: its content goes back as the
            # assistant's, and the model carries on from there.
            paused = {"role": "assistant", "content": message.get("content") or []}
            body = {**body, "messages": [*body["messages"], paused]}
        raise PermanentError(f"model paused its turn more than {_CONTINUATIONS} times")

    async def _streamed(
        self,
        body: dict[str, Any],
        timeout: float,  # noqa: ASYNC109 (a socket read's, as above)
        on_text: Callable[[str], None],
    ) -> dict[str, Any]:
        """The answer as server-sent events, each text delta to ``on_text``,
        gathered into the message the whole answer would have been."""
        stream = StreamedMessage()
        raw = self._client.messages.with_streaming_response.create(
            **cast("Any", {**body, "stream": True}), timeout=timeout
        )
        async with raw as response:
            async for event in wire.stream_chunks(response.iter_bytes()):
                if text := stream.add(event):
                    on_text(text)
        return stream.message()

    async def aclose(self) -> None:
        await self._client.close()


def sdk_base_url(base_url: str) -> str:
    """The SDK's base URL (the host: it adds ``/v1/messages``) from one
    written as OpenAI's, ending in ``/v1``; another is taken as the host."""
    stripped = base_url.rstrip("/")
    return stripped.removesuffix("/v1") if stripped.endswith("/v1") else stripped


# --- the request -----------------------------------------------------------------------


def request_body(
    model: str,
    max_tokens: int,
    messages: Sequence[Message],
    schema: ResponseSchema | None,
    tools: Sequence[ToolSpec],
    tool_choice: ToolChoice | None,
) -> dict[str, Any]:
    """A Messages API request's body (module doc)."""
    system = [m.content for m in messages if m.role == "system"]
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "messages": messages_param([m for m in messages if m.role != "system"]),
    }
    if system:
        body["system"] = "\n\n".join(system)
    if schema is not None:
        body["output_config"] = {"format": output_format(schema)}
    if tools:
        body["tools"] = [
            {"name": t.name, "description": t.description, "input_schema": dict(t.parameters)}
            for t in tools
        ]
        if tool_choice is not None:
            body["tool_choice"] = tool_choice_param(tool_choice)
    return body


def output_format(schema: ResponseSchema) -> dict[str, Any]:
    """Structured output: ``{"type": "json_schema", "schema": ...}``, the
    schema in the subset the API takes."""
    return {"type": "json_schema", "schema": anthropic.transform_schema(dict(schema.schema))}


def tool_choice_param(choice: ToolChoice) -> dict[str, Any]:
    """``auto`` and ``none`` as they are, ``required`` as ``any``, a tool's
    name as that tool."""
    if choice in ("auto", "none"):
        return {"type": choice}
    if choice == "required":
        return {"type": "any"}
    return {"type": "tool", "name": choice}


def messages_param(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as the Messages API takes it: roles alternate, so
    consecutive messages of one role (a turn's tool results, a question
    after them) become one message of several blocks."""
    found: list[dict[str, Any]] = []
    for message in messages:
        role = "assistant" if message.role == "assistant" else "user"
        blocks = _blocks(message)
        if found and found[-1]["role"] == role:
            found[-1]["content"] = [*_as_blocks(found[-1]["content"]), *blocks]
        elif len(blocks) == 1 and blocks[0]["type"] == "text":
            found.append({"role": role, "content": blocks[0]["text"]})
        else:
            found.append({"role": role, "content": blocks})
    return found


def _blocks(message: Message) -> list[dict[str, Any]]:
    if message.role == "tool":
        return [
            {
                "type": "tool_result",
                "tool_use_id": message.tool_call_id or "",
                "content": message.content,
            }
        ]
    blocks: list[dict[str, Any]] = []
    if message.content or not message.tool_calls:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call)})
    return blocks


def _as_blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _input(call: ToolRequest) -> dict[str, Any]:
    try:
        parsed = json.loads(call.arguments or "{}")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


# --- the answer ------------------------------------------------------------------------


def read_message(data: object) -> Completion:
    """A whole message (a batch line's answer, docs/lanes.md) as the call's
    answer, as a call reads its own; a refusal raises ``Refused``. A paused
    turn cannot be continued there: its text, if any, is the answer."""
    if not isinstance(data, dict):
        raise wire.no_content("not a message")
    turn = _Turn()
    turn.add(data)
    return turn.completion()


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


@dataclass
class _Turn:
    """A turn's messages (several when it paused), joined into one answer."""

    text: list[str] = field(default_factory=list)
    calls: list[ToolRequest] = field(default_factory=list)
    usage: Completion = field(default_factory=lambda: Completion(""))
    stop_reason: str | None = None

    def add(self, message: Mapping[str, Any]) -> str | None:
        """Take one message; its stop reason. A refusal raises ``Refused``."""
        usage = _usage(message.get("usage"))
        self.usage = Completion(
            "",
            prompt_tokens=self.usage.prompt_tokens + usage.prompt_tokens,
            completion_tokens=self.usage.completion_tokens + usage.completion_tokens,
            cached_tokens=self.usage.cached_tokens + usage.cached_tokens,
            cache_write_tokens=self.usage.cache_write_tokens + usage.cache_write_tokens,
        )
        content = message.get("content")
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text" and isinstance(block.get("text"), str):
                self.text.append(block["text"])
            elif block.get("type") == "tool_use" and isinstance(block.get("name"), str):
                self.calls.append(_tool_request(block))
        stop = message.get("stop_reason")
        self.stop_reason = stop if isinstance(stop, str) else None
        if self.stop_reason == "refusal":
            raise Refused(
                "the model refused to answer (stop_reason refusal)",
                tokens=(self.usage.prompt_tokens, self.usage.completion_tokens),
            )
        return self.stop_reason

    def completion(self) -> Completion:
        text = "".join(self.text)
        if not text and not self.calls:
            raise wire.no_content(str(self.stop_reason))
        return replace(self.usage, text=text, tool_calls=tuple(self.calls))


def _tool_request(block: Mapping[str, Any]) -> ToolRequest:
    """A ``tool_use`` block as a tool call: its input as JSON text (the text
    a stream sent, when it is not JSON: the caller judges it)."""
    raw = block.get("input")
    arguments = raw if isinstance(raw, str) else json.dumps(raw if raw is not None else {})
    return ToolRequest(str(block.get("id") or ""), block["name"], arguments)


def _usage(usage: object) -> Completion:
    """Anthropic's usage as the seam's: every input token in ``prompt_tokens``."""
    if not isinstance(usage, dict):
        return Completion("")
    read = _count(usage.get("cache_read_input_tokens"))
    written = _count(usage.get("cache_creation_input_tokens"))
    return Completion(
        "",
        prompt_tokens=_count(usage.get("input_tokens")) + read + written,
        completion_tokens=_count(usage.get("output_tokens")),
        cached_tokens=read,
        cache_write_tokens=written,
    )


class StreamedMessage:
    """A streamed answer's events, gathered into the message the whole
    answer would have been: text blocks from their deltas, tool inputs from
    their JSON pieces, usage from ``message_start`` and ``message_delta``."""

    def __init__(self) -> None:
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}
        self._usage: dict[str, Any] = {}
        self._stop_reason: str | None = None
        self._ended = False

    def add(self, event: object) -> str:
        """Take one event; the text it adds (empty if none)."""
        if not isinstance(event, dict):
            raise wire.no_content("not a stream event")
        kind = event.get("type")
        if kind == "content_block_delta":
            return self._delta(_index(event), event.get("delta"))
        if kind == "error":
            error = _field(event, "error")
            status = error_status(error.get("type"))
            raise _status_error(status, error.get("type"), None, error.get("message"), {})
        if kind == "message_start":
            self._usage.update(_field(_field(event, "message"), "usage"))
        elif kind == "content_block_start":
            self._blocks[_index(event)] = _field(event, "content_block")
        elif kind == "message_delta":
            stop = _field(event, "delta").get("stop_reason")
            if isinstance(stop, str):
                self._stop_reason = stop
            # Cumulative counts: the last one wins, field by field.
            usage = _field(event, "usage")
            self._usage.update({k: v for k, v in usage.items() if v is not None})
        elif kind == "message_stop":
            self._ended = True
        return ""

    def _delta(self, index: int, delta: object) -> str:
        if not isinstance(delta, dict):
            return ""
        block = self._blocks.setdefault(index, {"type": "text", "text": ""})
        if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
            block["text"] = block.get("text", "") + delta["text"]
            return str(delta["text"])
        if delta.get("type") == "input_json_delta" and isinstance(delta.get("partial_json"), str):
            self._json.setdefault(index, []).append(delta["partial_json"])
        return ""

    def message(self) -> dict[str, Any]:
        """The whole message, once the stream ended. One that ended before
        ``message_stop`` was cut off: a ``TransientError``."""
        if not self._ended:
            raise TransientError("model stream cut off before the answer's end")
        content = []
        for index in sorted(self._blocks):
            block = self._blocks[index]
            if block.get("type") == "tool_use" and index in self._json:
                text = "".join(self._json[index])
                try:
                    block["input"] = json.loads(text) if text else {}
                except ValueError:
                    block["input"] = text  # not JSON: kept as sent
            content.append(block)
        return {"content": content, "stop_reason": self._stop_reason, "usage": self._usage}


def _index(event: Mapping[str, Any]) -> int:
    index = event.get("index")
    return index if isinstance(index, int) else 0


# --- errors ----------------------------------------------------------------------------


def translate_error(exc: Exception) -> OncelyError | TimeoutError:
    """The oncely error an SDK or transport error stands for (module doc)."""
    if isinstance(exc, anthropic.APIStatusError):
        error = _field(exc.body, "error")
        details = _field(error, "details")
        return _status_error(
            exc.status_code,
            error.get("type"),
            details.get("error_code"),
            error.get("message"),
            exc.response.headers,
        )
    if isinstance(exc, anthropic.APITimeoutError):  # before its base, APIConnectionError
        return TimeoutError("model call timed out")
    if isinstance(exc, (anthropic.APIConnectionError, *_TRANSPORT_ERRORS)):
        cause = exc.__cause__ if isinstance(exc, anthropic.APIConnectionError) else exc
        return TransientError(f"model unreachable ({type(cause or exc).__name__})")
    return PermanentError(f"model call failed ({type(exc).__name__})")


def error_status(kind: object) -> int:
    """The status an error's ``type`` stands for when none came with it
    (500 for a type oncely does not know)."""
    return _ERROR_STATUS.get(kind, 500) if isinstance(kind, str) else 500


def _field(document: object, name: str) -> dict[str, Any]:
    found = document.get(name) if isinstance(document, dict) else None
    return found if isinstance(found, dict) else {}


def _status_error(
    status: int,
    kind: object,
    code: object,
    message: object,
    headers: Mapping[str, str],
) -> OncelyError:
    """A status as oncely's error: ``ProviderQuota`` when the account cannot
    pay, 529 and ``overloaded_error`` transient, the rest as for every
    dialect (``wire.status_error``). ``kind``: the body's ``error.type``."""
    label = kind if isinstance(kind, str) and kind else code
    if dry_account(status, kind, code, message):
        return ProviderQuota(
            f"model answered {status} ({wire.plain_code(label)}): the provider account's credit or"
            " spend limit is exhausted",
            status=status,
        )
    if kind == "overloaded_error" and status < 500:
        status = 529
    return wire.status_error(status, label, headers)


def dry_account(status: int, kind: object, code: object, message: object) -> bool:
    """Whether an error says the account's credit is spent or its spend
    limit reached (module doc)."""
    if kind == "billing_error" or code in _SPEND_CODES or status == 402:
        return True
    if status not in (400, 403, 429) or not isinstance(message, str):
        return False
    lowered = message.lower()
    return any(words in lowered for words in _DRY_WORDS)
