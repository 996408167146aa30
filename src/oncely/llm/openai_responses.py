"""The ``responses:`` dialect: OpenAI's Responses API through the official
``openai`` SDK (docs/providers.md).

The SDK runs on its aiohttp transport with its own retries off
(``max_retries=0``): ``oncely.retry`` owns the policy. The base URL is
OpenAI's, ending in ``/v1``: a call posts to ``<base>/responses``.

What a call sends, from the model seam's messages (``input`` items, in
order): system, user and assistant text as messages of that role; an
assistant's tool calls as ``function_call`` items; tool results as
``function_call_output`` items. Tools go as functions with ``strict``
off (as chat completions send them: the Responses API would otherwise
hold every schema to its strict subset); ``tool_choice`` ``auto``,
``none``, ``required`` or a tool's name. Structured output is
``text.format`` (``json_schema``). ``reasoning`` (the effort) goes as
``reasoning.effort``. A call that is not in background mode is sent with
``store: false``: nothing of it is kept at the provider.

What comes back: the ``output_text`` parts of the message items, the
``function_call`` items as tool calls (their ``call_id`` as the id);
reasoning items are not part of the answer. Usage: ``input_tokens`` (its
``cached_tokens``), ``output_tokens`` (its ``reasoning_tokens``). A
``refusal`` part and no text nor tool call is ``oncely.Refused``; a
response without either (``incomplete`` for ``max_output_tokens``, say) a
``PermanentError``; a ``failed`` one is translated by its error's code
(``server_error`` and ``rate_limit_exceeded`` transient); a ``cancelled``
one is transient (the retry asks again).

Background calls (docs/providers.md, Background calls): with a
``Background`` the request goes with ``background: true`` (and ``store:
true``, which it needs). The response's id is handed to ``Background.keep``
(which stores it durably) before any wait; the adapter then polls
``GET <base>/responses/{id}`` until the response is done. A ``Background``
whose ``stored`` id a delivery before this one kept is re-attached to: no
request is sent again, the answer is read by id. A response gone at the
provider (404) is transient: the retry creates a new one. A cancellation
that reaches the wait when ``Background.cancels()`` says so (the job was
cancelled, or the attempt's time ran out) cancels the response at the
provider (``POST <base>/responses/{id}/cancel``, shielded, bounded); any
other (a worker shutting down) leaves it running for the next delivery.
A cancellation that comes while the create is out waits for its answer
(shielded, bounded) so that the id is kept and, as above, the response
cancelled: the provider has it once the request is out.
An id is what a provider sent: it goes into a URL only when it is a plain
token (letters, digits, ``_`` and ``-``), else the call is a
``PermanentError``.

With ``on_text`` the answer comes streamed (``stream: true``): each
``response.output_text.delta`` goes to ``on_text``, and the
``response.completed`` (or ``failed``, ``incomplete``) event's response is
read as a whole answer; an ``error`` event is translated as a status, and a
stream that ends before the response's end is a ``TransientError``. A
streamed background call is created streaming (``background: true``,
``stream: true``): its id, from the first event that carries the response,
is kept before another event is read, and each text piece's
``sequence_number`` goes to ``Background.seen``. Re-attached to, it streams
the stored response again (``GET <base>/responses/{id}?stream=true``) from
``starting_after`` ``Background.after``: the pieces the caller already has
are not sent again, and nothing is created again.

Errors translate here and nowhere else, as for chat completions
(``oncely.llm.openai_compat.translate_error``, ``oncely.llm.wire``):
``insufficient_quota`` is ``ProviderQuota``. Messages are short and never
carry the prompt; the SDK error stays the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar, cast

import openai

from oncely.errors import OncelyError, Refused, TransientError
from oncely.llm import wire
from oncely.llm.base import (
    Background,
    Completion,
    Message,
    Reasoning,
    ResponseSchema,
    ToolChoice,
    ToolRequest,
    ToolSpec,
)
from oncely.llm.openai_compat import _SDK_ERRORS, OpenAIEndpoint, translate_error

_T = TypeVar("_T")
# A stream opened: the rest of its events, and those already read.
_Opened = tuple[AsyncIterator[Any], list[Any]]

# The Responses API, below the client's base URL.
_PATH = "/responses"
# A background response's polls: the first after this long, each next one
# half as long again, at most ``_POLL_MAX_S`` apart.
_POLL_FIRST_S = 0.2
_POLL_MAX_S = 2.0
# How long cancelling a response at the provider may take.
_CANCEL_S = 5.0
# Statuses of a response still being worked on.
_PENDING = frozenset({"queued", "in_progress"})
# A failed response's error code, as the status it stands for.
_FAILED_STATUS = {"server_error": 500, "rate_limit_exceeded": 429}
# The events a stream ends with: each carries the whole response.
_ENDING = frozenset({"response.completed", "response.failed", "response.incomplete"})


class OpenAIResponses(OpenAIEndpoint):
    """The ``LLM`` protocol over OpenAI's Responses API (module doc)."""

    dialect = "responses"
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
        reasoning: Reasoning | None = None,
        background: Background | None = None,
        service_tier: str | None = None,
    ) -> Completion:
        # The SDK's timeout bounds each socket read; the call's wall clock is
        # the caller's (``call_with_retries`` runs every attempt under one).
        body = request_body(self.model, messages, schema, tools, tool_choice, reasoning)
        if service_tier is not None:
            body["service_tier"] = service_tier
        try:
            if on_text is not None and background is not None:
                return await self._background_streamed(body, timeout, background, on_text)
            if on_text is not None:
                return await self._streamed(body, timeout, on_text)
            if background is not None:
                return await self._background(body, timeout, background)
            data = await self._post(_PATH, {**body, "store": False}, timeout)
        except _SDK_ERRORS as exc:
            raise translate_error(exc) from exc
        return read_response(data)

    async def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> Any:  # noqa: ASYNC109
        return await wire.post_json(self._client, path, body, timeout)

    async def _background(
        self,
        body: dict[str, Any],
        timeout: float,  # noqa: ASYNC109 (a socket read's, as above)
        background: Background,
    ) -> Completion:
        """Create the response in background mode (or re-attach to the stored
        one), keep its id, then poll until it is done (module doc)."""
        if background.stored is not None:
            response_id = wire.provider_id(background.stored)
            data = await self._retrieve(response_id, timeout)
        else:
            created = self._created(body, timeout)
            data, response_id = await self._until_kept(created, background)
        try:
            wait_s = _POLL_FIRST_S
            while data.get("status") in _PENDING:
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 1.5, _POLL_MAX_S)
                data = await self._retrieve(response_id, timeout)
        except asyncio.CancelledError:
            if background.cancels():
                await self._cancel(response_id)
            raise
        return read_response(data)

    async def _background_streamed(
        self,
        body: dict[str, Any],
        timeout: float,  # noqa: ASYNC109 (a socket read's, as above)
        background: Background,
        on_text: Callable[[str], None],
    ) -> Completion:
        """Create the response in background mode, streaming, and keep its id
        from the first event that carries it; or stream the stored one again
        after ``background.after`` (module doc)."""
        stream = StreamedResponse()
        try:
            async with contextlib.AsyncExitStack() as opened:
                if background.stored is None:
                    work = self._open_created(opened, body, timeout)
                    (events, first), response_id = await self._until_kept(work, background)
                else:
                    response_id = wire.provider_id(background.stored)
                    events, first = await self._open_stored(
                        opened, response_id, timeout, background
                    )
                try:
                    async for event in _after(first, events):
                        if text := stream.add(event):
                            background.seen(stream.sequence)
                            on_text(text)
                except asyncio.CancelledError:
                    if background.cancels():
                        await self._cancel(response_id)
                    raise
        except openai.NotFoundError as exc:
            if background.stored is None:
                raise  # the endpoint's 404, as any call's
            raise TransientError("background response not found at the provider") from exc
        return read_response(stream.response())

    async def _created(
        self,
        body: dict[str, Any],
        timeout: float,  # noqa: ASYNC109 (a socket read's, as above)
    ) -> tuple[dict[str, Any], str]:
        """Create the response in background mode: the response as created,
        and its id."""
        data = await self._post(_PATH, {**body, "background": True, "store": True}, timeout)
        return data, wire.provider_id(data.get("id"))

    async def _open_created(
        self,
        opened: contextlib.AsyncExitStack,
        body: dict[str, Any],
        timeout: float,  # noqa: ASYNC109 (a socket read's, as above)
    ) -> tuple[_Opened, str]:
        """Create the response streaming, in ``opened``, and read its events
        until one carries its id: the stream and the events read, and the id."""
        response = await opened.enter_async_context(
            self._client.responses.with_streaming_response.create(
                **cast("Any", {**body, "background": True, "store": True, "stream": True}),
                timeout=timeout,
            )
        )
        events = wire.stream_chunks(response.iter_bytes())
        first: list[Any] = []
        async for event in events:
            first.append(event)
            if (found := _field(event, "response").get("id")) is not None:
                return (events, first), wire.provider_id(found)
        raise TransientError("model stream ended before the response's id")

    async def _open_stored(
        self,
        opened: contextlib.AsyncExitStack,
        response_id: str,
        timeout: float,  # noqa: ASYNC109 (a socket read's, as above)
        background: Background,
    ) -> _Opened:
        """Stream the stored response again, in ``opened``, after
        ``background.after``."""
        after = openai.omit if background.after is None else background.after
        response = await opened.enter_async_context(
            self._client.responses.with_streaming_response.retrieve(
                response_id, stream=True, starting_after=after, timeout=timeout
            )
        )
        return wire.stream_chunks(response.iter_bytes()), []

    async def _until_kept(
        self, create: Coroutine[Any, Any, tuple[_T, str]], background: Background
    ) -> tuple[_T, str]:
        """Run ``create`` (a response's create, to its id) and keep the id,
        to the end even when the call is cancelled meanwhile: the provider
        has the response once the request is out, so a cancellation waits
        (shielded, at most ``_CANCEL_S``) for the id to be kept, and cancels
        the response at the provider when ``background.cancels()``; a
        response is never left running unknown, nor created again by the
        next delivery."""
        known: list[str] = []

        async def kept() -> tuple[_T, str]:
            made = await create
            known.append(made[1])
            try:
                await background.keep(made[1])
            except Exception:
                # Kept nowhere: no delivery could re-attach to it. Cancelled
                # here, and so not again below.
                known.clear()
                await self._cancel(made[1])
                raise
            return made

        task = asyncio.ensure_future(kept())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Bounded, and not cut short by a second cancellation either.
            ends = asyncio.get_running_loop().time() + _CANCEL_S
            while not task.done() and (left := ends - asyncio.get_running_loop().time()) > 0:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(asyncio.wait({task}, timeout=left))
            if known and background.cancels():
                await self._cancel(known[0])
            task.cancel()  # nothing when it is done
            raise

    async def _retrieve(self, response_id: str, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
        """The response as it stands; one the provider no longer has is
        transient (the retry creates a new one)."""
        try:
            return await wire.post_json(
                self._client, f"{_PATH}/{response_id}", None, timeout, method="get"
            )
        except openai.NotFoundError as exc:
            raise TransientError("background response not found at the provider") from exc

    async def _cancel(self, response_id: str) -> None:
        """Cancel the response at the provider: shielded from the cancellation
        that asked for it, bounded, and never raising (the provider may have
        finished it meanwhile)."""
        request = self._post(f"{_PATH}/{response_id}/cancel", None, _CANCEL_S)
        task = asyncio.ensure_future(asyncio.wait_for(request, _CANCEL_S))
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.shield(task)

    async def _streamed(
        self,
        body: dict[str, Any],
        timeout: float,  # noqa: ASYNC109 (a socket read's, as above)
        on_text: Callable[[str], None],
    ) -> Completion:
        """The answer as server-sent events, each text delta to ``on_text``,
        read from the event that ends the stream (the whole response)."""
        stream = StreamedResponse()
        raw = self._client.responses.with_streaming_response.create(
            **cast("Any", {**body, "store": False, "stream": True}), timeout=timeout
        )
        async with raw as response:
            async for event in wire.stream_chunks(response.iter_bytes()):
                if text := stream.add(event):
                    on_text(text)
        return read_response(stream.response())


async def _after(first: list[Any], events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The events read before, then the rest of the stream."""
    for event in first:
        yield event
    async for event in events:
        yield event


# --- the request -----------------------------------------------------------------------


def request_body(
    model: str,
    messages: Sequence[Message],
    schema: ResponseSchema | None,
    tools: Sequence[ToolSpec],
    tool_choice: ToolChoice | None,
    reasoning: Reasoning | None = None,
) -> dict[str, Any]:
    """A Responses API request's body (module doc)."""
    body: dict[str, Any] = {"model": model, "input": input_items(messages)}
    if schema is not None:
        body["text"] = {"format": text_format(schema)}
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": dict(t.parameters),
                "strict": False,
            }
            for t in tools
        ]
        if tool_choice is not None:
            body["tool_choice"] = tool_choice_param(tool_choice)
    if reasoning is not None:
        body["reasoning"] = {"effort": reasoning}
    return body


