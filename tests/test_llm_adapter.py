"""The two model clients (``ONCELY_LLM_CLIENT``: ``openai``, the SDK's
``OpenAICompatible``, and ``lean``, ``LeanOpenAICompatible``) and the retry
policy, each test run against both: first against a scripted HTTP server
(exact control of each answer, and of a connection cut or a stall), then
against the fake model server, whose ``/_calls`` counts what was paid for.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web

from oncely.errors import DeadlineExceeded, PermanentError, TransientError
from oncely.fakes.llm import FakeLLMServer
from oncely.llm import lean, openai_compat
from oncely.llm.base import Completion, Message, ModelClient, ResponseSchema, ToolRequest, ToolSpec
from oncely.llm.lean import LeanOpenAICompatible
from oncely.llm.openai_compat import OpenAICompatible
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
    """A chat-completions server answering from a script, the last step
    repeating; keeps every request's body."""

    def __init__(self, *script: Answer | Cut | Stall) -> None:
        self.script = list(script)
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        self.url = ""

    @property
    def requests(self) -> int:
        return len(self.bodies)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
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


@pytest.fixture(params=["openai", "lean"])
def client_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def connect(client_kind: str) -> Connect:
    """A client of model "m" at a base URL, of the kind under test."""
    cls = OpenAICompatible if client_kind == "openai" else LeanOpenAICompatible
    return lambda url: cls.connect(url, "test-key", "m")


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


async def complete_with_retries(llm: ModelClient, prompt: str, **options: Any) -> str:
    async def call(timeout_s: float) -> Completion:
        return await llm.complete([Message("user", prompt)], timeout_s)

    completion = await call_with_retries(call, **(policy() | options))
    return completion.text


# --- the clients' requests and answers ---------------------------------------------


async def test_messages_go_in_order_and_usage_comes_back(scripted) -> None:
    answer = COMPLETION | {
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    }
    async with scripted(Answer(200, answer)) as (server, llm):
        messages = [Message("system", "Be brief."), Message("user", "hi")]
        assert await llm.complete(messages, 1.0) == Completion("fine", 12, 3)
    assert llm.model == "m"
    body = server.bodies[0]
    assert body["model"] == "m"
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert "response_format" not in body
    assert server.headers[0]["Authorization"] == "Bearer test-key"


async def test_a_schema_is_sent_as_json_schema_response_format(scripted) -> None:
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    async with scripted(Answer(200, COMPLETION)) as (server, llm):
        await llm.complete(HI, 1.0, schema=ResponseSchema("Triage", schema))
    assert server.bodies[0]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Triage", "schema": schema},
    }


async def test_another_model_shares_the_endpoint(scripted) -> None:
    async with scripted(Answer(200, COMPLETION)) as (server, llm):
        other = llm.with_model("m2")
        assert llm.with_model("m") is llm
        await other.complete(HI, 1.0)
        await llm.complete(HI, 1.0)
    assert [b["model"] for b in server.bodies] == ["m2", "m"]


async def test_usage_is_zero_when_the_provider_reports_none(scripted) -> None:
    async with scripted(Answer(200, COMPLETION)) as (_, llm):
        assert await llm.complete(HI, 1.0) == Completion("fine", 0, 0)


@pytest.mark.parametrize(
    ("choices", "why"),
    [
        ([], "no choices"),
        (
            [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ""},
                    "finish_reason": "length",
                }
            ],
            "length",
        ),
        (
            [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "refusal": "no"},
                    "finish_reason": "stop",
                }
            ],
            "refused",
        ),
    ],
    ids=["no choices", "empty", "refused"],
)
async def test_an_empty_answer_is_permanent_and_sent_once(
    scripted, choices: list[Any], why: str
) -> None:
    async with scripted(Answer(200, COMPLETION | {"choices": choices})) as (server, llm):
        with pytest.raises(PermanentError) as raised:
            await complete_with_retries(llm, "hi")
    assert str(raised.value) == f"model returned no content ({why})"
    assert server.requests == 1


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
STATUS_CAUSE = {"openai": openai.APIStatusError, "lean": type(None)}
# What a connection's failure is caused by.
TRANSPORT_CAUSE = {"openai": openai.APIConnectionError, "lean": aiohttp.ClientError}


