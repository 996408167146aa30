"""The fake model over real HTTP: structured output derived from the prompt,
the ``badjson`` fault in the scripted order, usage over all messages, and the
``v2`` model's deterministic difference."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime
from enum import Enum
from typing import Any, Literal
from uuid import UUID

import httpx
import pytest
from pydantic import BaseModel, Field, ValidationError

from oncely.fakes.llm import FakeLLMServer


class Severity(Enum):
    LOW = "low"
    HIGH = "high"
    URGENT = "urgent"


class Contact(BaseModel):
    name: str
    replies: int


class Ticket(BaseModel):
    category: Literal["billing", "bug", "other"]
    severity: Severity
    title: str = Field(max_length=20)
    escalate: bool
    count: int
    score: float = Field(ge=0.5)
    contact: Contact
    note: str | None = None
    tags: list[str]


class Bounded(BaseModel):
    code: str = Field(min_length=60)
    positive: int = Field(gt=0)
    at_least: int = Field(ge=3)
    ratio: float = Field(gt=0, lt=0.5)
    negative: int = Field(le=-2)
    contacts: list[Contact] = Field(min_length=2)
    pair: tuple[int, bool]
    when: datetime
    ident: UUID
    kind: Literal["fixed"]


class Node(BaseModel):
    label: str
    next: Node | None = None
    children: list[Node] = []


class Triage(BaseModel):
    severity: Severity


TICKET_TEXT = "The bug blocks billing. Severity is urgent! Please look today."
TICKET_SUMMARY = "The bug blocks billing. Severity is urgent!"


@pytest.fixture
async def fake() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
async def http(fake: FakeLLMServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fake.url) as client:
        yield client


async def chat(
    http: httpx.AsyncClient,
    text: str,
    *,
    schema: type[BaseModel] | None = None,
    model: str = "oncely-fake",
    system: str | None = None,
) -> httpx.Response:
    messages = [{"role": "user", "content": text}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    body: dict[str, Any] = {"model": model, "messages": messages}
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": schema.__name__, "schema": schema.model_json_schema()},
        }
    return await http.post("/chat/completions", json=body)


def content_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


async def structured(http: httpx.AsyncClient, text: str, schema: type[BaseModel], **kw: Any) -> Any:
    return json.loads(content_of(await chat(http, text, schema=schema, **kw)))


# --- plain text and usage -----------------------------------------------------------


async def test_plain_answer_is_the_first_two_sentences_with_usage_over_all_messages(
    http: httpx.AsyncClient,
) -> None:
    system = "You summarise texts for busy people."
    response = await chat(http, TICKET_TEXT, system=system)

    content = content_of(response)
    assert content == TICKET_SUMMARY
    prompt_tokens = (len(system) + len(TICKET_TEXT)) // 4 + 1
    completion_tokens = len(content) // 4 + 1
    assert response.json()["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def test_faults_count_per_last_user_message_whatever_the_system_message(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    text = "Shared prompt. [[fake:503*1]]"

    first = await chat(http, text, system="Instructions A.")
    second = await chat(http, text, system="Other instructions B.")

    assert (first.status_code, second.status_code) == (503, 200)
    assert [p.count for p in fake.stats("Shared prompt").prompts] == [2]


# --- structured output --------------------------------------------------------------


async def test_schema_answer_is_valid_for_the_pydantic_model_and_derived_from_the_prompt(
    http: httpx.AsyncClient,
) -> None:
    response = await chat(http, TICKET_TEXT, schema=Ticket)
    content = content_of(response)

    Ticket.model_validate_json(content)
    assert json.loads(content) == {
        "category": "billing",
        "severity": "urgent",
        "title": TICKET_SUMMARY[:20],
        "escalate": False,
        "count": 0,
        "score": 0.5,
        "contact": {"name": TICKET_SUMMARY, "replies": 0},
        "note": TICKET_SUMMARY,
        "tags": [],
    }
    assert response.json()["usage"]["completion_tokens"] == len(content) // 4 + 1


async def test_enum_takes_the_first_declared_value_mentioned_not_the_first_in_the_text(
    http: httpx.AsyncClient,
) -> None:
    answer = await structured(http, "An URGENT matter, high stakes.", Triage)

    assert answer == {"severity": "high"}


async def test_enum_without_a_mentioned_value_takes_the_first_value(
    http: httpx.AsyncClient,
) -> None:
    answer = await structured(http, "Nothing to classify here.", Triage)

    assert answer == {"severity": "low"}


async def test_bounds_formats_tuples_and_min_items_are_respected(
    http: httpx.AsyncClient,
) -> None:
    answer = await structured(http, "Short one.", Bounded)

    Bounded.model_validate(answer)
    assert len(answer["code"]) >= 60
    assert answer["code"].startswith("Short one. Short one.")
    assert (answer["positive"], answer["at_least"], answer["negative"]) == (1, 3, -2)
    assert answer["ratio"] == 0.25
    assert answer["contacts"] == [{"name": "Short one.", "replies": 0}] * 2
    assert answer["pair"] == [0, False]
    assert answer["kind"] == "fixed"


async def test_a_model_that_may_contain_itself_ends_in_null(http: httpx.AsyncClient) -> None:
    answer = await structured(http, "A tree.", Node)

    assert answer == {"label": "A tree.", "next": None, "children": []}


async def test_one_prompt_answers_each_schema_it_is_asked_with(http: httpx.AsyncClient) -> None:
    triage = await structured(http, TICKET_TEXT, Triage)
    plain = content_of(await chat(http, TICKET_TEXT))
    ticket = await structured(http, TICKET_TEXT, Ticket)

    assert triage == {"severity": "urgent"}
    assert plain == TICKET_SUMMARY
    assert ticket["category"] == "billing"


async def test_unresolvable_ref_is_a_400(http: httpx.AsyncClient) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Broken schema."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/Missing"}},
        },
    }
    response = await http.post("/chat/completions", json=body)

    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


# --- badjson ------------------------------------------------------------------------


async def test_badjson_answers_200_with_truncated_json_for_n_calls_then_valid(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    text = "Flaky JSON. [[fake:badjson*2]]"

    answers = [await chat(http, text, schema=Triage) for _ in range(3)]

    assert [r.status_code for r in answers] == [200, 200, 200]
    for bad in answers[:2]:
        assert content_of(bad) == '{"oops": '
        assert "usage" in bad.json()
        with pytest.raises(ValidationError):
            Triage.model_validate_json(content_of(bad))
    assert Triage.model_validate_json(content_of(answers[2])) == Triage(severity=Severity.LOW)
    assert [p.count for p in fake.stats("Flaky JSON").prompts] == [3]


async def test_badjson_runs_in_the_order_written_with_status_faults(
    http: httpx.AsyncClient,
) -> None:
    text = "Ordered. [[fake:503*1]] [[fake:badjson*1]]"

    answers = [await chat(http, text, schema=Triage) for _ in range(3)]

    assert [r.status_code for r in answers] == [503, 200, 200]
    assert content_of(answers[1]) == '{"oops": '
    assert json.loads(content_of(answers[2])) == {"severity": "low"}


async def test_badjson_without_a_count_fails_every_call_and_without_a_schema_is_not_json(
    http: httpx.AsyncClient,
) -> None:
    text = "Always broken. [[fake:badjson]]"

    contents = [content_of(await chat(http, text)) for _ in range(3)]

    assert contents == ["not json"] * 3


# --- the v2 model -------------------------------------------------------------------


async def test_v2_model_takes_the_second_mentioned_enum_value(http: httpx.AsyncClient) -> None:
    text = "High stakes, urgent, not low at all."

    v1 = await structured(http, text, Triage)
    v2 = await structured(http, text, Triage, model="oncely-fake-v2")

    assert (v1, v2) == ({"severity": "low"}, {"severity": "high"})


async def test_v2_model_with_one_mentioned_value_takes_it_and_with_none_the_first(
    http: httpx.AsyncClient,
) -> None:
    one = await structured(http, "It is urgent.", Triage, model="fake-v2")
    none = await structured(http, "Nothing here.", Triage, model="fake-v2")

    assert (one, none) == ({"severity": "urgent"}, {"severity": "low"})


async def test_v2_model_summarises_in_one_sentence(http: httpx.AsyncClient) -> None:
    v1 = content_of(await chat(http, TICKET_TEXT))
    v2 = content_of(await chat(http, TICKET_TEXT, model="oncely-fake-v2"))

    assert (v1, v2) == (TICKET_SUMMARY, "The bug blocks billing.")
