"""The adapter suite: every dialect's clients and the retry policy. The
``chat`` dialect has two clients (``ONCELY_LLM_CLIENT``: ``openai``, the
SDK's ``OpenAICompatible``, and ``lean``, ``LeanOpenAICompatible``), the
``responses`` dialect one (``OpenAIResponses``, the openai SDK's Responses
API) and the ``anthropic`` dialect one (``AnthropicMessages``, Anthropic's
SDK); each test runs against all four: first against a scripted HTTP server that
speaks the client's dialect (``Wire``: exact control of each answer, and of
a connection cut or a stall), then against the fake model server, whose
``/_calls`` counts what was paid for. What a request looks like on the wire
is the dialect's own, so those tests name their dialect.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import anthropic
import httpx
import httpx2
import openai
import pytest
from aiohttp import web

from oncely.errors import (
    DeadlineExceeded,
    OncelyError,
    PermanentError,
    ProviderQuota,
    Refused,
    TransientError,
)
from oncely.fakes.llm import FakeLLMServer
from oncely.llm import anthropic_messages, lean, openai_compat
from oncely.llm.anthropic_messages import AnthropicMessages
from oncely.llm.base import (
    Background,
    Completion,
    Message,
    ModelClient,
    ResponseSchema,
    ToolRequest,
    ToolSpec,
)
from oncely.llm.lean import LeanOpenAICompatible
from oncely.llm.openai_compat import OpenAICompatible
from oncely.llm.openai_responses import OpenAIResponses
from oncely.retry import Deadline, RetryEvent, RetryPolicy, call_with_retries, classify

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}
    ],
}
HI = [Message("user", "hi")]
CLIENTS = {
    "openai": OpenAICompatible,
    "lean": LeanOpenAICompatible,
    "responses": OpenAIResponses,
    "anthropic": AnthropicMessages,
}


@dataclass(frozen=True)
class Answer:
    status: int
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    text: str | None = None  # a body that is not JSON


class Cut:
    """Close the connection without answering."""


@dataclass(frozen=True)
class Stall:
    """Answer nothing for this long."""

    seconds: float


class ScriptedModel:
    """A model server (chat completions, the Responses API and Anthropic's
    messages) answering from a script, the last step repeating; keeps every
    request's body (None for a request without one: a background response's
    retrieve or cancel)."""

    def __init__(self, *script: Answer | Cut | Stall) -> None:
        self.script = list(script)
        self.bodies: list[Any] = []
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/messages", self._answer)
        app.router.add_post("/v1/responses", self._answer)
        app.router.add_get("/v1/responses/{id}", self._answer)
        app.router.add_post("/v1/responses/{id}/cancel", self._answer)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        self.url = ""

    @property
    def requests(self) -> int:
        return len(self.bodies)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json() if request.can_read_body else None)
        self.headers.append(dict(request.headers))
        self.paths.append(request.path)
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, Cut):
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if isinstance(step, Stall):
            await asyncio.sleep(step.seconds)
            return web.Response(status=500)
        if step.text is not None:
            return web.Response(status=step.status, text=step.text, headers=step.headers)
        return web.json_response(step.json, status=step.status, headers=step.headers)

    async def __aenter__(self) -> ScriptedModel:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._runner.cleanup()


Connect = Callable[[str], ModelClient]


@pytest.fixture(params=list(CLIENTS))
def client_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def connect(client_kind: str) -> Connect:
    """A client of model "m" at a base URL, of the kind under test."""
    cls = CLIENTS[client_kind]
    return lambda url: cls.connect(url, "test-key", "m")


class Wire:
    """What a provider of one dialect sends: answers, errors and streams
    written from what they mean, so that one test reads for every dialect."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect

    def answer(
        self,
        text: str | None = "fine",
        *,
        calls: tuple[tuple[str, str, str], ...] = (),
        usage: tuple[int, int] | None = None,
        cached: int = 0,
        cache_write: int = 0,
        reasoning: int = 0,
        finish: str = "stop",
    ) -> dict[str, Any]:
        """An answer: its text, the tools it calls ((id, name, arguments
        text) each), its usage (prompt tokens, all of them, and completion
        tokens; none: not reported)."""
        if self.dialect == "responses":
            return _response_document(text, calls, usage, cached, reasoning, finish)
        if self.dialect == "anthropic":
            content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
            for i, n, a in calls:
                try:
                    given: Any = json.loads(a)
                except ValueError:
                    given = a
                content.append({"type": "tool_use", "id": i, "name": n, "input": given})
            stop = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}[finish]
            message: dict[str, Any] = {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "m",
                "content": content,
                "stop_reason": "tool_use" if calls else stop,
                "stop_sequence": None,
            }
            if usage is not None:
                message["usage"] = {
                    "input_tokens": usage[0] - cached - cache_write,
                    "output_tokens": usage[1],
                    "cache_read_input_tokens": cached,
                    "cache_creation_input_tokens": cache_write,
                }
            return message
        said: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            said["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in calls
            ]
        choice = {"index": 0, "message": said, "finish_reason": "tool_calls" if calls else finish}
        answer = COMPLETION | {"choices": [choice]}
        if usage is not None:
            answer["usage"] = {
                "prompt_tokens": usage[0],
                "completion_tokens": usage[1],
                "total_tokens": sum(usage),
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"reasoning_tokens": reasoning},
            }
        return answer

    def refusal(self, usage: tuple[int, int]) -> dict[str, Any]:
        """A 200 declining to answer."""
        if self.dialect == "responses":
            declined = {"type": "refusal", "refusal": "I can't help with that."}
            message = {"type": "message", "role": "assistant", "content": [declined]}
            return self.answer(None, usage=usage) | {"output": [message]}
        if self.dialect == "anthropic":
            return self.answer(None, usage=usage) | {"stop_reason": "refusal"}
        said = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
        choice = {"index": 0, "message": said, "finish_reason": "stop"}
        return self.answer(usage=usage) | {"choices": [choice]}

    def empty(self, why: str) -> tuple[dict[str, Any], str]:
        """A 200 with no answer: ``nothing`` at all, or ``length`` (cut off
        by the answer's bound before any text); and the reason it gives."""
        if self.dialect == "responses":
            if why == "length":
                return self.answer(None, finish="length"), "max_output_tokens"
            return self.answer(None), "completed"
        if self.dialect == "anthropic":
            return self.answer(None, finish="length" if why == "length" else "stop"), (
                "max_tokens" if why == "length" else "end_turn"
            )
        if why == "length":
            return self.answer("", finish="length"), "length"
        return COMPLETION | {"choices": []}, "no choices"

    def dry(self) -> list[Answer]:
        """What the provider answers an account with no credit, or at its
        spend limit."""
        if self.dialect == "anthropic":
            low = "Your credit balance is too low to access the Anthropic API."
            limit = "You have reached your specified API usage limits. You will regain access on"
            return [
                Answer(400, self.error("invalid_request_error", low)),
                Answer(400, self.error("invalid_request_error", limit)),
                Answer(402, self.error("billing_error", "Payment required.")),
                Answer(
                    429,
                    {
                        "type": "error",
                        "error": {
                            "type": "rate_limit_error",
                            "details": {"error_code": "enforced_spend_limit_reached"},
                        },
                    },
                ),
            ]
        return [
            Answer(429, self.error("insufficient_quota", "You exceeded your current quota")),
            Answer(400, self.error("billing_hard_limit_reached", "Billing hard limit")),
        ]

    def error(self, code: str = "", message: str = "") -> dict[str, Any]:
        """An error's body: OpenAI's ``error.code``, Anthropic's ``error.type``."""
        if self.dialect == "anthropic":
            return {"type": "error", "error": {"type": code or "api_error", "message": message}}
        return {"error": {"code": code or None, "message": message}}

    def stream(
        self,
        *pieces: str,
        calls: tuple[tuple[str, str, str], ...] = (),
        usage: tuple[int, int] = (7, 3),
        ended: bool = True,
    ) -> Answer:
        """A 200 of server-sent events: the text in ``pieces``, each tool
        call's arguments in two pieces, the usage; ``ended`` False: cut off
        before the answer's end."""
        if self.dialect == "anthropic":
            return self._anthropic_stream(pieces, calls, usage, ended)
        if self.dialect == "responses":
            whole = self.answer("".join(pieces) or None, calls=calls, usage=usage)
            return _response_stream(whole, pieces, ended)
        chunks: list[dict[str, Any]] = [chunk({"role": "assistant", "content": None})]
        chunks += [chunk({"content": p}) for p in pieces]
        for index, (i, n, a) in enumerate(calls):
            opening = {
                "index": index,
                "id": i,
                "type": "function",
                "function": {"name": n, "arguments": ""},
            }
            chunks.append(chunk({"tool_calls": [opening]}))
            for part in (a[: len(a) // 2], a[len(a) // 2 :]):
                chunks.append(
                    chunk({"tool_calls": [{"index": index, "function": {"arguments": part}}]})
                )
        if not ended:
            return sse_page(*chunks, done=False)
        chunks.append(chunk({}, "tool_calls" if calls else "stop"))
        chunks.append(
            {
                "id": "c",
                "choices": [],
                "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]},
            }
        )
        return sse_page(*chunks)

    @staticmethod
    def _anthropic_stream(
        pieces: tuple[str, ...],
        calls: tuple[tuple[str, str, str], ...],
        usage: tuple[int, int],
        ended: bool,
    ) -> Answer:
        start = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": usage[0], "output_tokens": 1},
        }
        events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
        if pieces:
            events.append(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                }
            )
            events += [
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": p},
                }
                for p in pieces
            ]
        for index, (i, n, a) in enumerate(calls, start=1):
            block = {"type": "tool_use", "id": i, "name": n, "input": {}}
            events.append({"type": "content_block_start", "index": index, "content_block": block})
            for part in (a[: len(a) // 2], a[len(a) // 2 :]):
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": part},
                    }
                )
        if ended:
            events.append(
                {
                    "type": "message_delta",
                    "usage": {"output_tokens": usage[1]},
                    "delta": {"stop_reason": "tool_use" if calls else "end_turn"},
                }
            )
            events.append({"type": "message_stop"})
        text = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
        return Answer(200, text=text, headers={"Content-Type": "text/event-stream"})


