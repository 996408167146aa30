"""The fake model over real HTTP: structured output derived from the prompt,
the ``badjson`` fault in the scripted order, usage over all messages, and the
``v2`` model's deterministic difference."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime
from enum import Enum
from typing import Any, Literal
from uuid import UUID

import httpx
import pytest
from pydantic import BaseModel, Field, ValidationError
from typer.testing import CliRunner

from oncely.cli.commands import app as cli
from oncely.fakes.faults import parse_rates
from oncely.fakes.llm import RANDOM_FAULTS, FakeLLMServer


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


# --- random faults ------------------------------------------------------------------


async def outcomes(fake: FakeLLMServer, texts: list[str], **kw: Any) -> list[str]:
    """What each call met: the status, or ``badjson`` for a 200 that is not the answer."""
    seen = []
    async with httpx.AsyncClient(base_url=fake.url, timeout=5) as http:
        for text in texts:
            response = await chat(http, text, **kw)
            bad = response.status_code == 200 and content_of(response) == "not json"
            seen.append("badjson" if bad else str(response.status_code))
    return seen


async def test_random_faults_are_reproducible_with_a_seed_whatever_the_order_of_calls() -> None:
    rates = {"429": 0.2, "503": 0.2, "badjson": 0.2}
    texts = [f"Prompt {n % 7}." for n in range(60)]
    async with FakeLLMServer(faults=rates, seed=3) as a, FakeLLMServer(faults=rates, seed=3) as b:
        forward = await outcomes(a, texts)
        # The other fake sees each prompt's calls in the same order, the
        # prompts interleaved differently.
        by_prompt = sorted(range(60), key=lambda n: (n % 7, n))
        backward = await outcomes(b, [texts[n] for n in by_prompt])
    async with FakeLLMServer(faults=rates, seed=4) as c:
        other_seed = await outcomes(c, texts)

    assert [forward[n] for n in by_prompt] == backward
    assert other_seed != forward
    assert {"429", "503", "badjson", "200"} <= set(forward)


async def test_random_faults_meet_their_rates_and_are_counted_per_prompt_and_in_total() -> None:
    rates = {"429": 0.1, "503": 0.1, "badjson": 0.1}
    async with FakeLLMServer(faults=rates, seed=1) as fake:
        seen = await outcomes(fake, [f"Distinct prompt {n}." for n in range(600)])
        stats = fake.stats()

    for kind in ("429", "503", "badjson"):
        assert 30 <= seen.count(kind) <= 90, (kind, seen.count(kind))
    assert stats.random_faults == {k: seen.count(k) for k in ("429", "503", "badjson")}
    assert sum(p.billed for p in stats.prompts) == seen.count("200")
    assert sum(p.faults.get("503", 0) for p in stats.prompts) == seen.count("503")
    assert "random_faults" in stats.to_json()


async def test_a_random_429_carries_retry_after_and_a_random_503_does_not() -> None:
    async with (
        FakeLLMServer(faults={"429": 1.0}) as busy,
        FakeLLMServer(faults={"503": 1.0}) as down,
    ):
        async with httpx.AsyncClient(base_url=busy.url) as http:
            limited = await chat(http, "Too many.")
        async with httpx.AsyncClient(base_url=down.url) as http:
            unavailable = await chat(http, "Gone.")

    assert (limited.status_code, limited.headers["Retry-After"]) == (429, "1")
    assert unavailable.status_code == 503 and "Retry-After" not in unavailable.headers


async def test_a_random_badjson_is_invalid_for_the_schema_asked_for() -> None:
    async with FakeLLMServer(faults={"badjson": 1.0}) as fake:
        async with httpx.AsyncClient(base_url=fake.url) as http:
            response = await chat(http, "Structured please.", schema=Triage)
        [prompt] = fake.stats().prompts

    assert content_of(response) == '{"oops": '
    assert (prompt.count, prompt.billed, prompt.faults) == (1, 0, {"badjson": 1})


async def test_a_slow_call_takes_slow_s_then_answers_as_usual() -> None:
    async with FakeLLMServer(faults={"slow": 1.0}, slow_s=0.3) as fake:
        async with httpx.AsyncClient(base_url=fake.url) as http:
            started = time.monotonic()
            response = await chat(http, TICKET_TEXT)
            took = time.monotonic() - started
        stats = fake.stats()

    assert content_of(response) == TICKET_SUMMARY
    assert took >= 0.3
    assert (stats.random_faults, stats.prompts[0].billed) == ({"slow": 1}, 1)


async def test_a_slow_call_is_billed_even_if_the_client_leaves_before_the_answer() -> None:
    async with FakeLLMServer(faults={"slow": 1.0}, slow_s=0.5) as fake:
        async with httpx.AsyncClient(base_url=fake.url, timeout=0.1) as http:
            with pytest.raises(httpx.TimeoutException):
                await chat(http, "Generating at length.")
        [prompt] = fake.stats().prompts

    assert (prompt.count, prompt.billed, prompt.faults) == (1, 1, {"slow": 1})


async def test_billed_calls_name_the_client_port_they_came_from(fake: FakeLLMServer) -> None:
    """Which process paid for a call: a soak matches ports to the processes it killed."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Who paid?"}]})
    host, port = fake.root_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n{body}".encode()
    )
    answer = await reader.read()
    client_port = writer.get_extra_info("sockname")[1]
    writer.close()

    assert answer.startswith(b"HTTP/1.1 200")
    [prompt] = fake.stats().prompts
    assert (prompt.billed, prompt.billed_ports) == (1, [client_port])


