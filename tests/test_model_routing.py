"""Fallbacks, the fleet's cooldown and the ledger, through the real adapter
against the fake model over HTTP, with real Redis and PostgreSQL
(docs/model-routing.md). The same through worker processes:
tests/test_routing_processes.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel
from redis.asyncio import Redis

from oncely.errors import PermanentError, ResumeLater, TransientError
from oncely.llm.cooldown import Cooldown, CooldownPolicy
from oncely.llm.model import Model, ModelRoute
from oncely.llm.openai_compat import OpenAICompatible
from oncely.llm.routing import Caller, ModelSpec, Target, parse_models
from oncely.retry import RetryPolicy
from oncely.usage.budgets import BudgetLimits, Budgets, Spent, utc_day
from oncely.usage.calls import Call, CallSite
from oncely.usage.ledger import Ledger
from oncely.usage.prices import Prices
from tests.helpers import count, delivery_model, rows
from tests.processes import wait_for

PRIMARY, BACKUP = "oncely-fake", "fake-backup"
FAST = RetryPolicy(per_call_timeout_s=2.0, max_attempts=3, backoff_base_s=0.001, backoff_max_s=0.01)
PRICES = Prices.parse(f"{PRIMARY}=1/4,{BACKUP}=2.5/10")


@pytest.fixture
async def llm(fake_llm) -> AsyncIterator[OpenAICompatible]:
    async with OpenAICompatible.connect(fake_llm.url, "test", PRIMARY) as adapter:
        yield adapter


@pytest.fixture
def cooldown(redis) -> Cooldown:
    # Its own model names per test would do too; the keys are the fleet's.
    return Cooldown(redis, CooldownPolicy(failures=3, window_s=30, cooldown_s=60, refresh_s=0.05))


@pytest.fixture
def ledger(pool) -> Ledger:
    return Ledger(pool, prices=PRICES, flush_s=0.05)


def routed(
    llm: OpenAICompatible,
    *,
    cooldown: Cooldown | None = None,
    ledger: Ledger | None = None,
    fallbacks: tuple[str, ...] = (BACKUP,),
    policy: RetryPolicy = FAST,
    job: str | None = None,
    tenant: str = "acme",
) -> Model:
    targets = tuple(Target(name, llm.with_model(name)) for name in fallbacks)
    route = ModelRoute(targets, cooldown, ledger)
    job = job or str(uuid.uuid4())
    return delivery_model(
        llm, PRIMARY, "routing", policy, route, deadline_s=20, job=job, tenant=tenant
    )


def metric(name: str, model: str, **labels: str) -> float:
    sample = REGISTRY.get_sample_value(name, {"workflow": "routing", "model": model, **labels})
    return sample or 0.0


async def ledger_rows(pool) -> list[tuple[Any, ...]]:
    return await rows(
        pool,
        "SELECT model, attempt, outcome, prompt_tokens, completion_tokens, cost_usd, step"
        " FROM model_calls ORDER BY id",
    )


async def test_fallbacks_parse_names_and_endpoints_and_refuse_the_rest() -> None:
    assert parse_models(" gpt-4.1-mini, llama3@http://vllm:8000/v1 ,") == [
        ModelSpec("gpt-4.1-mini"),
        ModelSpec("llama3", "http://vllm:8000/v1"),
    ]
    assert parse_models(["a", "b@https://x.example/v1"])[1].base_url == "https://x.example/v1"
    for bad in ("a b", "a@ftp://x", "a,a", "a@"):
        with pytest.raises(ValueError):
            parse_models(bad)


async def test_a_primary_down_moves_the_call_to_the_fallback_and_the_ledger_has_every_call(
    llm, fake_llm, ledger, pool
) -> None:
    fake_llm.model.model_outages[PRIMARY] = "503"
    cost_before = metric("oncely_model_cost_usd_total", BACKUP)
    calls_before = metric("oncely_model_calls_total", PRIMARY, outcome="transient")
    model = routed(llm, ledger=ledger)
    answer = await model.complete("The ledger counts every call. It is billed.")
    assert answer.startswith("The ledger counts every call.")
    assert model.usage.model == BACKUP
    assert model.usage.model_calls == FAST.max_attempts + 1
    assert fake_llm.stats().models == {PRIMARY: FAST.max_attempts, BACKUP: 1}

    await ledger.flush()
    rows = await ledger_rows(pool)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (PRIMARY, 1, "retryable"),
        (PRIMARY, 2, "retryable"),
        (PRIMARY, 3, "retryable"),
        (BACKUP, 4, "ok"),
    ]
    assert {r[6] for r in rows} == {"model"}
    # The backup's tokens as the fake reported them, priced.
    tokens = fake_llm.stats().tokens[BACKUP]
    _, _, _, prompt, completion, cost, _ = rows[-1]
    assert (prompt, completion) == (tokens["prompt"], tokens["completion"])
    assert float(cost) == pytest.approx((prompt * 2.5 + completion * 10) / 1e6)
    assert model.usage.cost_usd == pytest.approx(float(cost))
    # And the metrics: the cost per model, the failed calls per model.
    cost_after = metric("oncely_model_cost_usd_total", BACKUP)
    assert cost_after - cost_before == pytest.approx(float(cost))
    calls_after = metric("oncely_model_calls_total", PRIMARY, outcome="transient")
    assert calls_after - calls_before == FAST.max_attempts


async def test_a_permanent_failure_never_reaches_the_fallback(llm, fake_llm, ledger, pool) -> None:
    model = routed(llm, ledger=ledger)
    with pytest.raises(PermanentError):
        await model.complete("A bad request stays bad. [[fake:400]]")
    assert fake_llm.stats().models == {PRIMARY: 1}
    await ledger.flush()
    assert [(r[0], r[2]) for r in await ledger_rows(pool)] == [(PRIMARY, "permanent")]


async def test_invalid_answers_are_in_the_ledger_as_such(llm, ledger, pool) -> None:
    class Verdict(BaseModel):
        label: str

    model = routed(llm, ledger=ledger, fallbacks=())
    verdict = await model.structured(Verdict, "Answer in JSON. [[fake:badjson*1]]")
    assert isinstance(verdict, Verdict)
    await ledger.flush()
    assert [(r[0], r[1], r[2]) for r in await ledger_rows(pool)] == [
        (PRIMARY, 1, "invalid_output"),
        (PRIMARY, 2, "ok"),
    ]


def policy(**overrides: Any) -> CooldownPolicy:
    settings: dict[str, Any] = {"failures": 3, "window_s": 30, "cooldown_s": 60, "refresh_s": 0.05}
    return CooldownPolicy(**{**settings, **overrides})


async def armed(redis: Any, model: str = PRIMARY) -> dict[str, int]:
    """The scopes Redis has cooling (or awaiting a probe), until when (ms)."""
    fields = await redis.hgetall(f"oncely:{{cooldown:{model}}}:scopes")
    found = {text(k): v for k, v in fields.items()}
    return {k[2:]: int(v) for k, v in found.items() if k.startswith("u:")}


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def test_one_jobs_retries_and_redeliveries_are_one_failure(llm, fake_llm, redis) -> None:
    """One job whose first seven calls fail (two deliveries' retries and one
    more) cools nothing: it is one failing job, not seven."""
    cooldown = Cooldown(redis, policy())
    job = str(uuid.uuid4())
    for _ in range(2):
        with pytest.raises(TransientError):
            await routed(llm, cooldown=cooldown, fallbacks=(), job=job).complete(
                "Unlucky alone. [[fake:503*7]]"
            )
    model = routed(llm, cooldown=cooldown, fallbacks=(), job=job)
    await model.complete("Unlucky alone. [[fake:503*7]]")
    assert model.usage.model == PRIMARY
    assert fake_llm.stats().models == {PRIMARY: 8}
    assert not cooldown.cooling(PRIMARY, Caller(job, "acme"))
    assert await armed(redis) == {}


async def test_429s_never_cool_a_model(llm, fake_llm, redis) -> None:
    """Six jobs each refused once with 429: pacing, not an outage."""
    cooldown = Cooldown(redis, policy())
    models = [routed(llm, cooldown=cooldown, fallbacks=()) for _ in range(6)]
    await asyncio.gather(
        *(m.complete(f"Paced, not down. [[fake:429*1]] Job {i}.") for i, m in enumerate(models))
    )
    assert fake_llm.stats().models == {PRIMARY: 12}
    assert all(m.usage.model == PRIMARY for m in models)
    assert await armed(redis) == {}
    assert not await redis.exists(f"oncely:{{cooldown:{PRIMARY}}}:jobs")


async def test_one_tenants_failing_jobs_cool_the_model_for_that_tenant_alone(
    llm, fake_llm, redis
) -> None:
    """The attacker's prompts fail on every model; its jobs soon skip both,
    while another tenant's calls, in another process, all go to the primary
    at once, before and after."""
    attacker, victim = Cooldown(redis, policy()), Cooldown(redis, policy())
    victims: list[Model] = []

    async def victim_call(i: int) -> None:
        model = routed(llm, cooldown=victim, tenant="globex")
        await model.complete(f"A victim's call {i}. Fine.")
        victims.append(model)

    for i in range(4):
        with pytest.raises(TransientError):
            model = routed(llm, cooldown=attacker, tenant="mallory")
            await model.complete(f"Failing on purpose. [[fake:503]] Job {i}.")
        await victim_call(i)
    assert attacker.cooling(PRIMARY, Caller("any", "mallory"))
    assert attacker.cooling(BACKUP, Caller("any", "mallory"))
    for i in range(4, 8):
        await victim_call(i)
    assert [(m.usage.model, m.usage.model_calls) for m in victims] == [(PRIMARY, 1)] * 8
    assert not victim.cooling(PRIMARY, Caller("any", "globex"))
    assert not victim.cooling(PRIMARY)

    # The attacker's next job pays for no call: it resumes later.
    before = fake_llm.stats().total
    with pytest.raises(ResumeLater):
        await routed(llm, cooldown=attacker, tenant="mallory").complete("More. [[fake:503]]")
    assert fake_llm.stats().total == before


async def test_a_tenant_whose_calls_mostly_answer_is_not_cooled(llm, fake_llm, redis) -> None:
    """Successes count: three failing jobs against ten answered calls are
    under half of the tenant's calls."""
    cooldown = Cooldown(redis, policy())
    for i in range(10):
        await routed(llm, cooldown=cooldown).complete(f"Answered {i}. Fine.")
    for i in range(3):
        model = routed(llm, cooldown=cooldown)
        await model.complete(f"Unlucky {i}. [[fake:503*3]]")
        assert model.usage.model == BACKUP
    assert not cooldown.cooling(PRIMARY, Caller("any", "acme"))
    assert await armed(redis) == {}