def _response_document(
    text: str | None,
    calls: tuple[tuple[str, str, str], ...],
    usage: tuple[int, int] | None,
    cached: int,
    reasoning: int,
    finish: str,
) -> dict[str, Any]:
    """An answer as the Responses API sends it (``Wire.answer``): its text a
    message item, each tool call a ``function_call`` item; cut off by its
    bound, ``incomplete``."""
    output: list[dict[str, Any]] = []
    if text:
        part = {"type": "output_text", "text": text, "annotations": []}
        output.append(
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [part]}
        )  # fmt: skip
    for i, n, a in calls:
        output.append(
            {"type": "function_call", "id": f"fc_{i}", "call_id": i, "name": n,
             "arguments": a, "status": "completed"}
        )  # fmt: skip
    cut = finish == "length"
    document: dict[str, Any] = {
        "id": "resp_1",
        "object": "response",
        "created_at": 0,
        "status": "incomplete" if cut else "completed",
        "model": "m",
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "usage": None,
    }
    if usage is not None:
        document["usage"] = {
            "input_tokens": usage[0],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage[1],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": sum(usage),
        }
    return document


def _response_stream(whole: dict[str, Any], pieces: tuple[str, ...], ended: bool) -> Answer:
    """A response as the Responses API streams it (``Wire.stream``): named
    events, numbered, from ``response.created`` to ``response.completed``
    (which carries the whole response); ``ended`` False: none after the
    last piece."""
    started = whole | {"status": "in_progress", "output": [], "usage": None}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": started}]
    index = 0
    if pieces:
        item = {"type": "message", "id": "msg_1", "role": "assistant", "content": []}
        events.append({"type": "response.output_item.added", "output_index": 0, "item": item})
        events += [
            {"type": "response.output_text.delta", "output_index": 0, "item_id": "msg_1",
             "content_index": 0, "delta": p}
            for p in pieces
        ]  # fmt: skip
        index = 1
    for offset, item in enumerate(i for i in whole["output"] if i["type"] == "function_call"):
        at = index + offset
        opened = item | {"arguments": ""}
        events.append({"type": "response.output_item.added", "output_index": at, "item": opened})
        a = item["arguments"]
        for part in (a[: len(a) // 2], a[len(a) // 2 :]):
            events.append(
                {"type": "response.function_call_arguments.delta", "output_index": at,
                 "item_id": item["id"], "delta": part}
            )  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": at, "item": item})
    if ended:
        events.append({"type": "response.completed", "response": whole})
    numbered = [e | {"sequence_number": n} for n, e in enumerate(events)]
    text = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in numbered)
    return Answer(200, text=text, headers={"Content-Type": "text/event-stream"})


@pytest.fixture
def wire(client_kind: str) -> Wire:
    """How the client under test's provider speaks."""
    return Wire({"anthropic": "anthropic", "responses": "responses"}.get(client_kind, "chat"))


@pytest.fixture
def scripted(connect: Connect) -> Callable[..., Any]:
    """``async with scripted(*steps) as (server, llm)``: a scripted server and
    a client of it, both closed at the end."""

    @contextlib.asynccontextmanager
    async def serve(
        *script: Answer | Cut | Stall,
    ) -> AsyncIterator[tuple[ScriptedModel, ModelClient]]:
        async with ScriptedModel(*script) as server, connect(server.url) as llm:
            yield server, llm

    return serve


def policy(deadline: Deadline | None = None, **overrides: Any) -> dict[str, Any]:
    """``call_with_retries`` keywords: a fast test policy, fields overridden by name."""
    fields: dict[str, Any] = {
        "per_call_timeout_s": 2.0,
        "max_attempts": 3,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "retry_after_max_s": 0.05,
    }
    return {
        "policy": RetryPolicy(**(fields | overrides)),
        "deadline": deadline or Deadline.after(5),
    }


async def complete_with_retries(
    llm: ModelClient,
    prompt: str,
    on_text: Callable[[str], None] | None = None,
    **options: Any,
) -> str:
    """``prompt``'s answer under a fast test policy (``options`` override
    it); streamed to ``on_text`` when given."""

    async def call(timeout_s: float) -> Completion:
        streamed = {"on_text": on_text} if on_text is not None else {}
        return await llm.complete([Message("user", prompt)], timeout_s, **streamed)

    completion = await call_with_retries(call, **(policy() | options))
    return completion.text


# --- the clients' requests and answers ---------------------------------------------


async def test_messages_go_in_order_and_usage_comes_back(scripted, wire: Wire) -> None:
    async with scripted(Answer(200, wire.answer(usage=(12, 3)))) as (server, llm):
        messages = [Message("system", "Be brief."), Message("user", "hi")]
        assert await llm.complete(messages, 1.0) == Completion("fine", 12, 3)
    assert llm.model == "m"
    body = server.bodies[0]
    assert body["model"] == "m"
    if wire.dialect == "anthropic":
        # The base URL written as OpenAI's (…/v1): the Messages API below it.
        assert server.paths == ["/v1/messages"]
        assert body["system"] == "Be brief."
        assert body["messages"] == [{"role": "user", "content": "hi"}]
        assert body["max_tokens"] == anthropic_messages.DEFAULT_MAX_TOKENS
        assert "output_config" not in body
        # The key as the SDK sends it (x-api-key, or a bearer token).
        headers = server.headers[0]
        sent = headers.get("x-api-key") or headers["Authorization"].removeprefix("Bearer ")
        assert (sent, bool(headers["anthropic-version"])) == ("test-key", True)
        return
    assert server.headers[0]["Authorization"] == "Bearer test-key"
    if wire.dialect == "responses":
        assert server.paths == ["/v1/responses"]
        assert body["input"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
        ]
        # Not in background mode: nothing of the call kept at the provider.
        assert (body["store"], "background" in body, "text" in body) == (False, False, False)
        return
    assert server.paths == ["/v1/chat/completions"]
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert "response_format" not in body
    assert server.headers[0]["Authorization"] == "Bearer test-key"


async def test_a_schema_is_sent_as_the_dialects_structured_output(scripted, wire: Wire) -> None:
    schema = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 9}}}
    async with scripted(Answer(200, wire.answer())) as (server, llm):
        await llm.complete(HI, 1.0, schema=ResponseSchema("Triage", schema))
    if wire.dialect == "anthropic":
        # Anthropic's structured outputs (not a forced tool), the schema in
        # the subset the API takes: closed objects, unenforced bounds told.
        sent = server.bodies[0]["output_config"]["format"]
        assert sent == {"type": "json_schema", "schema": anthropic.transform_schema(schema)}
        assert sent["schema"]["additionalProperties"] is False
        assert "tool_choice" not in server.bodies[0]
        return
    if wire.dialect == "responses":
        assert server.bodies[0]["text"] == {
            "format": {"type": "json_schema", "name": "Triage", "schema": schema}
        }
        return
    assert server.bodies[0]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Triage", "schema": schema},
    }


