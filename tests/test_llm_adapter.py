"""The model adapter and the retry policy against the real ``openai`` SDK: first
over an ``httpx.MockTransport`` (exact control of each response), then over
real HTTP to the fake model server, whose ``/_calls`` counts what was paid for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from oncely.errors import DeadlineExceeded
from oncely.fakes.llm import FakeLLMServer
from oncely.llm import OpenAICompatible, build_summary_prompt
from oncely.retry import Deadline, RetryEvent, call_with_retries, classify, retry_after_s

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}
    ],
}


class ScriptedTransport:
    """Answers (or raises) from a list, the last entry repeating; counts requests."""

    def __init__(self, *script: httpx.Response | Exception) -> None:
        self.script = list(script)
        self.requests = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
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


def policy(**overrides: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "deadline": Deadline.after(5),
        "per_call_timeout_s": 2.0,
        "max_attempts": 3,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "retry_after_max_s": 0.05,
    }
    return options | overrides


async def complete_with_retries(llm: OpenAICompatible, prompt: str, **overrides: Any) -> str:
    async def call(timeout_s: float) -> str:
        return await llm.complete(prompt, timeout_s)

    return await call_with_retries(call, **policy(**overrides))


# --- the classifier against the SDK's own exception types ---------------------------


async def test_sdk_429_is_a_retryable_rate_limit_and_the_second_request_succeeds() -> None:
    limited = httpx.Response(429, headers={"retry-after-ms": "20"}, json={"error": {}})
    transport = ScriptedTransport(limited, limited, httpx.Response(200, json=COMPLETION))
    llm = mock_llm(transport)
    with pytest.raises(openai.RateLimitError) as raised:
        await llm.complete("hi", 1.0)
    assert classify(raised.value) is True
    assert retry_after_s(raised.value) == 0.02
    assert await complete_with_retries(llm, "hi") == "fine"
    assert transport.requests == 3  # the direct call, then 429 and success
    await llm.aclose()


async def test_sdk_400_is_permanent_and_sent_exactly_once() -> None:
    transport = ScriptedTransport(httpx.Response(400, json={"error": {"message": "bad"}}))
    llm = mock_llm(transport)
    with pytest.raises(openai.BadRequestError) as raised:
        await complete_with_retries(llm, "hi")
    assert classify(raised.value) is False
    assert transport.requests == 1
    await llm.aclose()


RETRYABLE_STATUSES = [408, 409, 500, 502, 503, 504]
PERMANENT_STATUSES = [401, 403, 404, 422]


@pytest.mark.parametrize("status", RETRYABLE_STATUSES + PERMANENT_STATUSES)
async def test_sdk_status_errors_are_classified_by_status(status: int) -> None:
    retryable = status in RETRYABLE_STATUSES
    transport = ScriptedTransport(httpx.Response(status, json={"error": {}}))
    llm = mock_llm(transport)
    with pytest.raises(openai.APIStatusError) as raised:
        await complete_with_retries(llm, "hi")
    assert classify(raised.value) is retryable
    assert transport.requests == (3 if retryable else 1)
    await llm.aclose()


@pytest.mark.parametrize(
    ("failure", "sdk_error"),
    [
        (httpx.ConnectError("refused"), openai.APIConnectionError),
        (httpx.RemoteProtocolError("peer closed"), openai.APIConnectionError),
        (httpx.ReadTimeout("slow"), openai.APITimeoutError),
    ],
)
async def test_sdk_connection_errors_and_timeouts_are_retried(
    failure: Exception, sdk_error: type[Exception]
) -> None:
    transport = ScriptedTransport(failure, failure, httpx.Response(200, json=COMPLETION))
    llm = mock_llm(transport)
    with pytest.raises(sdk_error) as raised:
        await llm.complete("hi", 1.0)
    assert classify(raised.value) is True
    assert await complete_with_retries(llm, "hi") == "fine"
    assert transport.requests == 3  # the direct call, then the failure and success
    await llm.aclose()


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


async def test_adapter_returns_the_fakes_extractive_summary(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    text = "Oncely makes LLM steps safe. Effects happen once! The rest is detail."
    summary = await complete_with_retries(llm, build_summary_prompt(text))
    assert summary == "Oncely makes LLM steps safe. Effects happen once!"
    assert [p["count"] for p in await calls_for(fake, "Oncely makes")] == [1]


async def test_scripted_429_is_retried_after_the_capped_retry_after(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    events: list[RetryEvent] = []

    async def on_retry(event: RetryEvent) -> None:
        events.append(event)

    prompt = build_summary_prompt("Busy provider. [[fake:429*1]]")
    assert await complete_with_retries(llm, prompt, on_retry=on_retry) == "Busy provider."
    assert [(e.reason, e.sleep_s) for e in events] == [("429", 0.05)]  # Retry-After: 1, capped
    assert [p["count"] for p in await calls_for(fake, "Busy provider")] == [2]


async def test_scripted_400_is_called_exactly_once(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    with pytest.raises(openai.BadRequestError):
        await complete_with_retries(llm, build_summary_prompt("Bad input. [[fake:400]]"))
    assert [p["count"] for p in await calls_for(fake, "Bad input")] == [1]


async def test_hanging_model_gives_up_within_the_deadline(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    options = policy(deadline=Deadline.after(0.5), per_call_timeout_s=0.2, max_attempts=10)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await complete_with_retries(llm, "Silence. [[fake:hang]]", **options)
    assert time.monotonic() - started < 0.6
    assert 1 <= fake.stats("Silence").prompts[0].count <= 3


async def test_dripping_model_is_cut_off_by_the_wall_clock(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    """A byte a second resets every read timeout; only the wall clock stops it."""
    options = policy(per_call_timeout_s=1.1, max_attempts=1)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        await complete_with_retries(llm, "Trickle. [[fake:drip]]", **options)
    assert not isinstance(raised.value, openai.APITimeoutError)
    assert 1.1 <= time.monotonic() - started < 1.5
    assert fake.stats("Trickle").prompts[0].count == 1


async def test_fifty_concurrent_calls_are_in_flight_together(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    prompts = [f"Request {n}. [[fake:sleep=0.2]]" for n in range(50)]
    started = time.monotonic()
    answers = await asyncio.gather(*(llm.complete(p, 5.0) for p in prompts))
    assert answers == [f"Request {n}." for n in range(50)]
    assert time.monotonic() - started < 1.0
    stats = fake.stats()
    assert stats.total == 50
    assert stats.max_in_flight >= 40


# --- the fake's own bookkeeping -----------------------------------------------------


async def test_faults_run_in_the_order_written(fake: FakeLLMServer, llm: OpenAICompatible) -> None:
    prompt = "Script. [[fake:503*2]] [[fake:429*1]]"
    failures = []
    for _ in range(3):
        with pytest.raises(openai.APIStatusError) as raised:
            await llm.complete(prompt, 1.0)
        failures.append(raised.value.status_code)
    assert failures == [503, 503, 429]
    assert await llm.complete(prompt, 1.0) == "Script."


async def test_calls_filters_prompts_and_reset_clears_counters(
    fake: FakeLLMServer, llm: OpenAICompatible
) -> None:
    await llm.complete("Alpha text.", 1.0)
    await llm.complete("Beta text.", 1.0)
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