def text_format(schema: ResponseSchema) -> dict[str, Any]:
    """Structured output: ``{"type": "json_schema", "name", "schema"}``."""
    return {"type": "json_schema", "name": schema.name, "schema": dict(schema.schema)}


def tool_choice_param(choice: ToolChoice) -> str | dict[str, Any]:
    """``auto``, ``none`` and ``required`` as they are; a tool's name as
    that function."""
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "name": choice}


def input_items(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as ``input`` items (module doc)."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.tool_call_id or "",
                    "output": message.content,
                }
            )
            continue
        if message.content or not message.tool_calls:
            items.append({"role": message.role, "content": message.content})
        for call in message.tool_calls:
            items.append(
                {
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": call.arguments,
                }
            )
    return items


# --- the answer ------------------------------------------------------------------------


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _field(document: object, name: str) -> dict[str, Any]:
    found = document.get(name) if isinstance(document, dict) else None
    return found if isinstance(found, dict) else {}


def read_response(data: object) -> Completion:
    """A response document as the answer (module doc)."""
    if not isinstance(data, dict):
        raise wire.no_content("not a response")
    status = data.get("status")
    usage = _field(data, "usage")
    tokens = (_count(usage.get("input_tokens")), _count(usage.get("output_tokens")))
    if status == "failed":
        raise failed_error(_field(data, "error"))
    if status == "cancelled":
        raise TransientError("model response was cancelled at the provider")
    text, calls, refused = _output(data.get("output"))
    if not text and not calls:
        if refused:
            raise Refused("model returned no content (refused)", tokens=tokens)
        reason = _field(data, "incomplete_details").get("reason")
        raise wire.no_content(str(reason if isinstance(reason, str) else status))
    return Completion(
        text,
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        tool_calls=calls,
        cached_tokens=_count(_field(usage, "input_tokens_details").get("cached_tokens")),
        reasoning_tokens=_count(_field(usage, "output_tokens_details").get("reasoning_tokens")),
    )


