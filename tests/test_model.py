"""``Model``, what a workflow step calls the model through: messages, transient
retries under the delivery's deadline, structured output re-asked when it does
not validate, and usage counted per delivery and in the metrics.

An in-process ``LLM`` answers from a script and keeps every request; each test
gets its own workflow label, so metric values are this test's alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, Literal
from uuid import uuid4

import httpx
import openai
import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel, ValidationError

from oncely.errors import DeadlineExceeded, PermanentError, TransientError
from oncely.llm.base import Completion, Message, ResponseSchema
from oncely.llm.model import InvalidOutput, Model, Usage, response_schema, short_errors
from oncely.llm.openai_compat import OpenAICompatible
from oncely.retry import Deadline, RetryPolicy

FAST = RetryPolicy(per_call_timeout_s=1.0, max_attempts=3, backoff_base_s=0.001, backoff_max_s=0.01)


class Triage(BaseModel):
    label: Literal["bug", "question"]
    urgent: bool


class Hang:
    """A step that never answers."""


Step = Completion | BaseException | Hang


class ScriptedLLM:
    """Answers from a script, one step per call (each ``delay_s`` late), the
    last repeating; an exception step is raised, a ``Hang`` waits forever.
    Keeps every call's messages and schema."""

    def __init__(self, *script: Step, delay_s: float = 0.0) -> None:
        self.script = list(script)
        self.delay_s = delay_s
        self.requests: list[tuple[list[Message], ResponseSchema | None]] = []

    @property
    def calls(self) -> int:
        return len(self.requests)

    async def complete(
        self,
        messages: Sequence[Message],
        timeout: float,  # noqa: ASYNC109
        *,
        schema: ResponseSchema | None = None,
    ) -> Completion:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.requests.append((list(messages), schema))
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, Hang):
            await asyncio.Event().wait()
            raise AssertionError("never answers")
        return step


def answer(text: str, prompt_tokens: int = 10, completion_tokens: int = 5) -> Completion:
    return Completion(text, prompt_tokens, completion_tokens)


def triage_json(**fields: Any) -> Completion:
    return answer(json.dumps({"label": "bug", "urgent": True} | fields))


@pytest.fixture
def workflow() -> str:
    return f"wf-{uuid4().hex[:8]}"


def model(llm: Any, workflow: str, **options: Any) -> Model:
    settings: dict[str, Any] = {
        "policy": FAST,
        "deadline": Deadline.after(5),
        "workflow": workflow,
        "model_name": "m1",
    }
    return Model(llm, **(settings | options))


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def calls(workflow: str, outcome: str) -> float:
    labels = {"workflow": workflow, "model": "m1", "outcome": outcome}
    return metric("oncely_model_calls_total", **labels)


def retries(workflow: str, reason: str) -> float:
    return metric("oncely_model_retries_total", workflow=workflow, reason=reason)


def tokens(workflow: str, kind: str) -> float:
    return metric("oncely_model_tokens_total", workflow=workflow, model="m1", kind=kind)


def invalid_outputs(workflow: str) -> float:
    return metric("oncely_model_invalid_outputs_total", workflow=workflow, model="m1")


# --- complete -------------------------------------------------------------------------


async def test_complete_sends_system_then_user_and_counts_the_call(workflow: str) -> None:
    llm = ScriptedLLM(answer("a summary", 12, 4))
    m = model(llm, workflow)
    assert await m.complete("the text", system="Summarise.") == "a summary"
    assert llm.requests == [([Message("system", "Summarise."), Message("user", "the text")], None)]
    assert m.usage == Usage(prompt_tokens=12, completion_tokens=4, model_calls=1)
    assert calls(workflow, "ok") == 1
    assert (tokens(workflow, "prompt"), tokens(workflow, "completion")) == (12, 4)


async def test_complete_without_a_system_prompt_sends_only_the_user_message(
    workflow: str,
) -> None:
    llm = ScriptedLLM(answer("ok"))
    await model(llm, workflow).complete("hi")
    assert llm.requests == [([Message("user", "hi")], None)]


async def test_transient_errors_are_retried_and_every_attempt_is_counted(workflow: str) -> None:
    llm = ScriptedLLM(
        TransientError("model answered 503", status=503),
        TransientError("model answered 429", status=429, retry_after_s=0.001),
        answer("fine", 7, 3),
    )
    m = model(llm, workflow)
    assert await m.complete("hi") == "fine"
    assert m.usage == Usage(prompt_tokens=7, completion_tokens=3, model_calls=3)
    assert (calls(workflow, "transient"), calls(workflow, "ok")) == (2, 1)
    assert (retries(workflow, "5xx"), retries(workflow, "429")) == (1, 1)