async def test_429_becomes_a_transient_error_and_the_retry_succeeds(client_kind, scripted) -> None:
    limited = Answer(429, {"error": {}}, headers={"retry-after-ms": "20"})
    async with scripted(limited, limited, Answer(200, COMPLETION)) as (server, llm):
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
    scripted, headers: dict[str, str], expected: float | None
) -> None:
    async with scripted(Answer(503, {"error": {}}, headers=headers)) as (_, llm):
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 1.0)
    assert (raised.value.status, raised.value.retry_after_s) == (503, expected)


async def test_retry_after_accepts_an_http_date(scripted) -> None:
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    async with scripted(Answer(429, {"error": {}}, headers={"Retry-After": future})) as (_, llm):
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 1.0)
    assert 28 < (raised.value.retry_after_s or 0) <= 30


async def test_400_is_permanent_and_sent_exactly_once(scripted) -> None:
    async with scripted(Answer(400, {"error": {"message": "bad"}})) as (server, llm):
        with pytest.raises(PermanentError) as raised:
            await complete_with_retries(llm, "hi")
    assert raised.value.status == 400
    assert classify(raised.value) is False
    assert server.requests == 1


async def test_error_messages_are_short_and_never_carry_the_prompt(scripted) -> None:
    secret = "the customer's private text " * 20
    echo = {"error": {"message": f"cannot process {secret}", "code": "invalid_prompt"}}
    async with scripted(Answer(400, echo)) as (_, llm):
        with pytest.raises(PermanentError) as raised:
            await llm.complete([Message("user", secret)], 1.0)
    assert str(raised.value) == "model answered 400 (invalid_prompt)"


async def test_an_error_body_that_is_not_json_still_gives_the_status(scripted) -> None:
    async with scripted(Answer(502, text="Bad Gateway")) as (_, llm):
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 1.0)
    assert (str(raised.value), raised.value.status) == ("model answered 502", 502)


RETRYABLE_STATUSES = [408, 409, 500, 502, 503, 504]
PERMANENT_STATUSES = [401, 403, 404, 422]


@pytest.mark.parametrize("status", RETRYABLE_STATUSES + PERMANENT_STATUSES)
async def test_status_errors_are_translated_by_status(scripted, status: int) -> None:
    retryable = status in RETRYABLE_STATUSES
    async with scripted(Answer(status, {"error": {}})) as (server, llm):
        with pytest.raises(TransientError if retryable else PermanentError) as raised:
            await complete_with_retries(llm, "hi")
    assert raised.value.status == status
    assert classify(raised.value) is retryable
    assert server.requests == (3 if retryable else 1)


# The SDK's aiohttp transport reports a connection refused or dropped as a
# connect timeout, so the SDK path says "timeout" where the lean client says
# "unreachable"; both are retried.
DROPPED = {"openai": TimeoutError, "lean": TransientError}


@pytest.mark.parametrize("failure", [Cut(), Stall(30)], ids=["connection cut", "read stalled"])
async def test_a_cut_connection_or_a_stalled_read_is_translated_and_retried(
    client_kind, scripted, failure: Cut | Stall
) -> None:
    translated = DROPPED[client_kind] if isinstance(failure, Cut) else TimeoutError
    async with scripted(failure, failure, Answer(200, COMPLETION)) as (server, llm):
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
    "failure",
    [httpx.ReadError("reset"), aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError()],
    ids=repr,
)
def test_transport_errors_that_escape_the_sdk_are_transient(failure: Exception) -> None:
    translated = openai_compat.translate_error(failure)
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


def calling(*calls: tuple[str, str, str], **usage: Any) -> dict[str, Any]:
    """An answer that calls tools: (id, name, arguments text) each."""
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ],
    }
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
    return COMPLETION | {"choices": [choice], "usage": usage or {"prompt_tokens": 1}}


async def test_tools_and_tool_choice_are_sent_and_tool_calls_read(scripted) -> None:
    answer = calling(("call_a", "lookup_order", '{"order_id": "A1"}'))
    async with scripted(Answer(200, answer)) as (server, llm):
        completion = await llm.complete(HI, 1.0, tools=[LOOKUP], tool_choice="required")
    assert completion.text == ""
    assert completion.tool_calls == (ToolRequest("call_a", "lookup_order", '{"order_id": "A1"}'),)
    body = server.bodies[0]
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