async def test_another_model_shares_the_endpoint(scripted, wire: Wire) -> None:
    async with scripted(Answer(200, wire.answer())) as (server, llm):
        other = llm.with_model("m2")
        assert llm.with_model("m") is llm
        await other.complete(HI, 1.0)
        await llm.complete(HI, 1.0)
    assert [b["model"] for b in server.bodies] == ["m2", "m"]


async def test_usage_is_zero_when_the_provider_reports_none(scripted, wire: Wire) -> None:
    async with scripted(Answer(200, wire.answer())) as (_, llm):
        assert await llm.complete(HI, 1.0) == Completion("fine", 0, 0)


@pytest.mark.parametrize("why", ["nothing", "length"])
async def test_an_empty_answer_is_permanent_and_sent_once(scripted, wire: Wire, why: str) -> None:
    answer, reason = wire.empty(why)
    async with scripted(Answer(200, answer)) as (server, llm):
        with pytest.raises(PermanentError) as raised:
            await complete_with_retries(llm, "hi")
    assert str(raised.value) == f"model returned no content ({reason})"
    assert server.requests == 1


async def test_a_refusal_is_refused_with_its_tokens_and_sent_once(scripted, wire: Wire) -> None:
    async with scripted(Answer(200, wire.refusal(usage=(9, 2)))) as (server, llm):
        with pytest.raises(Refused) as raised:
            await complete_with_retries(llm, "hi")
    assert isinstance(raised.value, PermanentError) and classify(raised.value) is False
    assert (raised.value.prompt_tokens, raised.value.completion_tokens) == (9, 2)
    assert raised.value.dead_reason == "refused"
    assert server.requests == 1


async def test_a_dry_account_is_provider_quota_sent_once(connect: Connect, wire: Wire) -> None:
    """Credit spent or a spend limit reached: permanent for the route (no
    retry), whatever the status says, never a pace (docs/providers.md)."""
    for dry in wire.dry():
        async with ScriptedModel(dry) as server, connect(server.url) as llm:
            with pytest.raises(ProviderQuota) as raised:
                await complete_with_retries(llm, "hi")
        assert classify(raised.value) is False, dry
        assert raised.value.status == dry.status
        assert raised.value.dead_reason == "provider-quota"
        assert "credit or spend limit is exhausted" in str(raised.value)
        assert server.requests == 1, dry


@pytest.mark.parametrize(
    "page",
    [
        Answer(200, text="<html>a proxy's page</html>", headers={"Content-Type": "text/html"}),
        Answer(200, text="{not json", headers={"Content-Type": "application/json"}),
    ],
    ids=["html", "broken json"],
)
async def test_a_200_that_is_not_json_is_permanent_and_sent_once(scripted, page: Answer) -> None:
    async with scripted(page) as (server, llm):
        with pytest.raises(PermanentError) as raised:
            await complete_with_retries(llm, "hi")
    assert str(raised.value) == "model returned no content (not JSON)"
    assert server.requests == 1


# --- errors translated at the edge -------------------------------------------------------

# What a status error's cause is: the SDK's own error, or none (the lean
# client reads the status itself).
STATUS_CAUSE = {
    "openai": openai.APIStatusError,
    "lean": type(None),
    "responses": openai.APIStatusError,
    "anthropic": anthropic.APIStatusError,
}
# What a connection's failure is caused by.
TRANSPORT_CAUSE = {
    "openai": openai.APIConnectionError,
    "lean": aiohttp.ClientError,
    "responses": openai.APIConnectionError,
    "anthropic": anthropic.APIConnectionError,
}


async def test_429_becomes_a_transient_error_and_the_retry_succeeds(
    client_kind, scripted, wire: Wire
) -> None:
    limited = Answer(429, wire.error(), headers={"retry-after-ms": "20"})
    async with scripted(limited, limited, Answer(200, wire.answer())) as (server, llm):
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 1.0)
        assert (raised.value.status, raised.value.retry_after_s) == (429, 0.02)
        assert isinstance(raised.value.__cause__, STATUS_CAUSE[client_kind])
        assert classify(raised.value) is True
        assert await complete_with_retries(llm, "hi") == "fine"
    assert server.requests == 3  # the direct call, then 429 and success


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Retry-After": "2"}, 2.0),
        ({"retry-after-ms": "1500", "Retry-After": "9"}, 1.5),
        ({"Retry-After": "soon"}, None),
        ({}, None),
    ],
)
async def test_retry_after_is_parsed_from_the_providers_headers(
    scripted, wire: Wire, headers: dict[str, str], expected: float | None
) -> None:
    async with scripted(Answer(503, wire.error(), headers=headers)) as (_, llm):
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 1.0)
    assert (raised.value.status, raised.value.retry_after_s) == (503, expected)


async def test_retry_after_accepts_an_http_date(scripted, wire: Wire) -> None:
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    async with scripted(Answer(429, wire.error(), headers={"Retry-After": future})) as (_, llm):
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 1.0)
    assert 28 < (raised.value.retry_after_s or 0) <= 30


async def test_400_is_permanent_and_sent_exactly_once(scripted, wire: Wire) -> None:
    async with scripted(Answer(400, wire.error(message="bad"))) as (server, llm):
        with pytest.raises(PermanentError) as raised:
            await complete_with_retries(llm, "hi")
    assert raised.value.status == 400
    assert classify(raised.value) is False
    assert server.requests == 1


async def test_error_messages_are_short_and_never_carry_the_prompt(scripted, wire: Wire) -> None:
    secret = "the customer's private text " * 20
    echo = wire.error("invalid_prompt", f"cannot process {secret}")
    async with scripted(Answer(400, echo)) as (_, llm):
        with pytest.raises(PermanentError) as raised:
            await llm.complete([Message("user", secret)], 1.0)
    assert str(raised.value) == "model answered 400 (invalid_prompt)"


async def test_an_error_code_that_is_not_a_plain_token_never_reaches_the_message(
    scripted, wire: Wire
) -> None:
    """A provider's code is untrusted: one with a newline (a forged log
    line) or a sentence is left out of the error, whichever dialect."""
    forged = "bad_request\n2026-12-05 [info] refund.approved amount=999999"
    async with scripted(Answer(400, wire.error(forged, "nope"))) as (_, llm):
        with pytest.raises(PermanentError) as raised:
            await llm.complete(HI, 1.0)
    assert "\n" not in str(raised.value) and "refund" not in str(raised.value)
    assert str(raised.value).startswith("model answered 400")


async def test_an_error_body_that_is_not_json_still_gives_the_status(scripted) -> None:
    async with scripted(Answer(502, text="Bad Gateway")) as (_, llm):
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 1.0)
    assert (str(raised.value), raised.value.status) == ("model answered 502", 502)


