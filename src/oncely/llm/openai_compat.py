"""Any OpenAI-compatible chat endpoint (OpenAI, vLLM, Ollama, llama.cpp server,
the fake model) through the official ``openai`` SDK.

The SDK runs on its aiohttp transport: it costs less than half the client CPU
per call of the default one (bench/README.md). Its own retries are off
(``max_retries=0``): ``oncely.retry`` owns the policy, and two retry layers
would multiply each other's attempts.

This is the edge where the SDK's errors enter, so they are translated here and
nowhere else (``oncely.retry`` imports no SDK):

- ``APIStatusError``: 408, 409, 429 and 5xx become ``TransientError`` with the
  ``status`` and the wait from ``retry-after-ms`` / ``Retry-After``; any other
  status a ``PermanentError`` with the ``status``.
- ``APITimeoutError`` (the SDK's read timeout) becomes a plain ``TimeoutError``:
  to the retry policy and its metrics it is the same event as the wall-clock
  timeout around every attempt, one "timeout" reason for both.
- ``APIConnectionError`` and transport errors that escape the SDK unwrapped
  (httpx, aiohttp) become ``TransientError``.
- Any other SDK error, and a 200 without an answer or that is not JSON, is a
  ``PermanentError``; a 200 whose answer is a refusal is ``oncely.Refused``,
  and an error whose code says the account cannot pay (``insufficient_quota``)
  is ``ProviderQuota`` (docs/providers.md).

What a status means, and how an answer's usage and emptiness are read, is
shared with the lean client (``oncely.llm.wire``, ``oncely.llm.lean``).

The request's body is the lean client's too (``wire.request_body``), sent
with the SDK's ``post``: ``chat.completions.create`` first walks every
parameter through its typed-dict transform, which for an agent's turn (the
conversation and the tools' JSON schemas) cost more CPU than the rest of
the call (bench/README.md, Agents); the body is plain JSON already, so the
transform would change nothing. The SDK still sends it (auth, base URL,
errors) and parses the answer.

With ``on_text`` the answer comes streamed, its text to ``on_text`` as it
arrives, its chunks gathered as the lean client gathers them
(``wire.StreamedAnswer``); a stream cut off is a ``TransientError``.

Messages are short and never carry the prompt; the SDK error stays the cause.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Self, cast

import aiohttp
import httpx
import openai
from openai.types.chat import ChatCompletion
from openai.types.chat.chat_completion import Choice

from oncely.errors import OncelyError, PermanentError, Refused, TransientError
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

_TRANSPORT_ERRORS: tuple[type[Exception], ...] = (httpx.TransportError, aiohttp.ClientError)
try:  # the HTTP client of recent SDKs; older ones use httpx
    import httpx2
except ImportError:  # pragma: no cover
    pass
else:
    _TRANSPORT_ERRORS = (*_TRANSPORT_ERRORS, httpx2.TransportError)

_SDK_ERRORS: tuple[type[Exception], ...] = (openai.OpenAIError, *_TRANSPORT_ERRORS)
# Chat completions, below the client's base URL.
_PATH = "/chat/completions"


class OpenAIEndpoint(ClosedOnExit):
    """An OpenAI endpoint through the openai SDK (its retries off), for a
    model: what the chat and the Responses dialects share."""

    def __init__(self, client: openai.AsyncOpenAI, model: str) -> None:
        self._client = client
        self.model = model

    @classmethod
    def connect(cls, base_url: str, api_key: str, model: str) -> Self:
        """Build the client; no connection opens until the first call."""
        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key,
            max_retries=0,
            http_client=openai.DefaultAioHttpClient(),
        )
        return cls(client, model)

    def with_model(self, model: str) -> Self:
        """The same endpoint and connections, asking for another model (a
        workflow's variant, docs/shadow.md)."""
        return self if model == self.model else type(self)(self._client, model)

    async def aclose(self) -> None:
        await self._client.close()


class OpenAICompatible(OpenAIEndpoint):
    """The ``LLM`` protocol over chat completions, optionally with structured
    output (``response_format: json_schema``)."""

    dialect = "chat"
    # It takes OpenAI's flex tier and Batch API (docs/lanes.md).
    lanes = ("standard", "flex", "batch")

    async def complete(
        self,
        messages: Sequence[Message],
        timeout: float,  # noqa: ASYNC109 (LLM protocol)
        *,
        schema: ResponseSchema | None = None,
        tools: Sequence[ToolSpec] = (),
        tool_choice: ToolChoice | None = None,
        on_text: Callable[[str], None] | None = None,
        service_tier: str | None = None,
    ) -> Completion:
        # The SDK's timeout bounds each socket read, not the call: a server that
        # drips a byte a second would never trip it. The wall-clock limit is the
        # caller's (``call_with_retries`` runs every attempt under one).
        body = wire.request_body(self.model, messages, schema, tools, tool_choice, service_tier)
        try:
            if on_text is not None:
                return await self._streamed(body, timeout, on_text)
            response = await self._client.post(
                _PATH, cast_to=ChatCompletion, body=body, options={"timeout": timeout}
            )
        except _SDK_ERRORS as exc:
            raise translate_error(exc) from exc
        except json.JSONDecodeError as exc:  # a 200 that says it is JSON and is not
            raise wire.no_content("not JSON") from exc
        if not isinstance(response, ChatCompletion):  # another content type: the SDK's text
            raise wire.no_content("not JSON")
        try:
            return _completion(response)
        except (AttributeError, TypeError, IndexError, KeyError) as exc:
            # The SDK builds its types without validating them: JSON of
            # another shape reads as attributes that are not there.
            raise wire.no_content("not a chat completion") from exc

    async def _streamed(
        self,
        body: dict[str, Any],
        timeout: float,  # noqa: ASYNC109 (a socket read's, as above)
        on_text: Callable[[str], None],
    ) -> Completion:
        """The answer streamed, its text to ``on_text`` piece by piece. The
        SDK sends the request and raises its status errors; the lines are
        read raw, as the lean client reads them (``wire.StreamedAnswer``): a
        typed object per chunk would cost the worker more CPU than the call
        it streams (bench/README.md, Streams)."""
        answer = wire.StreamedAnswer()
        raw = self._client.chat.completions.with_streaming_response.create(
            **cast("Any", wire.stream_body(body)), timeout=timeout
        )
        async with raw as response:
            async for chunk in wire.stream_chunks(response.iter_bytes()):
                if text := answer.add(chunk):
                    on_text(text)
        return answer.completion()


def translate_error(exc: Exception) -> OncelyError | TimeoutError:
    """The oncely error an SDK or transport error stands for (see the module doc)."""
    if isinstance(exc, openai.APIStatusError):
        return wire.status_error(exc.status_code, exc.code, exc.response.headers)
    if isinstance(exc, openai.APITimeoutError):  # before its base, APIConnectionError
        return TimeoutError("model call timed out")
    if isinstance(exc, (openai.APIConnectionError, *_TRANSPORT_ERRORS)):
        cause = exc.__cause__ if isinstance(exc, openai.APIConnectionError) else exc
        return TransientError(f"model unreachable ({type(cause or exc).__name__})")
    return PermanentError(f"model call failed ({type(exc).__name__})")


def _why_empty(choice: Choice | None) -> str:
    return "no choices" if choice is None else choice.finish_reason


def _completion(response: ChatCompletion) -> Completion:
    """The answer (its text, or the tools it calls) and its usage. A 200
    without either will not change on a retry."""
    choice = response.choices[0] if response.choices else None
    calls = _tool_requests(choice)
    usage = response.usage
    if choice is not None and not (choice.message.content or calls) and choice.message.refusal:
        tokens = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
        raise Refused("model returned no content (refused)", tokens=tokens)
    if choice is None or not (choice.message.content or calls):
        raise wire.no_content(_why_empty(choice))
    prompt_details = usage.prompt_tokens_details if usage else None
    completion_details = usage.completion_tokens_details if usage else None
    return Completion(
        choice.message.content or "",
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        tool_calls=calls,
        cached_tokens=(prompt_details.cached_tokens or 0) if prompt_details else 0,
        reasoning_tokens=(completion_details.reasoning_tokens or 0) if completion_details else 0,
    )


def _tool_requests(choice: Choice | None) -> tuple[ToolRequest, ...]:
    """The function calls of the answer (another kind of tool call is left out)."""
    calls = choice.message.tool_calls if choice is not None else None
    found = []
    for call in calls or ():
        function = getattr(call, "function", None)
        if function is not None:
            found.append(ToolRequest(call.id or "", function.name, function.arguments or ""))
    return tuple(found)