async def test_a_tool_named_as_the_choice_is_sent_as_a_function(scripted) -> None:
    async with scripted(Answer(200, COMPLETION)) as (server, llm):
        await llm.complete(HI, 1.0, tools=[LOOKUP], tool_choice="lookup_order")
    assert server.bodies[0]["tool_choice"] == {
        "type": "function",
        "function": {"name": "lookup_order"},
    }


async def test_parallel_tool_calls_come_back_in_order(scripted) -> None:
    answer = calling(
        ("c1", "lookup_order", '{"order_id": "A1"}'), ("c2", "lookup_order", '{"order_id": "B2"}')
    )
    async with scripted(Answer(200, answer)) as (_, llm):
        completion = await llm.complete(HI, 1.0, tools=[LOOKUP])
    assert [(c.id, c.arguments) for c in completion.tool_calls] == [
        ("c1", '{"order_id": "A1"}'),
        ("c2", '{"order_id": "B2"}'),
    ]


async def test_arguments_that_are_not_json_are_kept_as_sent(scripted) -> None:
    answer = calling(("c1", "lookup_order", "{order_id: A1"))
    async with scripted(Answer(200, answer)) as (_, llm):
        completion = await llm.complete(HI, 1.0, tools=[LOOKUP])
    assert completion.tool_calls[0].arguments == "{order_id: A1"


async def test_a_conversation_with_tool_calls_and_results_goes_out_as_sent(scripted) -> None:
    call = ToolRequest("c1", "lookup_order", '{"order_id": "A1"}')
    conversation = [
        Message("user", "Where is A1?"),
        Message("assistant", "", tool_calls=(call,)),
        Message("tool", '{"status": "shipped"}', tool_call_id="c1"),
    ]
    async with scripted(Answer(200, COMPLETION)) as (server, llm):
        await llm.complete(conversation, 1.0, tools=[LOOKUP])
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


async def test_cached_and_reasoning_tokens_are_read_when_reported(scripted) -> None:
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 40,
        "total_tokens": 140,
        "prompt_tokens_details": {"cached_tokens": 64},
        "completion_tokens_details": {"reasoning_tokens": 25},
    }
    async with scripted(Answer(200, COMPLETION | {"usage": usage})) as (_, llm):
        completion = await llm.complete(HI, 1.0)
    assert (completion.cached_tokens, completion.reasoning_tokens) == (64, 25)
    assert (completion.prompt_tokens, completion.completion_tokens) == (100, 40)


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
    fake: FakeLLMServer, llm: ModelClient
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
    assert [m["role"] for m in recent[-1]["messages"]] == ["user", "assistant", "tool", "tool"]


# --- the adapter against the real fake model server ---------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
async def llm(fake: FakeLLMServer, client_kind: str) -> AsyncIterator[ModelClient]:
    cls = OpenAICompatible if client_kind == "openai" else LeanOpenAICompatible
    async with cls.connect(fake.url, "test", "oncely-fake") as adapter:
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


async def test_streamed_tool_calls_are_joined_from_their_pieces(scripted) -> None:
    opening = {"index": 0, "id": "call_9", "type": "function",
               "function": {"name": "lookup_order", "arguments": ""}}  # fmt: skip
    page = sse_page(
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [opening]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"order_'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'id": "A1"}'}}]}),
        chunk({}, "tool_calls"),
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}},
    )
    pieces: list[str] = []
    async with scripted(page) as (server, llm):
        completion = await llm.complete(HI, 2.0, tools=[LOOKUP], on_text=pieces.append)
    assert completion.tool_calls == (ToolRequest("call_9", "lookup_order", '{"order_id": "A1"}'),)
    assert (completion.prompt_tokens, completion.completion_tokens) == (7, 3)
    assert pieces == []
    assert server.bodies[0]["stream"] is True
    assert server.bodies[0]["stream_options"] == {"include_usage": True}


async def test_a_stream_that_stops_before_its_finish_is_transient(scripted) -> None:
    page = sse_page(chunk({"content": "half an "}), chunk({"content": "answ"}), done=False)
    pieces: list[str] = []
    async with scripted(page) as (_, llm):
        with pytest.raises(TransientError, match="cut off"):
            await llm.complete(HI, 2.0, on_text=pieces.append)
    assert pieces == ["half an ", "answ"]


async def test_an_error_status_before_a_stream_is_translated_as_ever(scripted) -> None:
    limited = Answer(429, {"error": {"code": "rate_limit"}}, {"Retry-After": "3"})
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