# 529: Anthropic's "overloaded".
RETRYABLE_STATUSES = [408, 409, 500, 502, 503, 504, 529]
PERMANENT_STATUSES = [401, 403, 404, 422]


@pytest.mark.parametrize("status", RETRYABLE_STATUSES + PERMANENT_STATUSES)
async def test_status_errors_are_translated_by_status(scripted, wire: Wire, status: int) -> None:
    retryable = status in RETRYABLE_STATUSES
    async with scripted(Answer(status, wire.error())) as (server, llm):
        with pytest.raises(TransientError if retryable else PermanentError) as raised:
            await complete_with_retries(llm, "hi")
    assert raised.value.status == status
    assert classify(raised.value) is retryable
    assert server.requests == (3 if retryable else 1)


# The openai SDK's aiohttp transport reports a connection refused or dropped
# as a connect timeout, so that path (chat completions' and the Responses
# API's) says "timeout" where the lean client and Anthropic's SDK say
# "unreachable"; all are retried.
DROPPED = {
    "openai": TimeoutError,
    "lean": TransientError,
    "responses": TimeoutError,
    "anthropic": TransientError,
}


@pytest.mark.parametrize("failure", [Cut(), Stall(30)], ids=["connection cut", "read stalled"])
async def test_a_cut_connection_or_a_stalled_read_is_translated_and_retried(
    client_kind, scripted, wire: Wire, failure: Cut | Stall
) -> None:
    translated = DROPPED[client_kind] if isinstance(failure, Cut) else TimeoutError
    async with scripted(failure, failure, Answer(200, wire.answer())) as (server, llm):
        with pytest.raises(translated) as raised:
            await llm.complete(HI, 0.3)  # the client's own read timeout, no wall clock
        assert type(raised.value) is translated
        assert isinstance(raised.value.__cause__, TRANSPORT_CAUSE[client_kind])
        assert classify(raised.value) is True
        assert await complete_with_retries(llm, "hi", **policy(per_call_timeout_s=0.3)) == "fine"
    assert server.requests == 3  # the direct call, then the failure and success


async def test_a_refused_connection_is_retried(client_kind, connect: Connect) -> None:
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    async with connect(f"http://127.0.0.1:{port}/v1") as llm:
        with pytest.raises(DROPPED[client_kind]) as raised:
            await llm.complete(HI, 1.0)
    assert type(raised.value) is DROPPED[client_kind]
    assert isinstance(raised.value.__cause__, TRANSPORT_CAUSE[client_kind])
    assert classify(raised.value) is True


@pytest.mark.parametrize(
    ("translate", "failure"),
    [
        pytest.param(sdk.translate_error, failure, id=f"{sdk.__name__}-{failure!r}")
        for sdk, its_httpx in ((openai_compat, httpx), (anthropic_messages, httpx2))
        for failure in (
            its_httpx.ReadError("reset"),
            aiohttp.ServerDisconnectedError(),
            aiohttp.ClientPayloadError(),
        )
    ],
)
def test_transport_errors_that_escape_the_sdks_are_transient(
    translate: Any, failure: Exception
) -> None:
    """OpenAI's SDK and Anthropic's (each with its own httpx) alike."""
    translated = translate(failure)
    assert isinstance(translated, TransientError)
    assert classify(translated) is True


@pytest.mark.parametrize(
    ("failure", "translated"),
    [
        (aiohttp.ServerDisconnectedError(), TransientError),
        (aiohttp.ClientPayloadError(), TransientError),
        (aiohttp.ClientOSError(), TransientError),
        (aiohttp.ServerTimeoutError(), TimeoutError),
        (aiohttp.ConnectionTimeoutError(), TimeoutError),
    ],
    ids=repr,
)
def test_the_lean_clients_transport_errors_are_retried(
    failure: aiohttp.ClientError, translated: type[Exception]
) -> None:
    error = lean.translate_error(failure)
    assert type(error) is translated
    assert classify(error) is True


@pytest.fixture
def no_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


@pytest.mark.parametrize("bypassed", [False, True], ids=["proxied", "NO_PROXY"])
async def test_the_lean_client_uses_the_environments_proxy(
    no_proxy_settings: pytest.MonkeyPatch, bypassed: bool
) -> None:
    """A forward proxy gets the request for a host it alone can reach,
    unless NO_PROXY names the host."""
    async with ScriptedModel(Answer(200, COMPLETION)) as proxy:
        no_proxy_settings.setenv("http_proxy", proxy.url.removesuffix("/v1"))
        if bypassed:
            no_proxy_settings.setenv("no_proxy", "model.invalid")
        async with LeanOpenAICompatible.connect("http://model.invalid/v1", "k", "m") as llm:
            if bypassed:
                # Straight to a host that does not resolve: unreachable (or,
                # on a machine whose resolver does not answer, timed out).
                with pytest.raises((TransientError, TimeoutError)):
                    await llm.complete(HI, 2.0)
            else:
                assert (await llm.complete(HI, 2.0)).text == "fine"
    assert proxy.requests == (0 if bypassed else 1)
    if not bypassed:
        assert proxy.headers[0]["Host"] == "model.invalid"


def test_other_sdk_errors_are_permanent() -> None:
    request = httpx.Request("POST", "http://model.test/v1/chat/completions")
    response = httpx.Response(200, request=request)
    translated = openai_compat.translate_error(
        openai.APIResponseValidationError(response, body=None)
    )
    assert isinstance(translated, PermanentError)
    assert classify(translated) is False
    anthropic_response = httpx2.Response(
        200, request=httpx2.Request("POST", "http://model.test/v1/messages")
    )
    for error in (
        anthropic.APIResponseValidationError(anthropic_response, body=None),
        anthropic.AnthropicError("something else"),
    ):
        translated = anthropic_messages.translate_error(error)
        assert type(translated) is PermanentError
        assert classify(translated) is False


async def test_unknown_exception_is_not_retried() -> None:
    calls = []

    class Broken:
        async def complete(self, messages: Any, *_: Any, **__: Any) -> Completion:
            calls.append(messages)
            raise LookupError("a bug somewhere")

    with pytest.raises(LookupError):
        await complete_with_retries(Broken(), "hi")  # type: ignore[arg-type]
    assert len(calls) == 1


# --- tool calls --------------------------------------------------------------------

LOOKUP = ToolSpec(
    "lookup_order",
    "Look an order up.",
    {"type": "object", "properties": {"order_id": {"type": "string"}}},
)


async def test_tools_and_tool_choice_are_sent_and_tool_calls_read(scripted, wire: Wire) -> None:
    answer = wire.answer(None, calls=(("call_a", "lookup_order", '{"order_id": "A1"}'),))
    async with scripted(Answer(200, answer)) as (server, llm):
        completion = await llm.complete(HI, 1.0, tools=[LOOKUP], tool_choice="required")
    assert completion.text == ""
    assert completion.tool_calls == (ToolRequest("call_a", "lookup_order", '{"order_id": "A1"}'),)
    body = server.bodies[0]
    if wire.dialect == "anthropic":
        assert body["tools"] == [
            {
                "name": "lookup_order",
                "description": "Look an order up.",
                "input_schema": LOOKUP.parameters,
            }
        ]
        assert body["tool_choice"] == {"type": "any"}
        return
    if wire.dialect == "responses":
        # Functions as the Responses API takes them: flat, strict off.
        assert body["tools"] == [
            {
                "type": "function",
                "name": "lookup_order",
                "description": "Look an order up.",
                "parameters": LOOKUP.parameters,
                "strict": False,
            }
        ]
        assert body["tool_choice"] == "required"
        return
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "lookup_order",
                "description": "Look an order up.",
                "parameters": LOOKUP.parameters,
            },
        }
    ]
    assert body["tool_choice"] == "required"


