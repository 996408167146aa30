"""Prices with the provider's cache (docs/model-routing.md): ONCELY_LLM_PRICES
reads a cache-read and a cache-write price per model; a call's cost prices
its cached reads and cache writes apart, and the ledger keeps what the cache
saved; the usage report groups by dialect and adds the cache's tokens and
savings. Claude's calls go through the Anthropic adapter to the fake model
over HTTP; the ledger is real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from oncely.fakes.llm import FakeLLMServer
from oncely.llm.anthropic_messages import AnthropicMessages
from oncely.llm.model import Model, ModelRoute
from oncely.retry import RetryPolicy
from oncely.settings import Settings
from oncely.usage.calls import Call, CallSite
from oncely.usage.ledger import Ledger, usage_report
from oncely.usage.prices import Price, Prices
from tests.helpers import delivery_model, rows

CLAUDE = "claude-fake"
FAST = RetryPolicy(per_call_timeout_s=2.0, max_attempts=2, backoff_base_s=0.001, backoff_max_s=0.01)
SINCE = datetime(2000, 1, 1, tzinfo=UTC)
M = 1_000_000


# --- reading prices ---------------------------------------------------------------------


def test_prices_read_input_output_and_the_caches_read_and_write_prices() -> None:
    prices = Prices.parse("gpt-4.1=2/8, claude-x=3/15/0.30/3.75 ,gpt-mini=0.4/1.6/0.1,w=1/2//1.25")
    assert prices.by_model == {
        "gpt-4.1": Price(2, 8),
        "claude-x": Price(3, 15, cached=0.30, cache_write=3.75),
        "gpt-mini": Price(0.4, 1.6, cached=0.1),
        "w": Price(1, 2, cached=None, cache_write=1.25),
    }
    assert Prices.parse("").by_model == {} and Prices.parse(" , ").by_model == {}


@pytest.mark.parametrize(
    "bad", ["m=1", "m=1/2/3/4/5", "m=1/2/", "m=1/2//", "m=/1/2", "=1/2", "m=1/x", "m=1/-2", "m 1/2"]
)
def test_a_price_that_does_not_read_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match="expected model=input/output") as caught:
        Prices.parse(f"ok=1/2,{bad}")
    assert repr(bad) in str(caught.value)


def test_the_setting_refuses_a_bad_price_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_LLM_PRICES", "claude-x=3/15/0.3/3.75/9")
    with pytest.raises(ValidationError, match="cache write"):
        Settings()
    monkeypatch.setenv("ONCELY_LLM_PRICES", "claude-x=3/15/0.3/3.75")
    assert Settings().llm_prices == "claude-x=3/15/0.3/3.75"


# --- what a call costs ------------------------------------------------------------------


def test_a_calls_cost_prices_cache_reads_and_writes_apart_and_the_savings_net_of_writes() -> None:
    prices = Prices.parse("claude-x=3/15/0.30/3.75,plain=2/8,reads=2/8/0.5")
    # 1000 prompt tokens: 200 read from the cache, 300 written to it, 500 plain.
    assert prices.cost("claude-x", 1000, 100, 200, 300) == pytest.approx(
        (500 * 3 + 200 * 0.30 + 300 * 3.75 + 100 * 15) / M
    )
    assert prices.cache_saved("claude-x", 1000, 200, 300) == pytest.approx(
        (200 * (3 - 0.30) - 300 * (3.75 - 3)) / M
    )
    # Writes alone cost more than the prompt at the input price.
    assert prices.cache_saved("claude-x", 1000, 0, 1000) == pytest.approx(-1000 * 0.75 / M)
    # Without cache prices, the cache's tokens cost as any input, saving nothing.
    assert prices.cost("plain", 1000, 100, 200, 300) == pytest.approx((1000 * 2 + 100 * 8) / M)
    assert prices.cache_saved("plain", 1000, 200, 300) == 0
    # A read price and no write price: writes cost as input.
    assert prices.cost("reads", 1000, 0, 200, 300) == pytest.approx((800 * 2 + 200 * 0.5) / M)
    # Counts past the prompt never price more tokens than it had.
    assert prices.cost("claude-x", 100, 0, 80, 80) == pytest.approx((80 * 0.30 + 20 * 3.75) / M)
    # Unpriced: unknown, never zero.
    assert prices.cost("unknown", 10, 10, 5, 5) is None
    assert prices.cache_saved("unknown", 10, 5, 5) is None
    # The old three-argument form reads as before.
    assert prices.cost("reads", 1000, 100, 200) == pytest.approx((800 * 2 + 200 * 0.5 + 800) / M)


@pytest.fixture
async def claude(fake_llm: FakeLLMServer) -> AsyncIterator[AnthropicMessages]:
    async with AnthropicMessages.connect(fake_llm.url, "test", CLAUDE) as adapter:
        yield adapter


def on_claude(claude: AnthropicMessages, ledger: Ledger) -> Model:
    return delivery_model(claude, CLAUDE, "prices", FAST, ModelRoute(ledger=ledger), deadline_s=20)


async def ledger_rows(pool: Any) -> list[tuple[Any, ...]]:
    return await rows(
        pool,
        "SELECT dialect, prompt_tokens, completion_tokens, cached_tokens, cache_write_tokens,"
        " cost_usd::float8, cache_saved_usd::float8 FROM model_calls ORDER BY id",
    )


async def test_claudes_cache_writes_and_reads_are_priced_in_the_usage_and_the_ledger(
    claude, pool
) -> None:
    ledger = Ledger(pool, prices=Prices.parse(f"{CLAUDE}=3/15/0.30/3.75"))
    prompt = "A long preamble every call shares, then the question. [[fake:cache=8]]"
    first, again = on_claude(claude, ledger), on_claude(claude, ledger)
    await first.complete(prompt)
    await again.complete(prompt)
    assert await ledger.flush() == 2
    (d1, p1, c1, r1, w1, cost1, saved1), (d2, p2, c2, r2, w2, cost2, saved2) = await ledger_rows(
        pool
    )
    assert (d1, r1, w1) == ("anthropic", 0, 8) and (d2, r2, w2) == ("anthropic", 8, 0)
    assert p1 > 8 and p2 == p1  # every input token, the cache's included
    assert cost1 == pytest.approx(((p1 - 8) * 3 + 8 * 3.75 + c1 * 15) / M)
    assert cost2 == pytest.approx(((p2 - 8) * 3 + 8 * 0.30 + c2 * 15) / M)
    assert saved1 == pytest.approx(-8 * 0.75 / M)  # the write's premium
    assert saved2 == pytest.approx(8 * 2.70 / M)  # the read's discount
    # The delivery's usage counts the same costs.
    assert first.usage.cost_usd == pytest.approx(cost1)
    assert again.usage.cost_usd == pytest.approx(cost2)


async def test_an_unpriced_model_has_no_cost_and_no_savings_in_the_ledger(claude, pool) -> None:
    ledger = Ledger(pool, prices=Prices.parse("another-model=1/1/0.1/1.25"))
    model = on_claude(claude, ledger)
    await model.complete("Cached but unpriced. [[fake:cache=8]]")
    assert await ledger.flush() == 1
    [(_, _, _, _, written, cost, saved)] = await ledger_rows(pool)
    assert (written, cost, saved) == (8, None, None)
    assert model.usage.cost_usd is None


# --- the report -------------------------------------------------------------------------


async def test_the_usage_report_by_dialect_adds_up_the_caches_tokens_and_savings(pool) -> None:
    prices = Prices.parse("claude-x=3/15/0.30/3.75,gpt-x=2/8/0.5")
    ledger = Ledger(pool, prices=prices)
    site = CallSite("triage", None, "acme")

    def call(model: str, dialect: str, usage: tuple[int, int, int, int]) -> Call:
        prompt, completion, read, written = usage
        return Call(
            site,
            "model",
            model,
            1,
            "ok",
            prompt,
            completion,
            10,
            prices.cost(model, prompt, completion, read, written),
            cached_tokens=read,
            cache_write_tokens=written,
            dialect=dialect,
            cache_saved_usd=prices.cache_saved(model, prompt, read, written),
        )

    ledger.record(call("claude-x", "anthropic", (1000, 100, 0, 900)))
    ledger.record(call("claude-x", "anthropic", (1000, 100, 900, 0)))
    ledger.record(call("gpt-x", "chat", (2000, 50, 1024, 0)))
    ledger.record(call("llama", "chat", (500, 50, 0, 0)))  # unpriced
    assert await ledger.flush() == 4

    by_dialect = {r.group: r for r in await usage_report(pool, since=SINCE, by="dialect")}
    assert set(by_dialect) == {"anthropic", "chat"}
    anthropic, chat = by_dialect["anthropic"], by_dialect["chat"]
    assert (anthropic.calls, anthropic.prompt_tokens, anthropic.completion_tokens) == (2, 2000, 200)
    assert (anthropic.cached_tokens, anthropic.cache_write_tokens) == (900, 900)
    # 900 reads saved 2.70 each; 900 writes cost 0.75 each more than input.
    assert anthropic.cache_saved_usd == pytest.approx(900 * (2.70 - 0.75) / M)
    assert anthropic.cost_usd == pytest.approx(
        (100 * 3 + 900 * 3.75 + 100 * 3 + 900 * 0.30 + 200 * 15) / M
    )
    assert (chat.calls, chat.cached_tokens, chat.cache_write_tokens) == (2, 1024, 0)
    # The unpriced call adds nothing to the cost or the savings.
    assert chat.cache_saved_usd == pytest.approx(1024 * 1.5 / M)
    assert chat.cost_usd == pytest.approx((976 * 2 + 1024 * 0.5 + 50 * 8) / M)
    assert chat.to_json("dialect") == {
        "dialect": "chat",
        "calls": 2,
        "prompt_tokens": 2500,
        "completion_tokens": 100,
        "cost_usd": chat.cost_usd,
        "wasted_calls": 2,  # no checkpoint kept either answer
        "cached_tokens": 1024,
        "cache_write_tokens": 0,
        "cache_saved_usd": chat.cache_saved_usd,
        "lane_saved_usd": None,  # every call on the standard lane, recorded without it
    }

    by_model = {r.group: r for r in await usage_report(pool, since=SINCE, by="model")}
    assert by_model["llama"].cache_saved_usd is None and by_model["llama"].cost_usd is None
    assert by_model["gpt-x"].cache_saved_usd == pytest.approx(1024 * 1.5 / M)

    console = await usage_report(pool, since=SINCE, by="workflow/dialect/model")
    assert [r.group for r in console] == [
        "triage/anthropic/claude-x",
        "triage/chat/gpt-x",
        "triage/chat/llama",
    ]


async def test_rows_from_before_savings_were_kept_count_as_unknown_savings(pool) -> None:
    """A row written before migration 0019 has no ``cache_saved_usd``: its
    group's savings are unknown unless another of its rows has one."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO model_calls (workflow, tenant, model, attempt, outcome, prompt_tokens,"
            " completion_tokens, latency_ms, cost_usd, cached_tokens, dialect, created_at)"
            " VALUES ('old', 'acme', 'gpt-x', 1, 'ok', 100, 10, 5, 0.001, 50, 'chat', now())"
        )
    [row] = await usage_report(pool, since=SINCE, by="workflow")
    assert (row.group, row.cached_tokens, row.cache_write_tokens) == ("old", 50, 0)
    assert row.cache_saved_usd is None and row.cost_usd == pytest.approx(0.001)