async def test_failing_jobs_of_several_tenants_cool_the_model_for_the_fleet(
    llm, fake_llm, redis
) -> None:
    """An outage: three tenants' jobs fail, and a tenant never seen before,
    in another process, goes straight to the backup."""
    fake_llm.model.model_outages[PRIMARY] = "503"
    first = Cooldown(redis, policy())
    for i, tenant in enumerate(("initech", "hooli", "umbrella")):
        model = routed(llm, cooldown=first, tenant=tenant)
        await model.complete(f"An outage. Job {i}.")
        assert model.usage.model == BACKUP
    # The third job's first failure trips it: its retries skip the primary.
    tripped = 2 * FAST.max_attempts + 1
    assert fake_llm.stats().models[PRIMARY] == tripped
    assert "*" in await armed(redis)

    other = Cooldown(redis, policy())
    for i in range(5):
        model = routed(llm, cooldown=other, tenant="newcomer")
        await model.complete(f"Straight to the backup {i}. Yes.")
        assert model.usage.model == BACKUP
    assert fake_llm.stats().models[PRIMARY] == tripped
    assert other.cooling(PRIMARY)


async def test_with_every_model_cooling_the_job_waits_for_them_a_cooldown_at_most(
    llm, fake_llm, redis
) -> None:
    """The job pays for no call: it waits for any model of its route to
    stop cooling for its tenant (the workers let it out then), a cooldown's
    length at most."""
    fake_llm.model.outage = "503"
    cooldown = Cooldown(redis, policy())
    for i in range(3):
        with pytest.raises(TransientError):
            await routed(llm, cooldown=cooldown).complete(f"Everything is down {i}. For now.")
    calls = fake_llm.stats().total
    with pytest.raises(ResumeLater) as raised:
        await routed(llm, cooldown=cooldown).complete("Nothing is called now. Nothing.")
    assert "cooling down" in str(raised.value)
    assert raised.value.resume_in_s == 60
    assert raised.value.models == (PRIMARY, BACKUP)
    assert raised.value.scope == Caller("any", "acme").scope
    assert fake_llm.stats().total == calls


