"""Cheaper lanes (docs/lanes.md): the flex lane. A flex call goes with
``service_tier: "flex"`` and the longer flex timeout, through the real
adapters to the fake model over HTTP; a 429 for lack of flex capacity falls
back to the standard tier once the flex retries are used; the ledger (real
PostgreSQL) names each attempt's lane and prices it at the lane's price,
half the standard one unless given; the usage report groups by lane."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel

from oncely.fakes.llm import FakeLLMServer
from oncely.llm.anthropic_messages import AnthropicMessages
from oncely.llm.base import LLM
from oncely.llm.lean import LeanOpenAICompatible
from oncely.llm.model import Model, ModelRoute
from oncely.llm.openai_compat import OpenAICompatible
from oncely.llm.openai_responses import OpenAIResponses
from oncely.retry import Deadline, RetryPolicy
from oncely.usage.ledger import Ledger, usage_report
from oncely.usage.prices import Price, Prices
from oncely.workflow import Workflow
from tests.helpers import delivery_model, rows

MODEL = "gpt-fake"
FAST = RetryPolicy(
    per_call_timeout_s=2.0,
    max_attempts=2,
    backoff_base_s=0.001,
    backoff_max_s=0.01,
    retry_after_max_s=0.01,
)
SINCE = datetime(2000, 1, 1, tzinfo=UTC)
M = 1_000_000
PRICES = f"{MODEL}=2/8"


# --- prices per lane --------------------------------------------------------------------


def test_a_lane_has_its_own_price_or_half_the_standard_one() -> None:
    prices = Prices.parse("m=2/8/0.5/2.5,m@batch=0.8/3,other=1/1")
    assert prices.price("m") == Price(2, 8, 0.5, 2.5)
    assert prices.price("m", "batch") == Price(0.8, 3)
    assert prices.price("m", "flex") == Price(1, 4, 0.25, 1.25)  # half, cache prices too
    assert prices.cost("m", 1000, 100, lane="flex") == pytest.approx((1000 * 1 + 100 * 4) / M)
    assert prices.cost("m", 1000, 100, lane="batch") == pytest.approx((1000 * 0.8 + 300) / M)
    assert prices.lane_saved("m", "flex", 1000, 100) == pytest.approx((1000 * 1 + 100 * 4) / M)
    assert prices.lane_saved("m", "standard", 1000, 100) == 0
    assert prices.cost("unpriced", 1, 1, lane="flex") is None
    assert prices.lane_saved("unpriced", "flex", 1, 1) is None


@pytest.mark.parametrize("bad", ["m@standard=1/2", "m@fast=1/2", "@batch=1/2"])
def test_a_price_for_a_lane_that_is_none_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="model@flex=") as caught:
        Prices.parse(bad)
    assert repr(bad) in str(caught.value)


def test_a_lane_that_is_none_is_refused_by_the_workflow_and_the_call() -> None:
    class In(BaseModel):
        text: str

    async def step(request: In, ctx: Any) -> In:
        return request

    with pytest.raises(ValueError, match="lane 'fast'"):
        Workflow("w", "/v1/w", In, In, step, lane="fast")  # type: ignore[arg-type]
    assert Workflow("w", "/v1/w", In, In, step, lane="flex").lane == "flex"


# --- flex over HTTP ---------------------------------------------------------------------


@pytest.fixture(params=["openai", "lean"])
async def chat(request: pytest.FixtureRequest, fake_llm: FakeLLMServer) -> AsyncIterator[LLM]:
    client = OpenAICompatible if request.param == "openai" else LeanOpenAICompatible
    async with client.connect(fake_llm.url, "test", MODEL) as adapter:
        yield adapter


def on(llm: LLM, ledger: Ledger, *, lane: Any = "standard", flex_timeout_s: float = 900.0) -> Model:
    route = ModelRoute(ledger=ledger, lane=lane, flex_timeout_s=flex_timeout_s)
    return delivery_model(llm, MODEL, "lanes", FAST, route)


async def ledger_rows(pool: Any) -> list[tuple[Any, ...]]:
    return await rows(
        pool,
        "SELECT lane, dialect, outcome, prompt_tokens, completion_tokens, cost_usd::float8,"
        " lane_saved_usd::float8 FROM model_calls ORDER BY id",
    )


def fallbacks() -> float:
    labels = {"workflow": "lanes", "model": MODEL}
    return REGISTRY.get_sample_value("oncely_model_flex_fallbacks_total", labels) or 0.0


async def test_a_flex_call_asks_the_flex_tier_and_is_recorded_at_half_price(
    chat: LLM, fake_llm: FakeLLMServer, pool: Any
) -> None:
    ledger = Ledger(pool, prices=Prices.parse(PRICES))
    model = on(chat, ledger)
    text = await model.complete("Flex please. It can wait.", lane="flex")
    assert text
    assert fake_llm.stats().tiers == {"flex": 1}
    assert await ledger.flush() == 1
    [(lane, dialect, outcome, prompt, completion, cost, saved)] = await ledger_rows(pool)
    assert (lane, dialect, outcome) == ("flex", "chat", "ok")
    assert cost == pytest.approx((prompt * 1 + completion * 4) / M)
    assert saved == pytest.approx((prompt * 1 + completion * 4) / M)
    assert model.usage.cost_usd == pytest.approx(cost)
    # A standard call asks no tier and pays the standard price.
    await on(chat, ledger).complete("Standard, now.")
    assert fake_llm.stats().tiers == {"flex": 1, "default": 1}


async def test_the_routes_lane_is_every_calls_unless_one_says_otherwise(
    chat: LLM, fake_llm: FakeLLMServer, pool: Any
) -> None:
    ledger = Ledger(pool)
    model = on(chat, ledger, lane="flex")
    await model.complete("The workflow's lane. One.")
    await model.complete("This one is urgent. Two.", lane="standard")
    assert fake_llm.stats().tiers == {"flex": 1, "default": 1}
    assert await ledger.flush() == 2
    assert [row[0] for row in await ledger_rows(pool)] == ["flex", "standard"]


async def test_no_flex_capacity_falls_back_to_the_standard_tier_once_its_retries_are_used(
    chat: LLM, fake_llm: FakeLLMServer, pool: Any
) -> None:
    ledger = Ledger(pool, prices=Prices.parse(PRICES))
    model = on(chat, ledger)
    before = fallbacks()
    text = await model.complete("No flex capacity today. [[fake:busy]]", lane="flex")
    assert text and "fake:busy" not in text
    # Both flex attempts (FAST: 2) met no capacity, then one standard call answered.
    assert fake_llm.stats().tiers == {"flex": 2, "default": 1}
    [prompt] = fake_llm.stats().prompts
    assert prompt.faults == {"busy": 2} and prompt.billed == 1
    assert fallbacks() == before + 1
    assert await ledger.flush() == 3
    rows = await ledger_rows(pool)
    assert [(r[0], r[2]) for r in rows] == [
        ("flex", "retryable"),
        ("flex", "retryable"),
        ("standard", "ok"),
    ]
    assert rows[2][5] == pytest.approx((rows[2][3] * 2 + rows[2][4] * 8) / M)  # full price


async def test_flex_capacity_found_on_a_retry_needs_no_fallback(
    chat: LLM, fake_llm: FakeLLMServer, pool: Any
) -> None:
    ledger = Ledger(pool)
    before = fallbacks()
    await on(chat, ledger).complete("Busy once. [[fake:busy*1]]", lane="flex")
    assert fake_llm.stats().tiers == {"flex": 2}
    assert fallbacks() == before
    assert await ledger.flush() == 2
    assert [(r[0], r[2]) for r in await ledger_rows(pool)] == [
        ("flex", "retryable"),
        ("flex", "ok"),
    ]


async def test_another_failure_on_the_flex_tier_does_not_fall_back(
    chat: LLM, fake_llm: FakeLLMServer, pool: Any
) -> None:
    """Only a lack of capacity sends a flex call to the standard tier: a
    permanent failure ends it where it is."""
    with pytest.raises(Exception, match="400"):
        await on(chat, Ledger(pool)).complete("Bad request. [[fake:400]]", lane="flex")
    assert fake_llm.stats().tiers == {"flex": 1}


async def test_a_flex_attempt_has_the_longer_flex_timeout(
    chat: LLM, fake_llm: FakeLLMServer, pool: Any
) -> None:
    """FAST gives an attempt 2 s; a flex one gets the route's 6 s, enough
    for an answer that takes 3."""
    model = on(chat, Ledger(pool), flex_timeout_s=6.0)
    assert await model.complete("Slow flex. [[fake:sleep=3]]", lane="flex")
    [prompt] = fake_llm.stats().prompts
    assert prompt.count == 1 and prompt.abandoned == 0


async def test_the_responses_dialect_takes_the_flex_tier(
    fake_llm: FakeLLMServer, pool: Any
) -> None:
    ledger = Ledger(pool)
    async with OpenAIResponses.connect(fake_llm.url, "test", MODEL) as responses:
        model = on(responses, ledger)
        # A flex attempt's long timeout would put it in background mode with
        # a background_s; the route here has none, so it is sent plainly.
        await model.complete("Responses on flex. [[fake:busy*1]]", lane="flex")
    assert fake_llm.stats().tiers == {"flex": 2}
    assert await ledger.flush() == 2
    assert [(r[0], r[1], r[2]) for r in await ledger_rows(pool)] == [
        ("flex", "responses", "retryable"),
        ("flex", "responses", "ok"),
    ]


async def test_a_dialect_without_a_flex_tier_asks_at_its_standard_one(
    fake_llm: FakeLLMServer, pool: Any
) -> None:
    ledger = Ledger(pool)
    async with AnthropicMessages.connect(fake_llm.url, "test", "claude-fake") as claude:
        model = Model(
            claude,
            policy=FAST,
            deadline=Deadline.after(30),
            workflow="lanes",
            model_name="claude-fake",
            route=ModelRoute(ledger=ledger, lane="flex"),
        )
        await model.complete("Claude has no flex tier.")
    assert fake_llm.stats().tiers == {}
    assert fake_llm.stats().dialects == {"anthropic": 1}
    assert await ledger.flush() == 1
    assert [(r[0], r[1]) for r in await ledger_rows(pool)] == [("standard", "anthropic")]


async def test_a_call_on_a_lane_that_is_none_fails_before_it_is_sent(
    chat: LLM, fake_llm: FakeLLMServer, pool: Any
) -> None:
    with pytest.raises(ValueError, match="lane 'fast'"):
        await on(chat, Ledger(pool)).complete("Never sent.", lane="fast")  # type: ignore[arg-type]
    assert fake_llm.stats().total == 0


# --- the report -------------------------------------------------------------------------


async def test_the_usage_report_by_lane_shows_spend_and_savings(
    chat: LLM, fake_llm: FakeLLMServer, pool: Any
) -> None:
    ledger = Ledger(pool, prices=Prices.parse(PRICES))
    await on(chat, ledger).complete("Flex one. Cheap.", lane="flex")
    await on(chat, ledger).complete("Flex two. Cheap.", lane="flex")
    await on(chat, ledger).complete("Standard one. Full price.")
    assert await ledger.flush() == 3
    rows = await ledger_rows(pool)
    by_lane = {r.group: r for r in await usage_report(pool, since=SINCE, by="lane")}
    assert set(by_lane) == {"flex", "standard"}
    flex, standard = by_lane["flex"], by_lane["standard"]
    assert flex.calls == 2 and standard.calls == 1
    assert flex.cost_usd == pytest.approx(rows[0][5] + rows[1][5])
    # The flex calls saved what they cost (half price); the standard one nothing.
    assert flex.lane_saved_usd == pytest.approx(flex.cost_usd)
    assert standard.lane_saved_usd == pytest.approx(0)
    assert flex.to_json("lane")["lane_saved_usd"] == flex.lane_saved_usd