def _output(output: object) -> tuple[str, tuple[ToolRequest, ...], bool]:
    """The output items' text, function calls, and whether a part refused."""
    text: list[str] = []
    calls: list[ToolRequest] = []
    refused = False
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call" and isinstance(item.get("name"), str):
            calls.append(_tool_request(item))
        elif item.get("type") == "message":
            content = item.get("content")
            for part in content if isinstance(content, list) else ():
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "output_text" and isinstance(part.get("text"), str):
                    text.append(part["text"])
                refused = refused or kind == "refusal"
    return "".join(text), tuple(calls), refused


def _tool_request(item: Mapping[str, Any]) -> ToolRequest:
    """A ``function_call`` item: its arguments as the text sent (JSON text
    for any other value: the caller judges it)."""
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return ToolRequest(str(item.get("call_id") or item.get("id") or ""), item["name"], arguments)


def failed_error(error: Mapping[str, Any]) -> OncelyError:
    """A failed response's error, by its code, as a status would be."""
    code = error.get("code")
    status = _FAILED_STATUS.get(code, 400) if isinstance(code, str) else 500
    return wire.status_error(status, code, {})


class StreamedResponse:
    """A streamed response's events: the text deltas as they come, and the
    response the ending event carries (module doc). ``sequence`` is the last
    event's ``sequence_number``."""

    def __init__(self) -> None:
        self._response: dict[str, Any] | None = None
        self.sequence = -1

    def add(self, event: object) -> str:
        """Take one event; the text it adds (empty if none)."""
        if not isinstance(event, dict):
            raise wire.no_content("not a stream event")
        number = event.get("sequence_number")
        if isinstance(number, int):
            self.sequence = number
        kind = event.get("type")
        if kind == "response.output_text.delta":
            delta = event.get("delta")
            return delta if isinstance(delta, str) else ""
        if kind in _ENDING:
            self._response = _field(event, "response")
        elif kind == "error":
            code = event.get("code")
            status = _FAILED_STATUS.get(code, 500) if isinstance(code, str) else 500
            raise wire.status_error(status, code, {})
        return ""

    def response(self) -> dict[str, Any]:
        """The whole response, once the stream ended; one that ended before
        its ending event was cut off: a ``TransientError``."""
        if self._response is None:
            raise TransientError("model stream cut off before the answer's end")
        return self._response