async def test_faults_name_the_client_port_they_were_served_to() -> None:
    async with FakeLLMServer(faults={"503": 1.0}) as fake:
        await outcomes(fake, ["Down.", "Down."])
        [prompt] = fake.stats().prompts

    assert prompt.faults == {"503": 2}
    [ports] = prompt.fault_ports.values()
    assert len(ports) == 2 and all(ports) and not prompt.billed_ports


@pytest.mark.parametrize("kind", ["hang", "drip"])
async def test_a_random_hang_or_drip_never_completes(kind: str) -> None:
    async with FakeLLMServer(faults={kind: 1.0}) as fake:
        async with httpx.AsyncClient(base_url=fake.url, timeout=0.3) as http:
            with pytest.raises(httpx.TimeoutException):
                response = await chat(http, "Waiting.")
                await response.aread()
        [prompt] = fake.stats().prompts

    assert (prompt.billed, prompt.faults) == (0, {kind: 1})


async def test_a_scripted_fault_wins_over_a_random_one() -> None:
    async with FakeLLMServer(faults={"503": 1.0}) as fake:
        seen = await outcomes(fake, ["Refused. [[fake:400]]", "Refused. [[fake:400]]"])

    assert seen == ["400", "400"]
    assert fake.stats().random_faults == {}


async def test_fault_rate_still_fails_that_share_with_429_or_503() -> None:
    async with FakeLLMServer(fault_rate=1.0, seed=5) as fake:
        seen = await outcomes(fake, [f"Any {n}." for n in range(40)])

    assert set(seen) == {"429", "503"}


def test_fault_rates_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown fault 'boom'"):
        FakeLLMServer(faults={"boom": 0.1})
    with pytest.raises(ValueError, match="more than 1"):
        FakeLLMServer(faults={"429": 0.6, "503": 0.6})
    with pytest.raises(ValueError, match="between 0 and 1"):
        FakeLLMServer(faults={"slow": -0.1})


def test_faults_option_parses_kind_equals_rate_and_refuses_nonsense() -> None:
    assert parse_rates(" 429=0.05, slow=0.1 ,", RANDOM_FAULTS) == {"429": 0.05, "slow": 0.1}
    assert parse_rates("", RANDOM_FAULTS) == {}
    for bad, message in [
        ("429", "kind=rate"),
        ("429=lots", "must be a number"),
        ("429=0.1,429=0.2", "twice"),
        ("teapot=0.1", "unknown fault"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_rates(bad, RANDOM_FAULTS)


def test_fake_llm_command_refuses_bad_faults_as_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["fake-llm", "--faults", "429=0.9,503=0.9"])

    assert result.exit_code == 2
    assert "more than 1" in result.output