@pytest.mark.parametrize(
    ("retry_after_s", "low", "high"), [(None, 3, 5), (1, 3, 5), (20, 18, 20), (500, 58, 60)]
)
async def test_the_providers_retry_after_spaces_the_probes_up_to_the_cooldowns_length(
    redis, retry_after_s: float | None, low: float, high: float
) -> None:
    """The next probe comes a probe interval (5 s) after the failure, or as
    late as the provider's Retry-After asks when it asks for longer, up to
    ONCELY_LLM_COOLDOWN_S (60 s)."""
    cooldown = Cooldown(redis, policy(cooldown_s=60, probe_every_s=5))
    for job in ("j1", "j2", "j3"):
        await cooldown.failed("retry-after-model", Caller(job, "acme"), retry_after_s=retry_after_s)
    admission = await cooldown.admit("retry-after-model", Caller("j4", "acme"))
    assert admission.verdict == "skip"
    assert low < admission.wait_s <= high


async def test_a_failed_probe_waits_a_probe_interval_not_a_whole_cooldown(redis) -> None:
    """Half-open: while a model cools, one call goes through every probe
    interval; its failure puts the next probe one interval off (not a new
    60 s cooldown), and its answer ends the cooldown for every process."""
    model, cooling = "half-open-model", policy(failures=2, cooldown_s=60, probe_every_s=0.5)
    first, second = Cooldown(redis, cooling), Cooldown(redis, cooling)
    for job in ("j1", "j2"):
        await first.failed(model, Caller(job, "acme"))
    admission = await first.admit(model, Caller("j3", "acme"))
    assert admission.verdict == "skip" and admission.wait_s <= 0.5
    for round_ in range(3):  # the model still down: each probe fails
        await cooled_off(redis, first, second, model=model)
        prober = Caller(f"probe-{round_}", "acme")
        admission = await second.admit(model, prober)
        assert admission.verdict == "probe"
        assert (await first.admit(model, Caller("other", "acme"))).verdict == "skip"
        await second.failed(model, prober, probe=admission.scope)
        [until_ms] = (await armed(redis, model)).values()
        seconds, micros = await redis.time()
        assert until_ms - (seconds * 1000 + micros // 1000) <= 500, "one interval, not 60 s"
    await cooled_off(redis, first, second, model=model)
    admission = await first.admit(model, Caller("j9", "acme"))
    assert admission.verdict == "probe"
    await first.answered(model, Caller("j9", "acme"), probe=admission.scope)
    assert await armed(redis, model) == {}
    assert (await second.admit(model, Caller("j10", "acme"))).verdict == "go"


async def test_the_workers_see_which_scopes_cool_and_when_their_probe_may_go(redis) -> None:
    """``scopes``: what the workers let waiting jobs out by. A scope whose
    probe is not due, or is out, holds them; an answer frees them; Redis
    not answering frees them too (the cooldown holds no job on its own
    account)."""
    model, cooling = "scoped-model", policy(failures=2, probe_every_s=0.5, refresh_s=0.05)
    cooldown = Cooldown(redis, cooling)
    scope = Caller("any", "acme").scope
    assert await cooldown.scopes(model) == {}
    for job in ("j1", "j2"):
        await cooldown.failed(model, Caller(job, "acme"))
    assert await cooldown.scopes(model) == {scope: False}

    async def probe_due() -> bool:
        return await cooldown.scopes(model) == {scope: True}

    await wait_for(probe_due, what="the probe's time")
    admission = await cooldown.admit(model, Caller("j3", "acme"))
    assert admission.verdict == "probe"
    assert await cooldown.scopes(model) == {scope: False}, "a probe is out"
    await cooldown.answered(model, Caller("j3", "acme"), probe=admission.scope)
    assert await cooldown.scopes(model) == {}
    await cooldown.failed(model, Caller("j4", "acme"))
    await cooldown.failed(model, Caller("j5", "acme"))
    assert await cooldown.scopes(model) == {scope: False}
    unreachable = Redis.from_url("redis://127.0.0.1:1/0", socket_timeout=1)
    try:
        assert await Cooldown(unreachable, cooling).scopes(model) == {}
    finally:
        await unreachable.aclose()


async def cooled_off(redis: Any, *views: Cooldown, model: str = PRIMARY) -> None:
    """Until every cooldown of ``model`` is over, by Redis' own clock, and
    in each process view given (a view counts the rest of a cooldown from
    when it read it, so it may end a round trip later)."""

    async def over() -> bool:
        seconds, micros = await redis.time()
        now = seconds * 1000 + micros // 1000
        in_redis = all(until <= now for until in (await armed(redis, model)).values())
        return in_redis and not any(view.cooling(model, Caller("any", "acme")) for view in views)

    await wait_for(over, within_s=30, what="the cooldown's end")


async def test_the_gauge_shows_the_fleets_cooldown_between_probes_until_one_answers(redis) -> None:
    """``oncely_model_cooldown`` stays 1 between probes (not only for the
    seconds after each one), and drops once another process's probe
    answered and this one's workers read the cooldown again."""
    model, cooling = "gauged-model", policy(failures=3, probe_every_s=0.3)
    watcher, prober = Cooldown(redis, cooling), Cooldown(redis, cooling)
    # (One gauge per model in a process: the view made last reports.)
    assert (await prober.admit(model, Caller("j0", "newcomer"))).verdict == "go"
    for job, tenant in (("j1", "initech"), ("j2", "hooli"), ("j3", "umbrella")):
        await watcher.failed(model, Caller(job, tenant))

    def gauge() -> float | None:
        return REGISTRY.get_sample_value("oncely_model_cooldown", {"model": model})

    assert gauge() == 1.0
    await cooled_off(redis, watcher, model=model)
    assert await watcher.scopes(model) == {"*": True}
    assert gauge() == 1.0, "between probes: still cooling"
    admission = await prober.admit(model, Caller("j4", "newcomer"))
    assert admission.verdict == "probe"
    await prober.answered(model, Caller("j4", "newcomer"), probe=admission.scope)
    assert gauge() == 1.0, "not read since"
    assert await watcher.scopes(model) == {}
    assert gauge() == 0.0


async def test_after_the_cooldown_one_probe_decides(llm, fake_llm, redis) -> None:
    cooling = policy(failures=2, probe_every_s=2, probe_s=30)
    cooldown = Cooldown(redis, cooling)
    fake_llm.model.model_outages[PRIMARY] = "hang"
    slow = RetryPolicy(per_call_timeout_s=0.3, max_attempts=2, backoff_base_s=0.001)
    for i in range(2):
        await routed(llm, cooldown=cooldown, policy=slow).complete(
            f"A hanging model cools down too. Timeouts count. Job {i}."
        )
    assert cooldown.cooling(PRIMARY, Caller("any", "acme"))
    # The second job's first timeout trips it: its retry skips the model.
    assert fake_llm.stats().models[PRIMARY] == 3

    # Past the cooldown, with the model still hanging: among concurrent
    # calls of two processes, one probe goes out; the others skip.
    await cooled_off(redis, cooldown)
    other = Cooldown(redis, cooling)
    models = [routed(llm, cooldown=c, policy=slow) for c in (cooldown, other) * 4]
    await asyncio.gather(*(m.complete(f"Probe round {i}. Once.") for i, m in enumerate(models)))
    assert fake_llm.stats().models[PRIMARY] == 4, "one probe"
    # The probe failed: cooling again, for both.
    assert (await cooldown.admit(PRIMARY, Caller("j", "acme"))).verdict == "skip"
    assert (await other.admit(PRIMARY, Caller("j", "acme"))).verdict == "skip"

    # The model is back: past the next cooldown the probe answers, and then
    # every call goes to it again.
    del fake_llm.model.model_outages[PRIMARY]
    await cooled_off(redis, cooldown, other)
    probe = routed(llm, cooldown=other)
    await probe.complete("The probe answers. Good.")
    assert probe.usage.model == PRIMARY
    after = routed(llm, cooldown=cooldown)
    await after.complete("Back to normal. Yes.")
    assert after.usage.model == PRIMARY
    assert await armed(redis) == {}


async def test_the_job_that_failed_a_probe_leaves_the_next_one_to_another(redis) -> None:
    """A job whose own prompt fails cannot keep a model cooling by taking
    every probe: within the grace another job probes; alone, it may again."""
    model, cooling = "probed-model", policy(failures=2, probe_every_s=1, probe_grace_s=1.5)
    cooldown = Cooldown(redis, cooling)
    for job in ("j1", "j2"):
        await cooldown.failed(model, Caller(job, "acme"))
    await cooled_off(redis, cooldown, model=model)
    admission = await cooldown.admit(model, Caller("j1", "acme"))
    assert admission.verdict == "probe"
    await cooldown.failed(model, Caller("j1", "acme"), probe=admission.scope)
    await cooled_off(redis, model=model)

    assert (await Cooldown(redis, cooling).admit(model, Caller("j1", "acme"))).verdict == "skip"
    assert (await Cooldown(redis, cooling).admit(model, Caller("j3", "acme"))).verdict == "probe"

    # Alone, once the grace is over, the same job may probe again.
    await Cooldown(redis, cooling).failed(model, Caller("j3", "acme"), probe=admission.scope)
    await cooled_off(redis, model=model)

    async def probes() -> bool:
        found = await Cooldown(redis, cooling).admit(model, Caller("j3", "acme"))
        return found.verdict == "probe"

    await wait_for(probes, within_s=30, what="the probe past the grace")


async def test_failures_spread_beyond_the_window_never_trip_the_cooldown(
    llm, fake_llm, redis
) -> None:
    cooldown = Cooldown(redis, policy(window_s=0.2))
    for i in range(4):
        await routed(llm, cooldown=cooldown).complete(f"Fails once. [[fake:503*1]] Call {i}.")
        await asyncio.sleep(0.25)
    assert not cooldown.cooling(PRIMARY, Caller("any", "acme"))
    assert fake_llm.stats().models == {PRIMARY: 8}


async def test_a_call_cancelled_from_outside_never_cools_its_model_down(
    llm, fake_llm, redis
) -> None:
    """A job's cancel, a shutdown, a sibling branch's failure: the model said
    nothing, and one such cancel must not take it out."""
    cooldown = Cooldown(redis, policy(failures=1))
    fake_llm.model.model_outages[PRIMARY] = "hang"
    slow = RetryPolicy(per_call_timeout_s=30, max_attempts=1, backoff_base_s=0.001)
    call = asyncio.create_task(routed(llm, cooldown=cooldown, policy=slow).complete("Cut. Now."))
    await wait_for(_in_flight(fake_llm), what="the call at the model")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not cooldown.cooling(PRIMARY, Caller("any", "acme"))
    assert await armed(redis) == {}
    # A real timeout, by contrast, does count.
    quick = RetryPolicy(per_call_timeout_s=0.2, max_attempts=1, backoff_base_s=0.001)
    await routed(llm, cooldown=cooldown, policy=quick).complete("Timed out. Then backup.")
    assert cooldown.cooling(PRIMARY, Caller("any", "acme"))


async def test_the_ledger_keeps_a_batch_postgres_refused_and_writes_it_later(
    llm, pool, ledger
) -> None:
    async with pool.connection() as conn:
        await conn.execute("ALTER TABLE model_calls RENAME TO model_calls_away")
    try:
        await routed(llm, ledger=ledger).complete("Written later. Not lost.")
        assert await ledger.flush() == 0
    finally:
        async with pool.connection() as conn:
            await conn.execute("ALTER TABLE model_calls_away RENAME TO model_calls")
    await routed(llm, ledger=ledger).complete("Written with the first. Both.")
    assert await ledger.flush() == 2
    assert await count(pool, "SELECT count(*) FROM model_calls WHERE outcome = 'ok'") == 2


async def test_a_call_in_flight_is_in_the_ledger_as_sent_until_its_row_replaces_it(
    llm, pool
) -> None:
    ledger = Ledger(pool, prices=PRICES, flush_s=3600, in_flight_after_s=0.1)
    # A word every 0.2 s: the call is in flight across several batches.
    text = "[[fake:typing=0.2]] Sent first. Then answered. One row at the end."
    call = asyncio.create_task(routed(llm, ledger=ledger).complete(text))

    async def written_as_sent() -> bool:
        await ledger.flush()
        return await count(pool, "SELECT count(*) FROM model_calls WHERE outcome = 'sent'") == 1

    await wait_for(written_as_sent, what="the call in flight's sent row")
    await ledger.flush()  # a later batch adds it no second time
    assert [(r[0], r[2], r[3]) for r in await ledger_rows(pool)] == [(PRIMARY, "sent", 0)]
    await call
    assert await ledger.flush() == 1
    rows = await ledger_rows(pool)
    assert [(r[0], r[1], r[2]) for r in rows] == [(PRIMARY, 1, "ok")], "replaced, not added"
    assert rows[0][3] > 0 and rows[0][5] is not None


async def test_a_call_younger_than_a_batch_interval_waits_for_the_next_batch(pool) -> None:
    ledger = Ledger(pool, flush_s=3600)
    site = CallSite("routing", str(uuid.uuid4()), "acme")
    quick = ledger.sending(site, "model", PRIMARY, 1)
    await ledger.flush()
    ledger.record(Call(site, "model", PRIMARY, 1, "ok", 10, 5, 3, None), quick)
    await ledger.flush()
    assert [r[2] for r in await ledger_rows(pool)] == ["ok"], "no sent row came and went"


async def test_an_answer_cancelled_before_its_caller_got_it_is_a_timeout_with_its_tokens(
    llm, pool, redis
) -> None:
    class Stalling(Cooldown):
        """Takes its time to note an answer: the job is cancelled meanwhile."""

        async def answered(self, *args: Any, **kwargs: Any) -> None:
            stalled.set()
            await asyncio.Event().wait()

    stalled = asyncio.Event()
    cooldown = Stalling(redis, CooldownPolicy(failures=3, window_s=30, cooldown_s=60))
    ledger = Ledger(pool, prices=PRICES, flush_s=3600)
    call = asyncio.create_task(
        routed(llm, cooldown=cooldown, ledger=ledger).complete("Answered. Then cancelled.")
    )
    await asyncio.wait_for(stalled.wait(), 30)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await ledger.flush() == 1
    [row] = await ledger_rows(pool)
    assert (row[0], row[2]) == (PRIMARY, "timeout") and row[3] > 0, "paid for, answer lost"


async def test_a_call_that_never_left_leaves_no_row_and_a_batch_refused_keeps_its_sends(
    pool,
) -> None:
    ledger = Ledger(pool, flush_s=3600, in_flight_after_s=0)
    site = CallSite("routing", str(uuid.uuid4()), "acme")
    held = ledger.sending(site, "model", PRIMARY, 1)
    await ledger.flush()
    assert await count(pool, "SELECT count(*) FROM model_calls WHERE outcome = 'sent'") == 1
    ledger.withdraw(held)  # e.g. the fleet's limits held it back after all
    await ledger.flush()
    assert await count(pool, "SELECT count(*) FROM model_calls") == 0
    # A send PostgreSQL did not take goes with the next batch.
    late = ledger.sending(site, "model", PRIMARY, 2)
    async with pool.connection() as conn:
        await conn.execute("ALTER TABLE model_calls RENAME TO model_calls_away")
    try:
        assert await ledger.flush() == 0
    finally:
        async with pool.connection() as conn:
            await conn.execute("ALTER TABLE model_calls_away RENAME TO model_calls")
    await ledger.flush()
    assert await count(pool, "SELECT count(*) FROM model_calls WHERE outcome = 'sent'") == 1
    ledger.record(Call(site, "model", PRIMARY, 2, "timeout", 0, 0, 900, None), late)
    assert await ledger.flush() == 1
    assert [r[2] for r in await ledger_rows(pool)] == ["timeout"]


async def test_the_ledger_writes_what_it_holds_when_its_block_ends(llm, pool) -> None:
    ledger = Ledger(pool, flush_s=3600)
    async with ledger.running():
        for i in range(3):
            await routed(llm, ledger=ledger).complete(f"Held until the end. Call {i}.")
        assert await count(pool, "SELECT count(*) FROM model_calls") == 0
    assert await count(pool, "SELECT count(*) FROM model_calls") == 3


async def test_budgets_count_each_tenants_day_and_refuse_only_the_one_over(redis) -> None:
    budgets = Budgets(redis, BudgetLimits(daily_tokens=1000, daily_usd=0.5), refresh_s=0)
    today = utc_day()
    await budgets.add({("acme", today): Spent(600, 0.1), ("globex", today): Spent(10, 0.6)})
    await budgets.add({("acme", today): Spent(300, 0.1), ("acme", "2000-01-01"): Spent(5000, 9)})
    assert await budgets.spent("acme") == Spent(900, pytest.approx(0.2))
    assert await budgets.reserve("acme", "job-1", 50) is None  # 900 tokens, $0.20: within both
    wait_s = await budgets.reserve("globex", "job-2", 50)  # $0.60: over the USD budget
    assert wait_s is not None and 1 <= wait_s <= 86400
    # 900 spent and 50 held: one more of 100 would pass 1000.
    assert await budgets.reserve("acme", "job-3", 100) is not None
    assert await budgets.reserve("acme", "job-1", 50) is None, "a job keeps its hold"
    # Spend releases the job's hold: 950 spent, nothing held.
    await budgets.add({("acme", today): Spent(50, 0.0)}, {("acme", today): ["job-1"]})
    assert await budgets.reserved("acme") == 0
    assert await budgets.reserve("acme", "job-4", 40) is None
    await budgets.add({("acme", today): Spent(60, 0.0)}, {("acme", today): ["job-4"]})
    assert await budgets.reserve("acme", "job-5", 1) is not None  # 1010 tokens: over
    assert await Budgets(redis).reserve("acme", "job-6", 10) is None  # no budgets: never refused


async def test_concurrent_intakes_cannot_overshoot_a_budget_together(settings, redis, pool):
    """The regression: 2,000 tokens a day and 100 requests at once used to
    be all accepted (5.6 x the budget). Each accepted job now holds its
    estimate first."""
    import httpx

    from oncely.api.auth import create_api_key
    from tests.helpers import asgi_app

    key = await create_api_key(pool, "acme")
    app = asgi_app(settings.model_copy(update={"tenant_daily_tokens": 2000}), redis, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:

        async def post(i: int) -> httpx.Response:
            return await c.post(
                "/v1/summaries",
                json={"text": f"Request {i}. " * 10, "notify": "a@example.com"},
                headers={"Authorization": f"Bearer {key}", "Idempotency-Key": f"race-{i:012}"},
            )

        answers = await asyncio.gather(*(post(i) for i in range(100)))
        statuses = [a.status_code for a in answers]
        # An estimate is the request's tokens (about 40) and
        # ONCELY_BUDGET_RESERVE_TOKENS (1000): a second would pass 2000.
        assert statuses.count(202) == 1 and statuses.count(429) == 99
        budgets = Budgets(redis)
        held = await budgets.reserved("acme")
        assert 1000 < held < 1100
        first = statuses.index(202)
        job_id = answers[first].json()["job_id"]
        # A refused request left its key free: its retry is refused again, not 409.
        assert (await post((first + 1) % 100)).status_code == 429
    # The job spends (the ledger releases its hold); the client retries it
    # through another API process (which has seen no refusal): a replay,
    # which holds nothing more.
    await budgets.add({("acme", utc_day()): Spent(50, 0.0)}, {("acme", utc_day()): [job_id]})
    other = asgi_app(settings.model_copy(update={"tenant_daily_tokens": 2000}), redis, pool)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=other), base_url="http://t"
    ) as c:
        again = await post(first)
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert await budgets.reserved("acme") == 0, "a replay reserves nothing"
    assert await count(pool, "SELECT count(*) FROM jobs") == 1


def _in_flight(fake_llm: Any) -> Any:
    async def check() -> bool:
        return bool(fake_llm.stats().in_flight == 1)

    return check


async def test_spend_redis_did_not_take_is_counted_once_it_answers(llm, pool, redis) -> None:
    """A Redis that does not answer while the ledger writes: the spend is
    kept and added to the budgets with the next flush, once."""
    from oncely.bootstrap.clients import make_redis
    from tests.processes import free_port

    nowhere = make_redis(f"redis://127.0.0.1:{free_port()}", timeout_s=0.2, connect_timeout_s=0.2)
    ledger = Ledger(pool, flush_s=3600, budgets=Budgets(nowhere))
    await routed(llm, ledger=ledger, tenant="acme").complete("Counted when Redis is back.")
    assert await ledger.flush() == 1
    assert await Budgets(redis).spent("acme") == Spent(0, 0.0)
    ledger.budgets = Budgets(redis)  # Redis answers again
    assert await ledger.flush() == 0
    counted = await Budgets(redis).spent("acme")
    assert counted.tokens > 0
    await ledger.flush()
    assert await Budgets(redis).spent("acme") == counted, "counted once"
    await nowhere.aclose()
