"""Routes that mix dialects (docs/providers.md): an ``anthropic:`` primary
with a ``chat:`` fallback, through the worker's own composition
(``WorkerGroup``: the settings, the route, the fleet limiter, the cooldown,
the ledger) against the fake model over HTTP, with real Redis and
PostgreSQL. The adapter suite runs every dialect: tests/test_llm_adapter.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel

from oncely import names
from oncely.bootstrap import Resources, WorkerGroup, connect_llm
from oncely.builtin import app as builtin_app
from oncely.errors import ProviderQuota, Refused
from oncely.fakes.llm import FakeLLMServer
from oncely.llm.anthropic_messages import AnthropicMessages
from oncely.llm.base import Message
from oncely.llm.limiter import FleetLimiter, LimitedLLM, Limits
from oncely.llm.model import Model, ModelRoute
from oncely.llm.openai_compat import OpenAICompatible
from oncely.llm.routing import ModelSpec, Target, parse_models
from oncely.queue.stream import Stream
from oncely.retry import RetryPolicy
from oncely.settings import Settings
from oncely.usage.ledger import Ledger
from tests.helpers import delivery_model, rows, submit
from tests.processes import wait_for

CLAUDE, BACKUP = "claude-fake", "fake-backup"
FAST = RetryPolicy(per_call_timeout_s=2.0, max_attempts=3, backoff_base_s=0.001, backoff_max_s=0.01)


# --- naming dialects --------------------------------------------------------------------


def test_route_entries_name_their_dialect_and_names_keep_their_colons() -> None:
    assert parse_models("anthropic:claude-x@https://api.anthropic.com/v1,chat:gpt-4.1") == [
        ModelSpec("claude-x", "https://api.anthropic.com/v1", "anthropic"),
        ModelSpec("gpt-4.1", None, "chat"),
    ]
    # Ollama's tags are names, not dialects.
    assert parse_models("llama3:8b,mistral:7b@http://ollama:11434/v1") == [
        ModelSpec("llama3:8b"),
        ModelSpec("mistral:7b", "http://ollama:11434/v1"),
    ]
    assert str(ModelSpec("claude-x", None, "anthropic")) == "anthropic:claude-x"
    assert parse_models("responses:gpt-5") == [ModelSpec("gpt-5", None, "responses")]


def test_the_model_setting_names_the_primarys_dialect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_LLM_MODEL", "anthropic:claude-sonnet")
    s = Settings()
    assert (s.llm_model, s.llm_provider) == ("claude-sonnet", "anthropic")
    monkeypatch.setenv("ONCELY_LLM_PROVIDER", "chat")
    with pytest.raises(ValueError, match="names the anthropic dialect"):
        Settings()
    monkeypatch.setenv("ONCELY_LLM_PROVIDER", "anthropic")
    monkeypatch.setenv("ONCELY_LLM_MODEL", "claude-haiku")
    assert (Settings().llm_model, Settings().llm_provider) == ("claude-haiku", "anthropic")
    monkeypatch.delenv("ONCELY_LLM_PROVIDER")
    monkeypatch.setenv("ONCELY_LLM_MODEL", "responses:gpt-5")
    assert (Settings().llm_model, Settings().llm_provider) == ("gpt-5", "responses")


# --- a mixed route, one model call at a time --------------------------------------------


@pytest.fixture
async def claude(fake_llm: FakeLLMServer) -> AsyncIterator[AnthropicMessages]:
    async with AnthropicMessages.connect(fake_llm.url, "test", CLAUDE) as adapter:
        yield adapter


@pytest.fixture
async def backup(fake_llm: FakeLLMServer) -> AsyncIterator[OpenAICompatible]:
    async with OpenAICompatible.connect(fake_llm.url, "test", BACKUP) as adapter:
        yield adapter


async def ledger_rows(pool: Any) -> list[tuple[Any, ...]]:
    return await rows(
        pool,
        "SELECT model, dialect, attempt, outcome, prompt_tokens, completion_tokens,"
        " cached_tokens, cache_write_tokens FROM model_calls ORDER BY id",
    )


def mixed(claude: AnthropicMessages, backup: OpenAICompatible, ledger: Ledger) -> Model:
    route = ModelRoute((Target(BACKUP, backup),), ledger=ledger)
    return delivery_model(claude, CLAUDE, "dialects", FAST, route, deadline_s=20)


async def test_an_overloaded_anthropic_primary_falls_back_to_chat_and_the_ledger_names_both(
    claude, backup, fake_llm, pool
) -> None:
    fake_llm.model.model_outages[CLAUDE] = "529"
    ledger = Ledger(pool, flush_s=0.05)
    model = mixed(claude, backup, ledger)
    answer = await model.complete("Claude is overloaded. The chat model answers.")
    assert answer == "Claude is overloaded. The chat model answers."
    assert model.usage.model == BACKUP
    assert fake_llm.stats().dialects == {"anthropic": FAST.max_attempts, "chat": 1}
    await ledger.flush()
    assert [r[:4] for r in await ledger_rows(pool)] == [
        (CLAUDE, "anthropic", 1, "retryable"),
        (CLAUDE, "anthropic", 2, "retryable"),
        (CLAUDE, "anthropic", 3, "retryable"),
        (BACKUP, "chat", 4, "ok"),
    ]


async def test_cache_reads_and_writes_reach_the_usage_and_the_ledger(
    claude, backup, fake_llm, pool
) -> None:
    ledger = Ledger(pool, flush_s=0.05)
    prompt = "A long preamble every call shares. [[fake:cache=8]]"
    first, again = mixed(claude, backup, ledger), mixed(claude, backup, ledger)
    await first.complete(prompt)
    await again.complete(prompt)
    assert (first.usage.cache_write_tokens, first.usage.cached_tokens) == (8, 0)
    assert (again.usage.cache_write_tokens, again.usage.cached_tokens) == (0, 8)
    assert again.usage.to_json()["cached_tokens"] == 8
    await ledger.flush()
    assert [(r[1], r[6], r[7]) for r in await ledger_rows(pool)] == [
        ("anthropic", 0, 8),
        ("anthropic", 8, 0),
    ]


async def test_a_refusal_is_refused_in_the_ledger_and_never_falls_back(
    claude, backup, fake_llm, pool
) -> None:
    ledger = Ledger(pool, flush_s=0.05)
    with pytest.raises(Refused):
        await mixed(claude, backup, ledger).complete("Something it declines. [[fake:refusal]]")
    assert fake_llm.stats().dialects == {"anthropic": 1}
    await ledger.flush()
    [(model, dialect, attempt, outcome, prompt, completion, _, _)] = await ledger_rows(pool)
    assert (model, dialect, attempt, outcome) == (CLAUDE, "anthropic", 1, "refused")
    assert prompt > 0 and completion > 0  # billed, as the provider reported


async def test_a_turn_with_tools_and_an_output_schema_on_claude(claude, backup, fake_llm, pool):
    """``respond`` on Claude: parallel tool calls, then a final answer of the
    output schema in the same turn shape (tools still offered: structured
    outputs, not a forced tool, leave ``tool_choice`` to the tools)."""

    class Verdict(BaseModel):
        ok: bool

    ledger = Ledger(pool, flush_s=0.05)
    lookup = {"name": "lookup", "description": "Look up.", "parameters": {"type": "object"}}
    calls = '[[fake:tool=lookup {"id": 1}]] [[fake:tool=lookup {"id": 2}]]'
    first = {"role": "user", "content": f"[[fake:tools=parallel]] {calls}"}
    model = mixed(claude, backup, ledger)
    turn = await model.respond([first], tools=[lookup], output=Verdict)
    assert [(c.id, c.name, c.arguments) for c in turn.tool_calls] == [
        ("call_1", "lookup", {"id": 1}),
        ("call_2", "lookup", {"id": 2}),
    ]
    asked = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.raw_arguments}}
        for c in turn.tool_calls
    ]
    answered = [
        first,
        {"role": "assistant", "content": "", "tool_calls": asked},
        *({"role": "tool", "tool_call_id": c.id, "content": "{}"} for c in turn.tool_calls),
    ]
    final = await model.respond(answered, tools=[lookup], output=Verdict, step="final")
    assert Verdict.model_validate_json(final.text) == Verdict(ok=False)
    assert final.tool_calls == ()
    [request] = [r for r in fake_llm.model.recent if len(r) == 3]
    assert [m["role"] for m in request] == ["user", "assistant", "user"]
    assert [b["type"] for b in request[2]["content"]] == ["tool_result", "tool_result"]
    assert fake_llm.stats().dialects == {"anthropic": 2}


# --- the worker: settings, route, cooldown, ledger, dead letters --------------------------


def quota_alerts(model: str) -> float:
    return REGISTRY.get_sample_value("oncely_model_provider_quota_total", {"model": model}) or 0.0


@pytest.fixture
def mixed_settings(worker_settings: Settings) -> Settings:
    """An Anthropic primary and a chat fallback on the fake (the fallback
    names no endpoint: the primary's, in its own dialect)."""
    return worker_settings.model_copy(
        update={
            "llm_model": CLAUDE,
            "llm_provider": "anthropic",
            "llm_fallbacks": f"chat:{BACKUP}",
            "llm_max_attempts": 3,
            "redelivery_base_s": 0.2,
            "redelivery_max_s": 0.5,
            "block_ms": 50,
        }
    )


@pytest.fixture
async def worker(
    mixed_settings: Settings, redis: Any, pool: Any
) -> AsyncIterator[Callable[[], WorkerGroup]]:
    llm = connect_llm(mixed_settings)
    assert type(llm) is AnthropicMessages  # ONCELY_LLM_PROVIDER picks the dialect
    group = WorkerGroup(builtin_app, Resources(mixed_settings, redis, pool), llm)
    task = asyncio.create_task(group.run())
    try:
        yield lambda: group
    finally:
        group.stop()
        await task
        await llm.aclose()


async def status_of(pool: Any, job_id: str) -> tuple[str, str | None]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status, error FROM jobs WHERE job_id = %s", (job_id,))
        row = await cur.fetchone()
    return (row[0], row[1]) if row else ("", None)


async def armed(redis: Any, model: str) -> list[Any]:
    """What the cooldown holds for ``model`` in Redis: scopes cooling or
    awaiting a probe, and failing jobs counted."""
    scopes = await redis.hgetall(f"oncely:{{cooldown:{model}}}:scopes")
    cooling = [k for k in map(_text, scopes) if k.startswith("u:")]
    counted = await redis.exists(f"oncely:{{cooldown:{model}}}:jobs")
    return [*cooling, *(["jobs"] if counted else [])]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def test_the_worker_falls_back_across_dialects_when_claude_is_overloaded(
    worker, fake_llm, pool, stream: Stream
) -> None:
    fake_llm.model.model_outages[CLAUDE] = "529"
    job = await submit(pool, stream, "An overloaded provider. Another one answers.")

    async def done() -> bool:
        return (await status_of(pool, job))[0] == "done"

    await wait_for(done, what="the job done by the fallback")
    await worker().ledger.flush()
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT model, dialect, outcome FROM model_calls WHERE job_id = %s ORDER BY id", (job,)
        )
        rows = await cur.fetchall()
    assert rows == [
        (CLAUDE, "anthropic", "retryable"),
        (CLAUDE, "anthropic", "retryable"),
        (CLAUDE, "anthropic", "retryable"),
        (BACKUP, "chat", "ok"),
    ]
    assert fake_llm.stats().dialects == {"anthropic": 3, "chat": 1}