async def test_a_permanent_error_is_raised_after_one_counted_call(workflow: str) -> None:
    llm = ScriptedLLM(PermanentError("model answered 400", status=400))
    m = model(llm, workflow)
    with pytest.raises(PermanentError):
        await m.complete("hi")
    assert (llm.calls, m.usage.model_calls) == (1, 1)
    assert (calls(workflow, "permanent"), calls(workflow, "transient")) == (1, 0)
    assert m.usage.prompt_tokens == 0


async def test_an_attempt_cut_off_by_its_timeout_counts_as_transient(workflow: str) -> None:
    llm = ScriptedLLM(Hang())
    policy = RetryPolicy(per_call_timeout_s=0.05, max_attempts=2, backoff_base_s=0.001)
    m = model(llm, workflow, policy=policy)
    with pytest.raises(TransientError) as raised:
        await m.complete("hi")
    # oncely's own transient error, so that a step catching it gets a failed checkpoint.
    assert isinstance(raised.value.__cause__, TimeoutError)
    assert (llm.calls, m.usage.model_calls) == (2, 2)
    assert calls(workflow, "transient") == 2
    assert retries(workflow, "timeout") == 1


async def test_an_expired_deadline_makes_no_call(workflow: str) -> None:
    llm = ScriptedLLM(answer("never"))
    m = model(llm, workflow, deadline=Deadline.after(0))
    with pytest.raises(DeadlineExceeded):
        await m.complete("hi")
    assert (llm.calls, m.usage.model_calls) == (0, 0)


# --- structured -----------------------------------------------------------------------


async def test_structured_sends_the_schema_and_returns_the_validated_model(
    workflow: str,
) -> None:
    llm = ScriptedLLM(triage_json(label="question", urgent=False))
    m = model(llm, workflow)
    result = await m.structured(Triage, "Is this a bug?", system="Triage.")
    assert result == Triage(label="question", urgent=False)
    messages, schema = llm.requests[0]
    assert messages == [Message("system", "Triage."), Message("user", "Is this a bug?")]
    assert schema == ResponseSchema(name="Triage", schema=Triage.model_json_schema())
    assert invalid_outputs(workflow) == 0


async def test_the_schema_is_computed_once_per_class(workflow: str) -> None:
    llm = ScriptedLLM(triage_json())
    m = model(llm, workflow)
    await m.structured(Triage, "one")
    await m.structured(Triage, "two")
    assert llm.requests[0][1] is llm.requests[1][1] is response_schema(Triage)


async def test_an_invalid_answer_is_asked_again_until_it_validates(workflow: str) -> None:
    llm = ScriptedLLM(
        answer("not json at all", 10, 5),
        triage_json(label="feature"),  # valid JSON, not the schema
        triage_json(),
    )
    m = model(llm, workflow)
    assert await m.structured(Triage, "triage me") == Triage(label="bug", urgent=True)
    assert m.usage == Usage(prompt_tokens=30, completion_tokens=15, model_calls=3)
    assert invalid_outputs(workflow) == 2
    assert calls(workflow, "ok") == 3
    assert (tokens(workflow, "prompt"), tokens(workflow, "completion")) == (30, 15)
    assert retries(workflow, "transient") == 0, "re-asks are not transient retries"
    assert all(messages == [Message("user", "triage me")] for messages, _ in llm.requests)


async def test_past_the_re_asks_invalid_output_is_permanent_and_quotes_no_answer(
    workflow: str,
) -> None:
    secret = "the customer's card is 4111"
    llm = ScriptedLLM(answer(json.dumps({"label": secret})))
    m = model(llm, workflow, invalid_output_retries=1)
    with pytest.raises(InvalidOutput) as raised:
        await m.structured(Triage, "triage me")
    assert isinstance(raised.value, PermanentError)
    assert llm.calls == 2
    assert invalid_outputs(workflow) == 2
    assert "label: Input should be 'bug' or 'question'" in raised.value.errors
    assert "urgent: Field required" in raised.value.errors
    assert "4111" not in str(raised.value)
    assert str(raised.value).startswith("Triage: no valid answer in 2 asks: ")