async def test_a_tool_named_as_the_choice_is_sent_as_that_tool(scripted, wire: Wire) -> None:
    async with scripted(Answer(200, wire.answer())) as (server, llm):
        await llm.complete(HI, 1.0, tools=[LOOKUP], tool_choice="lookup_order")
    if wire.dialect == "anthropic":
        assert server.bodies[0]["tool_choice"] == {"type": "tool", "name": "lookup_order"}
        return
    if wire.dialect == "responses":
        assert server.bodies[0]["tool_choice"] == {"type": "function", "name": "lookup_order"}
        return
    assert server.bodies[0]["tool_choice"] == {
        "type": "function",
        "function": {"name": "lookup_order"},
    }


async def test_parallel_tool_calls_come_back_in_order(scripted, wire: Wire) -> None:
    answer = wire.answer(
        None,
        calls=(
            ("c1", "lookup_order", '{"order_id": "A1"}'),
            ("c2", "lookup_order", '{"order_id": "B2"}'),
        ),
    )
    async with scripted(Answer(200, answer)) as (_, llm):
        completion = await llm.complete(HI, 1.0, tools=[LOOKUP])
    assert [(c.id, c.arguments) for c in completion.tool_calls] == [
        ("c1", '{"order_id": "A1"}'),
        ("c2", '{"order_id": "B2"}'),
    ]


async def test_arguments_that_are_not_json_are_kept_as_sent(scripted, wire: Wire) -> None:
    answer = wire.answer(None, calls=(("c1", "lookup_order", "{order_id: A1"),))
    async with scripted(Answer(200, answer)) as (_, llm):
        completion = await llm.complete(HI, 1.0, tools=[LOOKUP])
    assert completion.tool_calls[0].arguments == "{order_id: A1"


async def test_a_conversation_with_tool_calls_and_results_goes_out_as_sent(
    scripted, wire: Wire
) -> None:
    call = ToolRequest("c1", "lookup_order", '{"order_id": "A1"}')
    conversation = [
        Message("user", "Where is A1?"),
        Message("assistant", "", tool_calls=(call,)),
        Message("tool", '{"status": "shipped"}', tool_call_id="c1"),
    ]
    async with scripted(Answer(200, wire.answer())) as (server, llm):
        await llm.complete(conversation, 1.0, tools=[LOOKUP])
    if wire.dialect == "anthropic":
        result = {"type": "tool_result", "tool_use_id": "c1", "content": '{"status": "shipped"}'}
        use = {"type": "tool_use", "id": "c1", "name": "lookup_order", "input": {"order_id": "A1"}}
        assert server.bodies[0]["messages"] == [
            {"role": "user", "content": "Where is A1?"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
        ]
        return
    if wire.dialect == "responses":
        # The assistant's tool calls and their results are items of their own.
        assert server.bodies[0]["input"] == [
            {"role": "user", "content": "Where is A1?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "lookup_order",
                "arguments": '{"order_id": "A1"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": '{"status": "shipped"}'},
        ]
        return
    assert server.bodies[0]["messages"] == [
        {"role": "user", "content": "Where is A1?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup_order", "arguments": '{"order_id": "A1"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'},
    ]


async def test_cached_and_reasoning_tokens_are_read_when_reported(scripted, wire: Wire) -> None:
    """Every input token is a prompt token, the cache's reads and writes
    included (Anthropic's ``input_tokens`` leaves both out); reasoning
    tokens where the dialect reports them (chat completions, the Responses
    API)."""
    anthropic_ = wire.dialect == "anthropic"
    answer = wire.answer(
        usage=(100, 40), cached=64, cache_write=10 if anthropic_ else 0, reasoning=25
    )
    async with scripted(Answer(200, answer)) as (_, llm):
        completion = await llm.complete(HI, 1.0)
    assert (completion.prompt_tokens, completion.completion_tokens) == (100, 40)
    assert completion.cached_tokens == 64
    assert completion.cache_write_tokens == (10 if anthropic_ else 0)
    assert completion.reasoning_tokens == (0 if anthropic_ else 25)


async def test_a_paused_turn_is_continued_and_joined() -> None:
    """Anthropic's ``pause_turn`` (a server tool's long turn): the paused
    content goes back as the assistant's, the model is asked again, and the
    turn's text and usage are joined."""
    wire, connect = Wire("anthropic"), CLIENTS["anthropic"].connect
    paused = wire.answer("Half ", usage=(10, 2)) | {"stop_reason": "pause_turn"}
    script = (Answer(200, paused), Answer(200, wire.answer("done.", usage=(14, 3))))
    async with ScriptedModel(*script) as server, connect(server.url, "k", "m") as llm:
        completion = await llm.complete(HI, 1.0)
    assert (completion.text, completion.prompt_tokens, completion.completion_tokens) == (
        "Half done.",
        24,
        5,
    )
    assert server.bodies[1]["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Half "}]},
    ]