async def test_a_dry_account_kills_each_job_on_its_one_call_and_cools_nothing(
    worker, fake_llm, pool, redis, stream: Stream, mixed_settings: Settings
) -> None:
    """More jobs than it takes to trip the cooldown, every one refused for
    want of credit: each dead ``provider-quota`` after one call, the
    fallback never asked, the model not cooled down, the alert counted.
    With credit back, the next job goes straight to Claude."""
    fake_llm.model.model_outages[CLAUDE] = "credit"
    alerts = quota_alerts(CLAUDE)
    jobs = mixed_settings.llm_cooldown_failures + 2
    ids = [await submit(pool, stream, f"No credit for job {i}. It dies.") for i in range(jobs)]

    async def all_dead() -> bool:
        return [(await status_of(pool, i))[0] for i in ids] == ["dead"] * jobs

    await wait_for(all_dead, what="every job dead")
    for job in ids:
        _, error = await status_of(pool, job)
        assert (error or "").startswith("provider-quota: ProviderQuota: model answered 400"), error
    stats = fake_llm.stats()
    assert stats.models == {CLAUDE: jobs} and stats.dialects == {"anthropic": jobs}
    assert [p.count for p in stats.prompts] == [1] * jobs
    assert quota_alerts(CLAUDE) - alerts == jobs
    assert await armed(redis, CLAUDE) == []
    await worker().ledger.flush()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT DISTINCT model, dialect, outcome FROM model_calls")
        assert await cur.fetchall() == [(CLAUDE, "anthropic", "permanent")]

    del fake_llm.model.model_outages[CLAUDE]
    after = await submit(pool, stream, "Credit is back. Claude answers at once.")

    async def done() -> bool:
        return (await status_of(pool, after))[0] == "done"

    await wait_for(done, what="the job after the top-up done")
    assert fake_llm.stats().models == {CLAUDE: jobs + 1}


