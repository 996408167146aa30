"""The model adapter and the retry policy against the real ``openai`` SDK: first
over an ``httpx.MockTransport`` (exact control of each response), then over
real HTTP to the fake model server, whose ``/_calls`` counts what was paid for.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from oncely.errors import DeadlineExceeded, PermanentError, TransientError
from oncely.fakes.llm import FakeLLMServer
from oncely.llm.base import Completion, Message, ResponseSchema
from oncely.llm.openai_compat import OpenAICompatible, translate_error
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


class ScriptedTransport:
    """Answers (or raises) from a list, the last entry repeating; counts and keeps requests."""

    def __init__(self, *script: httpx.Response | Exception) -> None:
        self.script = list(script)
        self.bodies: list[dict[str, Any]] = []

    @property
    def requests(self) -> int:
        return len(self.bodies)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, Exception):
            raise step
        return step


def mock_llm(transport: ScriptedTransport) -> OpenAICompatible:
    client = openai.AsyncOpenAI(
        base_url="http://model.test/v1",
        api_key="test",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(transport)),
    )
    return OpenAICompatible(client, "m")


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


async def complete_with_retries(llm: OpenAICompatible, prompt: str, **options: Any) -> str:
    async def call(timeout_s: float) -> Completion:
        return await llm.complete([Message("user", prompt)], timeout_s)

    completion = await call_with_retries(call, **(policy() | options))
    return completion.text


# --- the adapter's requests and answers ------------------------------------------------


async def test_messages_go_in_order_and_usage_comes_back() -> None:
    answer = COMPLETION | {
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    }
    transport = ScriptedTransport(httpx.Response(200, json=answer))
    async with mock_llm(transport) as llm:
        messages = [Message("system", "Be brief."), Message("user", "hi")]
        assert await llm.complete(messages, 1.0) == Completion("fine", 12, 3)
    assert llm.model == "m"
    body = transport.bodies[0]
    assert body["model"] == "m"
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert "response_format" not in body


async def test_a_schema_is_sent_as_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    transport = ScriptedTransport(httpx.Response(200, json=COMPLETION))
    async with mock_llm(transport) as llm:
        await llm.complete(HI, 1.0, schema=ResponseSchema("Triage", schema))
    assert transport.bodies[0]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Triage", "schema": schema},
    }


async def test_usage_is_zero_when_the_provider_reports_none() -> None:
    async with mock_llm(ScriptedTransport(httpx.Response(200, json=COMPLETION))) as llm:
        assert await llm.complete(HI, 1.0) == Completion("fine", 0, 0)


@pytest.mark.parametrize(
    "choices",
    [
        [],
        [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"}],
        [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "refusal": "no"},
                "finish_reason": "stop",
            }
        ],
    ],
    ids=["no choices", "empty", "refused"],
)
async def test_an_empty_answer_is_permanent_and_sent_once(choices: list[Any]) -> None:
    transport = ScriptedTransport(httpx.Response(200, json=COMPLETION | {"choices": choices}))
    async with mock_llm(transport) as llm:
        with pytest.raises(PermanentError, match="no content"):
            await complete_with_retries(llm, "hi")
    assert transport.requests == 1


# --- SDK errors translated at the edge --------------------------------------------------


async def test_sdk_429_becomes_a_transient_error_and_the_retry_succeeds() -> None:
    limited = httpx.Response(429, headers={"retry-after-ms": "20"}, json={"error": {}})
    transport = ScriptedTransport(limited, limited, httpx.Response(200, json=COMPLETION))
    llm = mock_llm(transport)
    with pytest.raises(TransientError) as raised:
        await llm.complete(HI, 1.0)
    assert (raised.value.status, raised.value.retry_after_s) == (429, 0.02)
    assert isinstance(raised.value.__cause__, openai.RateLimitError)
    assert classify(raised.value) is True
    assert await complete_with_retries(llm, "hi") == "fine"
    assert transport.requests == 3  # the direct call, then 429 and success
    await llm.aclose()


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
    headers: dict[str, str], expected: float | None
) -> None:
    transport = ScriptedTransport(httpx.Response(503, headers=headers, json={"error": {}}))
    async with mock_llm(transport) as llm:
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 1.0)
    assert (raised.value.status, raised.value.retry_after_s) == (503, expected)


async def test_retry_after_accepts_an_http_date() -> None:
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    limited = httpx.Response(429, headers={"Retry-After": future}, json={"error": {}})
    async with mock_llm(ScriptedTransport(limited)) as llm:
        with pytest.raises(TransientError) as raised:
            await llm.complete(HI, 1.0)
    assert 28 < (raised.value.retry_after_s or 0) <= 30


async def test_sdk_400_is_permanent_and_sent_exactly_once() -> None:
    transport = ScriptedTransport(httpx.Response(400, json={"error": {"message": "bad"}}))
    llm = mock_llm(transport)
    with pytest.raises(PermanentError) as raised:
        await complete_with_retries(llm, "hi")
    assert raised.value.status == 400
    assert classify(raised.value) is False
    assert transport.requests == 1
    await llm.aclose()


async def test_error_messages_are_short_and_never_carry_the_prompt() -> None:
    secret = "the customer's private text " * 20
    echo = {"error": {"message": f"cannot process {secret}", "code": "invalid_prompt"}}
    transport = ScriptedTransport(httpx.Response(400, json=echo))
    async with mock_llm(transport) as llm:
        with pytest.raises(PermanentError) as raised:
            await llm.complete([Message("user", secret)], 1.0)
    assert str(raised.value) == "model answered 400 (invalid_prompt)"


RETRYABLE_STATUSES = [408, 409, 500, 502, 503, 504]
PERMANENT_STATUSES = [401, 403, 404, 422]


@pytest.mark.parametrize("status", RETRYABLE_STATUSES + PERMANENT_STATUSES)
async def test_sdk_status_errors_are_translated_by_status(status: int) -> None:
    retryable = status in RETRYABLE_STATUSES
    transport = ScriptedTransport(httpx.Response(status, json={"error": {}}))
    llm = mock_llm(transport)
    with pytest.raises(TransientError if retryable else PermanentError) as raised:
        await complete_with_retries(llm, "hi")
    assert raised.value.status == status
    assert classify(raised.value) is retryable
    assert transport.requests == (3 if retryable else 1)
    await llm.aclose()


@pytest.mark.parametrize(
    ("failure", "translated"),
    [
        (httpx.ConnectError("refused"), TransientError),
        (httpx.RemoteProtocolError("peer closed"), TransientError),
        (httpx.ReadTimeout("slow"), TimeoutError),
    ],
)
async def test_sdk_connection_errors_and_timeouts_are_translated_and_retried(
    failure: Exception, translated: type[Exception]
) -> None:
    transport = ScriptedTransport(failure, failure, httpx.Response(200, json=COMPLETION))
    llm = mock_llm(transport)
    with pytest.raises(translated) as raised:
        await llm.complete(HI, 1.0)
    assert isinstance(raised.value.__cause__, openai.APIConnectionError)
    assert classify(raised.value) is True
    assert await complete_with_retries(llm, "hi") == "fine"
    assert transport.requests == 3  # the direct call, then the failure and success
    await llm.aclose()


@pytest.mark.parametrize(
    "failure",
    [httpx.ReadError("reset"), aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError()],
    ids=repr,
)
def test_transport_errors_that_escape_the_sdk_are_transient(failure: Exception) -> None:
    translated = translate_error(failure)
    assert isinstance(translated, TransientError)
    assert classify(translated) is True


def test_other_sdk_errors_are_permanent() -> None:
    request = httpx.Request("POST", "http://model.test/v1/chat/completions")
    response = httpx.Response(200, request=request)
    translated = translate_error(openai.APIResponseValidationError(response, body=None))
    assert isinstance(translated, PermanentError)
    assert classify(translated) is False


async def test_unknown_exception_is_not_retried() -> None:
    transport = ScriptedTransport(LookupError("a bug somewhere"))
    llm = mock_llm(transport)
    with pytest.raises(LookupError):
        await complete_with_retries(llm, "hi")
    assert transport.requests == 1
    await llm.aclose()


# --- the adapter against the real fake model server ---------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
async def llm(fake: FakeLLMServer) -> AsyncIterator[OpenAICompatible]:
    async with OpenAICompatible.connect(fake.url, "test", "oncely-fake") as adapter:
        yield adapter


async def calls_for(fake: FakeLLMServer, contains: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=fake.root_url) as http:
        response = await http.get("/_calls", params={"contains": contains})
    prompts: list[dict[str, Any]] = response.json()["prompts"]
    return prompts


async def test_adapter_returns_the_fakes_extractive_summary_and_its_usage(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    text = "Oncely makes LLM steps safe. Effects happen once! The rest is detail."
    completion = await llm.complete([Message("system", "Summarise."), Message("user", text)], 2.0)
    assert completion.text == "Oncely makes LLM steps safe. Effects happen once!"
    assert completion.prompt_tokens > 0 and completion.completion_tokens > 0
    assert [p["count"] for p in await calls_for(fake, "Oncely makes")] == [1]


async def test_scripted_429_is_retried_after_the_capped_retry_after(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    events: list[RetryEvent] = []

    async def on_retry(event: RetryEvent) -> None:
        events.append(event)

    prompt = "Busy provider. [[fake:429*1]]"
    assert await complete_with_retries(llm, prompt, on_retry=on_retry) == "Busy provider."
    assert [(e.reason, e.sleep_s) for e in events] == [("429", 0.05)]  # Retry-After: 1, capped
    assert [p["count"] for p in await calls_for(fake, "Busy provider")] == [2]


async def test_scripted_400_is_called_exactly_once(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    with pytest.raises(PermanentError) as raised:
        await complete_with_retries(llm, "Bad input. [[fake:400]]")
    assert raised.value.status == 400
    assert [p["count"] for p in await calls_for(fake, "Bad input")] == [1]


async def test_hanging_model_gives_up_within_the_deadline(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    options = policy(Deadline.after(0.5), per_call_timeout_s=0.2, max_attempts=10)
    with pytest.raises(DeadlineExceeded):
        await complete_with_retries(llm, "Silence. [[fake:hang]]", **options)
    # Two or three attempts of 0.2 s, then the 0.5 s deadline: not ten.
    assert 1 <= fake.stats("Silence").prompts[0].count <= 3


async def test_dripping_model_is_cut_off_by_the_wall_clock(
    fake: FakeLLMServer, llm: OpenAICompatible
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
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    prompts = [f"Request {n}. [[fake:sleep=0.2]]" for n in range(50)]
    answers = await asyncio.gather(*(llm.complete([Message("user", p)], 30.0) for p in prompts))
    assert [a.text for a in answers] == [f"Request {n}." for n in range(50)]
    # Together, as the fake saw them: not one after another.
    stats = fake.stats()
    assert stats.total == 50
    assert stats.max_in_flight >= 40


# --- the fake's own bookkeeping -----------------------------------------------------


async def test_faults_run_in_the_order_written(fake: FakeLLMServer, llm: OpenAICompatible) -> None:
    prompt = [Message("user", "Script. [[fake:503*2]] [[fake:429*1]]")]
    failures = []
    for _ in range(3):
        with pytest.raises(TransientError) as raised:
            await llm.complete(prompt, 1.0)
        failures.append((raised.value.status, raised.value.retry_after_s))
    assert failures == [(503, None), (503, None), (429, 1.0)]
    assert (await llm.complete(prompt, 1.0)).text == "Script."


async def test_calls_filters_prompts_and_reset_clears_counters(
    fake: FakeLLMServer, llm: OpenAICompatible
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