async def test_the_fake_calls_scripted_tools_turn_by_turn_then_answers(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    first = Message(
        "user",
        'Check it. [[fake:tool=lookup_order {"order_id": "A1"}]] [[fake:tool=refund {"c": 5}]]',
    )
    turn1 = await llm.complete([first], 2.0, tools=[LOOKUP])
    assert [(c.id, c.name, c.arguments) for c in turn1.tool_calls] == [
        ("call_1", "lookup_order", '{"order_id": "A1"}')
    ]
    answered = [
        first,
        Message("assistant", "", tool_calls=turn1.tool_calls),
        Message("tool", "{}", tool_call_id="call_1"),
    ]
    turn2 = await llm.complete(answered, 2.0, tools=[LOOKUP])
    assert [(c.id, c.name) for c in turn2.tool_calls] == [("call_2", "refund")]
    done = [
        *answered,
        Message("assistant", "", tool_calls=turn2.tool_calls),
        Message("tool", "{}", tool_call_id="call_2"),
    ]
    final = await llm.complete(done, 2.0, tools=[LOOKUP])
    assert final.tool_calls == () and final.text == "Check it."
    # Without tools declared, the directives are only text.
    plain = await llm.complete([first], 2.0)
    assert plain.tool_calls == ()


async def test_the_fake_calls_tools_in_parallel_and_with_bad_arguments(
    fake: FakeLLMServer, llm: ModelClient, wire: Wire
) -> None:
    text = (
        '[[fake:tools=parallel]] [[fake:badargs]] [[fake:tool=a {"x": 1}]] [[fake:tool=b {"y": 2}]]'
    )
    turn = await llm.complete([Message("user", text)], 2.0, tools=[LOOKUP])
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("a", "{not json"),
        ("b", '{"y": 2}'),
    ]
    schema = ResponseSchema(
        "Verdict", {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    )
    answered = [
        Message("user", text),
        Message("assistant", "", tool_calls=turn.tool_calls),
        Message("tool", "{}", tool_call_id="call_1"),
        Message("tool", "{}", tool_call_id="call_2"),
    ]
    final = await llm.complete(answered, 2.0, tools=[LOOKUP], schema=schema)
    assert final.text == '{"ok": false}'
    async with httpx.AsyncClient(base_url=fake.root_url) as http:
        recent = (await http.get("/_calls", params={"messages": "1"})).json()["requests"]
    # As sent: Anthropic's tool results are blocks of one user message; the
    # Responses API's tool calls and results are items of their own.
    roles = {
        "chat": ["user", "assistant", "tool", "tool"],
        "responses": [
            "user",
            "function_call",
            "function_call",
            "function_call_output",
            "function_call_output",
        ],
        "anthropic": ["user", "assistant", "user"],
    }
    sent = [m.get("role", m.get("type")) for m in recent[-1]["messages"]]
    assert sent == roles[wire.dialect]


# --- the adapter against the real fake model server ---------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
async def llm(fake: FakeLLMServer, client_kind: str) -> AsyncIterator[ModelClient]:
    async with CLIENTS[client_kind].connect(fake.url, "test", "oncely-fake") as adapter:
        yield adapter


async def calls_for(fake: FakeLLMServer, contains: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=fake.root_url) as http:
        response = await http.get("/_calls", params={"contains": contains})
    prompts: list[dict[str, Any]] = response.json()["prompts"]
    return prompts


async def test_adapter_returns_the_fakes_extractive_summary_and_its_usage(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    text = "Oncely makes LLM steps safe. Effects happen once! The rest is detail."
    completion = await llm.complete([Message("system", "Summarise."), Message("user", text)], 2.0)
    assert completion.text == "Oncely makes LLM steps safe. Effects happen once!"
    assert completion.prompt_tokens > 0 and completion.completion_tokens > 0
    assert [p["count"] for p in await calls_for(fake, "Oncely makes")] == [1]


async def test_scripted_429_is_retried_after_the_capped_retry_after(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    events: list[RetryEvent] = []

    async def on_retry(event: RetryEvent) -> None:
        events.append(event)

    prompt = "Busy provider. [[fake:429*1]]"
    assert await complete_with_retries(llm, prompt, on_retry=on_retry) == "Busy provider."
    assert [(e.reason, e.sleep_s) for e in events] == [("429", 0.05)]  # Retry-After: 1, capped
    assert [p["count"] for p in await calls_for(fake, "Busy provider")] == [2]


async def test_scripted_400_is_called_exactly_once(fake: FakeLLMServer, llm: ModelClient) -> None:
    with pytest.raises(PermanentError) as raised:
        await complete_with_retries(llm, "Bad input. [[fake:400]]")
    assert raised.value.status == 400
    assert [p["count"] for p in await calls_for(fake, "Bad input")] == [1]


async def test_hanging_model_gives_up_within_the_deadline(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    options = policy(Deadline.after(0.5), per_call_timeout_s=0.2, max_attempts=10)
    with pytest.raises(DeadlineExceeded):
        await complete_with_retries(llm, "Silence. [[fake:hang]]", **options)
    # Two or three attempts of 0.2 s, then the 0.5 s deadline: not ten.
    assert 1 <= fake.stats("Silence").prompts[0].count <= 3


async def test_dripping_model_is_cut_off_by_the_wall_clock(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    """A byte a second resets every read timeout; only the wall clock stops it."""
    options = policy(per_call_timeout_s=1.1, max_attempts=1)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        await complete_with_retries(llm, "Trickle. [[fake:drip]]", **options)
    # asyncio.timeout's own (from the cancellation), not the SDK's read timeout.
    assert isinstance(raised.value.__cause__, asyncio.CancelledError)
    # Not before its time; the fake drips forever, so ending at all (within
    # the test's timeout) is the wall clock's doing.
    assert time.monotonic() - started >= 1.1
    assert fake.stats("Trickle").prompts[0].count == 1


async def test_fifty_concurrent_calls_are_in_flight_together(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    prompts = [f"Request {n}. [[fake:sleep=0.2]]" for n in range(50)]
    answers = await asyncio.gather(*(llm.complete([Message("user", p)], 30.0) for p in prompts))
    assert [a.text for a in answers] == [f"Request {n}." for n in range(50)]
    # Together, as the fake saw them: not one after another.
    stats = fake.stats()
    assert stats.total == 50
    assert stats.max_in_flight >= 40


# --- the fake's own bookkeeping -----------------------------------------------------


async def test_faults_run_in_the_order_written(fake: FakeLLMServer, llm: ModelClient) -> None:
    prompt = [Message("user", "Script. [[fake:503*2]] [[fake:429*1]]")]
    failures = []
    for _ in range(3):
        with pytest.raises(TransientError) as raised:
            await llm.complete(prompt, 1.0)
        failures.append((raised.value.status, raised.value.retry_after_s))
    assert failures == [(503, None), (503, None), (429, 1.0)]
    assert (await llm.complete(prompt, 1.0)).text == "Script."


async def test_calls_filters_prompts_and_reset_clears_counters(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    await llm.complete([Message("user", "Alpha text.")], 1.0)
    await llm.complete([Message("user", "Beta text.")], 1.0)
    async with httpx.AsyncClient(base_url=fake.root_url) as http:
        report = (await http.get("/_calls", params={"contains": "Alpha"})).json()
        assert report["total"] == 2
        assert [p["excerpt"] for p in report["prompts"]] == ["Alpha text."]
        assert "rate_limited" not in report
        assert (await http.post("/_reset")).status_code == 200
        assert (await http.get("/_calls")).json()["total"] == 0


async def test_rpm_limit_refuses_with_retry_after_and_reports_rate_limited() -> None:
    async with FakeLLMServer(rpm=2) as fake, httpx.AsyncClient(base_url=fake.url) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "Limited."}]}
        statuses = [(await http.post("/chat/completions", json=body)) for _ in range(3)]
        assert [r.status_code for r in statuses] == [200, 200, 429]
        assert int(statuses[2].headers["Retry-After"]) >= 1
        report = (await http.get(f"{fake.root_url}/_calls")).json()
    assert (report["total"], report["rate_limited"], report["prompts"][0]["count"]) == (3, 1, 2)


# --- streamed answers ----------------------------------------------------------------


def sse_page(*chunks: object, done: bool = True) -> Answer:
    """A 200 of server-sent chunks, as a provider streams an answer."""
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    if done:
        lines.append("data: [DONE]\n\n")
    return Answer(200, text="".join(lines), headers={"Content-Type": "text/event-stream"})


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip


async def test_a_streamed_answer_gives_its_text_piece_by_piece_and_whole(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    text = "Streams arrive in pieces. Each piece is a word. The rest is left out."
    pieces: list[str] = []
    completion = await llm.complete([Message("user", text)], 2.0, on_text=pieces.append)
    assert completion.text == "Streams arrive in pieces. Each piece is a word."
    assert len(pieces) > 5 and "".join(pieces) == completion.text
    # The usage comes in the stream's last chunk, as providers send it.
    assert completion.prompt_tokens > 0 and completion.completion_tokens > 0
    async with httpx.AsyncClient(base_url=fake.root_url) as http:
        recent = (await http.get("/_calls", params={"messages": "1"})).json()
    assert recent["prompts"][0]["billed"] == 1


async def test_streamed_tool_calls_are_joined_from_their_pieces(scripted, wire: Wire) -> None:
    page = wire.stream(calls=(("call_9", "lookup_order", '{"order_id": "A1"}'),), usage=(7, 3))
    pieces: list[str] = []
    async with scripted(page) as (server, llm):
        completion = await llm.complete(HI, 2.0, tools=[LOOKUP], on_text=pieces.append)
    assert completion.tool_calls == (ToolRequest("call_9", "lookup_order", '{"order_id": "A1"}'),)
    assert (completion.prompt_tokens, completion.completion_tokens) == (7, 3)
    assert pieces == []
    assert server.bodies[0]["stream"] is True
    if wire.dialect == "chat":
        assert server.bodies[0]["stream_options"] == {"include_usage": True}
    if wire.dialect == "responses":
        assert server.bodies[0]["store"] is False and "background" not in server.bodies[0]


async def test_a_stream_that_stops_before_its_finish_is_transient(scripted, wire: Wire) -> None:
    page = wire.stream("half an ", "answ", ended=False)
    pieces: list[str] = []
    async with scripted(page) as (_, llm):
        with pytest.raises(TransientError, match="cut off"):
            await llm.complete(HI, 2.0, on_text=pieces.append)
    assert pieces == ["half an ", "answ"]


# An error event after a 200, as each dialect that has one sends it, and the
# status it stands for: Anthropic's overload, the Responses API's
# server_error; both transient.
MID_STREAM_ERRORS = {
    "anthropic": (
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        529,
    ),
    "responses": (
        {"type": "error", "code": "server_error", "message": "The server had an error"},
        500,
    ),
}


@pytest.mark.parametrize("dialect", list(MID_STREAM_ERRORS))
async def test_an_error_event_mid_stream_is_translated(dialect: str) -> None:
    """An ``error`` event after a 200 (an overload mid-answer): transient, as
    the status it stands for. Chat completions have no such event."""
    wire, connect = Wire(dialect), CLIENTS[dialect].connect
    page = wire.stream("half", ended=False)
    error, status = MID_STREAM_ERRORS[dialect]
    page = replace(page, text=f"{page.text}event: error\ndata: {json.dumps(error)}\n\n")
    async with ScriptedModel(page) as server, connect(server.url, "k", "m") as llm:
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 2.0, on_text=lambda _: None)
    assert raised.value.status == status


async def test_an_error_status_before_a_stream_is_translated_as_ever(scripted, wire: Wire) -> None:
    limited = Answer(429, wire.error("rate_limit"), {"Retry-After": "3"})
    async with scripted(limited) as (_, llm):
        with pytest.raises(TransientError) as caught:
            await llm.complete(HI, 2.0, on_text=lambda _: None)
    assert caught.value.status == 429 and caught.value.retry_after_s == 3


async def test_a_cut_stream_is_transient_and_its_retry_answers_whole(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    text = "[[fake:cut*1]] Cut streams start over. The retry answers whole."
    attempts: list[list[str]] = []

    async def call(timeout_s: float) -> Completion:
        attempts.append([])
        return await llm.complete([Message("user", text)], timeout_s, on_text=attempts[-1].append)

    completion = await call_with_retries(call, **policy())
    assert len(attempts) == 2
    # The cut attempt streamed part of the answer, the retry all of it.
    assert attempts[0] and "".join(attempts[0]) != completion.text
    assert completion.text.startswith("".join(attempts[0]).strip())
    assert "".join(attempts[1]) == completion.text
    [prompt] = await calls_for(fake, "Cut streams")
    assert prompt["faults"] == {"cut": 1} and prompt["billed"] == 2


async def test_a_whole_answer_cut_halfway_is_transient(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    with pytest.raises(TransientError):
        await llm.complete([Message("user", "[[fake:cut*1]] Half a body.")], 2.0)
    completion = await llm.complete([Message("user", "[[fake:cut*1]] Half a body.")], 2.0)
    assert completion.text == "Half a body."


# --- the fake's scripted provider faults, in every dialect ----------------------------


async def test_the_fakes_overload_is_transient_and_retried(
    fake: FakeLLMServer, llm: ModelClient
) -> None:
    prompt = "Overloaded provider. [[fake:529*1]]"
    assert await complete_with_retries(llm, prompt) == "Overloaded provider."
    [calls] = await calls_for(fake, "Overloaded provider")
    assert (calls["count"], calls["faults"]) == (2, {"529": 1})


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_the_fakes_dry_account_and_refusal_are_permanent(
    fake: FakeLLMServer, llm: ModelClient, streamed: bool
) -> None:
    options: dict[str, Any] = {"on_text": lambda _: None} if streamed else {}
    with pytest.raises(ProviderQuota):
        await complete_with_retries(llm, "No credit left. [[fake:credit]]", **options)
    with pytest.raises(Refused):
        await complete_with_retries(llm, "Declined. [[fake:refusal]]", **options)
    assert [p["count"] for p in await calls_for(fake, "No credit left")] == [1]
    [declined] = await calls_for(fake, "Declined")
    assert (declined["count"], declined["billed"]) == (1, 1)


async def test_the_fakes_cache_is_written_then_read(
    fake: FakeLLMServer, llm: ModelClient, wire: Wire
) -> None:
    """``[[fake:cache=N]]``: the first answer writes N prompt tokens to the
    cache (reported by Anthropic's dialect), later ones read them."""
    prompt = [Message("user", "A long shared preamble. [[fake:cache=6]]")]
    first = await llm.complete(prompt, 2.0)
    again = await llm.complete(prompt, 2.0, on_text=lambda _: None)
    assert first.cache_write_tokens == (6 if wire.dialect == "anthropic" else 0)
    assert (first.cached_tokens, again.cached_tokens, again.cache_write_tokens) == (0, 6, 0)
    assert first.prompt_tokens == again.prompt_tokens > 6


async def test_the_fakes_paused_turn_is_continued(fake: FakeLLMServer) -> None:
    """``[[fake:pause*N]]``: Anthropic's first N answers stop halfway with
    ``pause_turn``; the continuation answers the rest."""
    text = "Long tools run. The turn pauses, then goes on. [[fake:pause*1]]"
    async with CLIENTS["anthropic"].connect(fake.url, "k", "oncely-fake") as llm:
        whole = await llm.complete([Message("user", text)], 2.0)
        pieces: list[str] = []
        streamed = await llm.complete([Message("user", text + " ")], 2.0, on_text=pieces.append)
    assert whole.text == streamed.text == "Long tools run. The turn pauses, then goes on."
    assert "".join(pieces) == streamed.text
    assert [p["count"] for p in await calls_for(fake, "Long tools run")] == [2, 2]
    assert fake.stats().dialects == {"anthropic": 4}


# --- the Responses API's background calls, scripted -----------------------------------


def background_states(*statuses: str, answer: dict[str, Any] | None = None) -> list[Answer]:
    """A background response as the provider shows it: each status in turn
    (``queued``, ``in_progress``…), then ``answer`` (a whole response)."""
    wire = Wire("responses")
    head = wire.answer(None) | {"id": "resp_bg1", "usage": None}
    shown = [Answer(200, head | {"status": s}) for s in statuses]
    if answer is not None:
        shown.append(Answer(200, answer | {"id": "resp_bg1"}))
    return shown


class Kept:
    """A ``Background``'s store: the ids it was handed."""

    def __init__(self, stored: str | None = None, cancels: bool = False) -> None:
        self.ids: list[str] = []
        self.stored = stored
        self.cancelling = cancels

    def background(self) -> Background:
        async def keep(response_id: str) -> None:
            self.ids.append(response_id)

        return Background(self.stored, keep, lambda: self.cancelling)


async def test_a_background_call_keeps_its_id_then_polls_until_done() -> None:
    done = Wire("responses").answer("thought it through", usage=(20, 9), reasoning=5)
    script = background_states("queued", "in_progress", "in_progress", answer=done)
    kept = Kept()
    async with (
        ScriptedModel(*script) as server,
        OpenAIResponses.connect(server.url, "k", "m") as llm,
    ):
        completion = await llm.complete(HI, 2.0, background=kept.background())
    assert (completion.text, completion.reasoning_tokens) == ("thought it through", 5)
    assert kept.ids == ["resp_bg1"]
    assert server.paths == ["/v1/responses"] + ["/v1/responses/resp_bg1"] * 3
    assert (server.bodies[0]["background"], server.bodies[0]["store"]) == (True, True)


async def test_a_stored_response_is_reattached_to_and_not_sent_again() -> None:
    done = Wire("responses").answer("already thought", usage=(20, 9))
    kept = Kept(stored="resp_bg1")
    script = background_states("in_progress", answer=done)
    async with (
        ScriptedModel(*script) as server,
        OpenAIResponses.connect(server.url, "k", "m") as llm,
    ):
        completion = await llm.complete(HI, 2.0, background=kept.background())
    assert completion.text == "already thought"
    assert kept.ids == []  # nothing new to keep
    assert server.paths == ["/v1/responses/resp_bg1"] * 2  # no create


@pytest.mark.parametrize(
    ("shown", "error", "status"),
    [
        (Answer(404, Wire("responses").error("not_found")), TransientError, None),
        (
            Answer(200, {"status": "failed", "error": {"code": "server_error", "message": "x"}}),
            TransientError,
            500,
        ),
        (
            Answer(200, {"status": "failed", "error": {"code": "invalid_prompt", "message": "x"}}),
            PermanentError,
            400,
        ),
        (Answer(200, {"status": "cancelled", "output": []}), TransientError, None),
    ],
    ids=["gone", "failed transient", "failed permanent", "cancelled"],
)
async def test_a_background_response_that_ends_badly_is_translated(
    shown: Answer, error: type[Exception], status: int | None
) -> None:
    """Gone at the provider (the retry creates a new one), failed (by its
    error's code) or cancelled by someone else (asked again)."""
    script = [*background_states("queued"), shown]
    async with (
        ScriptedModel(*script) as server,
        OpenAIResponses.connect(server.url, "k", "m") as llm,
    ):
        with pytest.raises(error) as raised:
            await llm.complete(HI, 2.0, background=Kept().background())
    assert type(raised.value) is error
    assert getattr(raised.value, "status", None) == status
    assert server.paths[0] == "/v1/responses"


@pytest.mark.parametrize("bad", ["../../admin", "resp_1\n", "resp 1", ""], ids=repr)
async def test_a_response_id_that_is_not_a_plain_token_never_goes_into_a_url(bad: str) -> None:
    queued = Wire("responses").answer(None) | {"id": bad, "status": "queued"}
    kept = Kept()
    async with (
        ScriptedModel(Answer(200, queued)) as server,
        OpenAIResponses.connect(server.url, "k", "m") as llm,
    ):
        with pytest.raises(PermanentError, match="not a plain token"):
            await llm.complete(HI, 2.0, background=kept.background())
    assert (server.requests, kept.ids) == (1, [])


@pytest.mark.parametrize("cancels", [True, False], ids=["job cancelled", "shutdown"])
async def test_a_cancelled_wait_cancels_the_response_only_when_told(cancels: bool) -> None:
    kept = Kept(cancels=cancels)
    script = background_states("queued", "in_progress")
    async with (
        ScriptedModel(*script) as server,
        OpenAIResponses.connect(server.url, "k", "m") as llm,
    ):
        call = asyncio.create_task(llm.complete(HI, 2.0, background=kept.background()))
        while server.requests < 2:  # created, and polled once
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    cancelled = [p for p in server.paths if p.endswith("/cancel")]
    assert cancelled == (["/v1/responses/resp_bg1/cancel"] if cancels else [])


async def test_a_stream_that_ends_failed_is_translated_by_its_code() -> None:
    wire = Wire("responses")
    page = wire.stream("half", ended=False)
    failed = wire.answer(None) | {
        "status": "failed",
        "error": {"code": "rate_limit_exceeded", "message": "slow down"},
    }
    event = {"type": "response.failed", "response": failed, "sequence_number": 9}
    page = replace(page, text=f"{page.text}event: response.failed\ndata: {json.dumps(event)}\n\n")
    async with ScriptedModel(page) as server, OpenAIResponses.connect(server.url, "k", "m") as llm:
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 2.0, on_text=lambda _: None)
    assert raised.value.status == 429
    assert server.requests == 1


# --- every (dialect, client) pair, and nothing of an SDK past the adapter ------------------


def test_the_suite_runs_every_client_a_route_entry_can_get(monkeypatch) -> None:
    """Every (dialect, ONCELY_LLM_CLIENT) pair the composition can make a
    client for is one of ``CLIENTS``, and each of those is made by one: a
    lean client added for another dialect, or a dialect added, fails here
    until the suite runs it."""
    from typing import get_args

    from oncely.bootstrap.clients import connect_model
    from oncely.llm.routing import DIALECTS
    from oncely.settings import Settings

    made: dict[tuple[str, str], type] = {}
    for client in get_args(Settings.model_fields["llm_client"].annotation):
        settings = Settings(llm_client=client)
        for dialect in DIALECTS:
            adapter = connect_model(settings, "http://127.0.0.1:9/v1", "k", "m", dialect)
            made[(dialect, client)] = type(adapter)
            asyncio.run(adapter.aclose())
    assert set(made.values()) == set(CLIENTS.values()), made
    assert {made[("chat", "openai")], made[("chat", "lean")]} == {
        CLIENTS["openai"],
        CLIENTS["lean"],
    }


def _hostile(wire: Wire) -> dict[str, Answer]:
    """Answers no provider should send, each as an HTTP answer."""
    html = {"Content-Type": "text/html"}
    sse = {"Content-Type": "text/event-stream"}
    return {
        "200 html page": Answer(200, text="<html><body>Login</body></html>", headers=html),
        "200 json list": Answer(200, [1, 2, 3]),
        "200 json string": Answer(200, "fine"),
        "200 json null": Answer(200, None),
        "200 empty object": Answer(200, {}),
        "200 fields of the wrong type": Answer(
            200,
            {"choices": "x", "content": 5, "output": {"a": 1}, "status": 7, "usage": "many"},
        ),
        "200 empty body": Answer(200, text=""),
        "200 events of garbage": Answer(
            200, text="data: {oops\n\nevent: x\ndata: 5\n\n", headers=sse
        ),
        "200 events that are no events": Answer(
            200,
            text='data: {"type": 5, "choices": [7], "delta": null}\n\ndata: [DONE]\n\n',
            headers=sse,
        ),
        "301 elsewhere": Answer(301, text="", headers={"Location": "http://127.0.0.1:9/v1"}),
        "418 empty": Answer(418, text=""),
        "502 html page": Answer(502, text="<html>Bad gateway</html>", headers=html),
        "500 error of the wrong type": Answer(500, {"error": "boom", "type": ["x"]}),
        "429 retry-after garbage": Answer(429, wire.error(), headers={"retry-after": "soon"}),
    }


_NOT_OURS = (
    openai.OpenAIError,
    anthropic.AnthropicError,
    httpx.HTTPError,
    httpx2.HTTPError,
    aiohttp.ClientError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
)


async def _bounded(call: Any) -> None:
    """The call, cut off after a while: an adapter's wait on a response that
    never ends is bounded by its caller's clock (``call_with_retries``), so a
    cut-off call leaks nothing."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(call, 3.0)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_no_sdk_error_leaks_past_an_adapter(client_kind, scripted, wire, streamed) -> None:
    """Whatever a server answers, a call ends in an answer or one of
    oncely's errors (an SDK's, a transport's or a parser's error at most
    its cause): retry logic never meets a type it does not know."""
    leaked = {}
    for name, answer in _hostile(wire).items():
        async with scripted(answer) as (_, llm):
            try:
                options = {"on_text": lambda _: None} if streamed else {}
                await _bounded(llm.complete(HI, 2.0, **options))
            except OncelyError as exc:
                if isinstance(exc, _NOT_OURS):
                    leaked[name] = type(exc).__mro__
            except Exception as exc:
                leaked[name] = repr(exc)
    assert leaked == {}


async def test_no_sdk_error_leaks_from_a_background_call() -> None:
    """The same for a background response: created without an id or with
    one that is no token, and polled into answers no provider sends."""
    wire = Wire("responses")
    created = Answer(200, wire.answer(None) | {"id": "resp_1", "status": "queued"})
    scripts = {
        "no id": [Answer(200, {"status": "queued"})],
        "an id that is a path": [Answer(200, {"id": "../admin", "status": "queued"})],
        "polled into html": [created, Answer(200, text="<html></html>")],
        "polled into a list": [created, Answer(200, [1])],
        "polled into a 404": [created, Answer(404, wire.error())],
        "polled into a 502 page": [created, Answer(502, text="<html>Bad gateway</html>")],
        "polled, the connection cut": [created, Cut()],
    }
    leaked = {}
    for name, script in scripts.items():
        for stored, on_text in ((None, None), ("resp_1", None), (None, print), ("resp_1", print)):

            async def keep(response_id: str) -> None:
                pass

            options: dict[str, Any] = {"background": Background(stored, keep)}
            if on_text is not None:
                options["on_text"] = lambda _: None
            async with (
                ScriptedModel(*script) as server,
                OpenAIResponses.connect(server.url, "k", "m") as llm,
            ):
                try:
                    await _bounded(llm.complete(HI, 2.0, **options))
                except OncelyError as exc:
                    if isinstance(exc, _NOT_OURS):
                        leaked[(name, stored, on_text)] = type(exc).__mro__
                except Exception as exc:
                    leaked[(name, stored, on_text)] = repr(exc)
    assert leaked == {}