async def test_no_re_asks_when_invalid_output_retries_is_zero(workflow: str) -> None:
    llm = ScriptedLLM(answer("{"))
    with pytest.raises(InvalidOutput, match="Invalid JSON"):
        await model(llm, workflow, invalid_output_retries=0).structured(Triage, "x")
    assert llm.calls == 1


async def test_each_re_ask_gets_its_own_transient_retries(workflow: str) -> None:
    """Two attempts per ask: a 503 then an invalid answer, a 503 then a valid one."""
    llm = ScriptedLLM(
        TransientError("model answered 503", status=503),
        answer("[]"),
        TransientError("model answered 503", status=503),
        triage_json(),
    )
    policy = RetryPolicy(per_call_timeout_s=1.0, max_attempts=2, backoff_base_s=0.001)
    m = model(llm, workflow, policy=policy)
    assert await m.structured(Triage, "x") == Triage(label="bug", urgent=True)
    assert m.usage.model_calls == 4
    assert (calls(workflow, "transient"), calls(workflow, "ok")) == (2, 2)
    assert (retries(workflow, "5xx"), invalid_outputs(workflow)) == (2, 1)


async def test_re_asks_share_the_one_deadline(workflow: str) -> None:
    """Invalid answers taking 50 ms each: a 0.3 s delivery budget runs out
    long before 1000 re-asks do."""

    llm = ScriptedLLM(answer("not json"), delay_s=0.05)
    m = model(llm, workflow, deadline=Deadline.after(0.3), invalid_output_retries=1000)
    started = asyncio.get_running_loop().time()
    with pytest.raises(DeadlineExceeded):
        await m.structured(Triage, "x")
    assert asyncio.get_running_loop().time() - started < 0.4
    assert 3 <= llm.calls <= 7


def test_short_errors_name_the_fields_and_never_the_input() -> None:
    with pytest.raises(ValidationError) as raised:
        Triage.model_validate_json('{"label": "secret-value", "urgent": "maybe-secret"}')
    text = short_errors(raised.value)
    assert text.startswith("label: Input should be 'bug' or 'question'; urgent: ")
    assert "secret" not in text


def test_short_errors_show_the_first_three_and_stay_short() -> None:
    class Wide(BaseModel):
        field_with_a_long_name_a: int
        field_with_a_long_name_b: int
        field_with_a_long_name_c: int
        field_with_a_long_name_d: int
        field_with_a_long_name_e: int

    with pytest.raises(ValidationError) as raised:
        Wide.model_validate({})
    text = short_errors(raised.value)
    assert text.startswith("field_with_a_long_name_a: Field required; field_with_a_long_name_b")
    assert text.endswith("; and 2 more")
    assert len(text) <= 300


def test_usage_to_json() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=2, model_calls=1)
    assert usage.to_json() == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "model_calls": 1,
        "model_ms": 0,
        "cost_usd": 0.0,
        "model": None,
    }


def test_usage_cost_is_unknown_once_one_part_is() -> None:
    usage = Usage(cost_usd=0.25)
    usage.add_cost(0.5)
    assert usage.cost_usd == 0.75
    usage.add_cost(None)
    assert usage.cost_usd is None
    usage.add_cost(1.0)
    assert usage.cost_usd is None


# --- through the OpenAI adapter ---------------------------------------------------------


async def test_structured_through_the_openai_adapter_sends_the_schema_and_reads_usage(
    workflow: str,
) -> None:
    bodies: list[dict[str, Any]] = []

    def provider(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        content = '{"label": "question", "urgent": false}' if len(bodies) > 1 else "{oops"
        return httpx.Response(
            200,
            json={
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "m1",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30},
            },
        )

    client = openai.AsyncOpenAI(
        base_url="http://model.test/v1",
        api_key="test",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(provider)),
    )
    async with OpenAICompatible(client, "m1") as llm:
        m = model(llm, workflow, model_name=llm.model)
        result = await m.structured(Triage, "Why?", system="Triage.")
    assert result == Triage(label="question", urgent=False)
    assert len(bodies) == 2
    assert bodies[0]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Triage", "schema": Triage.model_json_schema()},
    }
    assert bodies[0]["messages"] == [
        {"role": "system", "content": "Triage."},
        {"role": "user", "content": "Why?"},
    ]
    assert m.usage == Usage(prompt_tokens=42, completion_tokens=18, model_calls=2)
    assert (tokens(workflow, "prompt"), tokens(workflow, "completion")) == (42, 18)
    assert invalid_outputs(workflow) == 1