async def test_a_dry_accounts_429_never_pauses_the_fleet(backup, fake_llm, redis) -> None:
    """OpenAI says a dry account with a 429 (``insufficient_quota``): no
    wait will cure it, so it pauses no worker, as a rate limit's would."""
    fake_llm.model.model_outages[BACKUP] = "credit"
    limited = LimitedLLM(backup, FleetLimiter(redis, Limits()))
    assert limited.dialect == "chat"
    with pytest.raises(ProviderQuota) as raised:
        await limited.complete([Message("user", "No quota left.")], 2.0)
    assert (raised.value.status, raised.value.dead_reason) == (429, "provider-quota")
    assert not await redis.exists(names.LLM_PAUSE)


async def test_a_dry_account_leaves_other_tenants_jobs_on_a_healthy_fallback_unaffected(
    worker, fake_llm, pool, redis, stream: Stream, mixed_settings: Settings
) -> None:
    """Seen from the victims' side (docs/model-routing.md, "The cooldown"):
    one tenant's calls are refused for want of credit (its prompts say so,
    as a spend limit on its own workspace would) while two other tenants
    run on the same route, some of their jobs meeting an overloaded Claude
    and moving to the healthy fallback. The dry tenant's jobs die
    ``provider-quota`` on one call each, never asking the fallback; every
    other job ends done, on Claude at once or on the fallback after its
    retries; the dry jobs count as no failure of the cooldown, so nothing
    cools. Were they counted, the dry tenant would be a third failing
    tenant and the fleet's cooldown would send everyone to the fallback."""
    dry = mixed_settings.llm_cooldown_failures + 2
    attempts = mixed_settings.llm_max_attempts
    died = [
        await submit(pool, stream, f"No credit for job {i}. [[fake:credit]]", tenant="dry")
        for i in range(dry)
    ]
    plain: list[str] = []
    overloaded: list[str] = []
    for tenant in ("acme", "globex"):
        for i in range(2):
            text = f"{tenant} job {i} meets an overloaded Claude. [[fake:529*{attempts}]]"
            overloaded.append(await submit(pool, stream, text, tenant=tenant))
            plain.append(await submit(pool, stream, f"{tenant} job {i}. Claude.", tenant=tenant))

    async def settled() -> bool:
        dead = [(await status_of(pool, j))[0] for j in died]
        done = [(await status_of(pool, j))[0] for j in (*plain, *overloaded)]
        return dead == ["dead"] * dry and done == ["done"] * len(done)

    await wait_for(settled, what="the dry tenant's jobs dead, every other job done")
    for job in died:
        _, error = await status_of(pool, job)
        assert (error or "").startswith("provider-quota: ProviderQuota:"), error
    await worker().ledger.flush()

    async def calls_of(job: str) -> list[tuple[Any, ...]]:
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT model, dialect, outcome FROM model_calls WHERE job_id = %s ORDER BY id",
                (job,),
            )
            return await cur.fetchall()

    for job in died:
        assert await calls_of(job) == [(CLAUDE, "anthropic", "permanent")]
    for job in plain:
        assert await calls_of(job) == [(CLAUDE, "anthropic", "ok")]
    for job in overloaded:
        assert await calls_of(job) == [
            *[(CLAUDE, "anthropic", "retryable")] * attempts,
            (BACKUP, "chat", "ok"),
        ]
    stats = fake_llm.stats()
    assert [p.count for p in fake_llm.stats("[[fake:credit]]").prompts] == [1] * dry
    assert stats.models == {
        CLAUDE: dry + len(plain) + attempts * len(overloaded),
        BACKUP: len(overloaded),
    }
    # The cooldown counted the overloaded jobs' failures, and no dry one.
    failing = await redis.hgetall(names.model_cooldown(CLAUDE)[1])
    assert sorted(map(_text, failing)) == sorted(overloaded)
    assert await armed(redis, CLAUDE) == ["jobs"]
