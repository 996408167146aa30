"""Model routing and cost through real `oncely` processes on the fake model
(docs/model-routing.md): an outage of the primary, the fleet's cooldown
across worker processes, the ledger against the fake's own counts, and
tenants' daily budgets at the intake."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from oncely.api.auth import create_api_key
from oncely.queue.stream import Stream
from tests.helpers import all_done, rows, scalar, submit
from tests.processes import (
    deployment_env,
    free_port,
    oncely,
    running,
    start,
    tail,
    wait_for,
    wait_healthy,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


PRIMARY, BACKUP = "oncely-fake", "fake-backup"
PRICES = {PRIMARY: (1.0, 4.0), BACKUP: (2.5, 10.0)}


def routing_env(redis_url: str, database_url: str, model: Any, mail: Any, **extra: str) -> dict:
    return deployment_env(
        redis_url,
        database_url,
        model,
        mail,
        ONCELY_LLM_FALLBACKS=BACKUP,
        ONCELY_LLM_PRICES=",".join(f"{m}={i}/{o}" for m, (i, o) in PRICES.items()),
        ONCELY_LLM_TIMEOUT_S="2",
        ONCELY_LLM_BACKOFF_BASE_S="0.01",
        ONCELY_LLM_BACKOFF_MAX_S="0.05",
        ONCELY_REDELIVERY_BASE_S="0.2",
        ONCELY_REDELIVERY_MAX_S="1",
        **extra,
    )


@pytest.fixture
def stream(redis) -> Stream:
    from oncely.builtin import app

    return Stream(redis, app["summaries"].keys)


async def models_of(pool, ids: list[str]) -> set[str]:
    found = await rows(
        pool, "SELECT usage->>'model' FROM results WHERE job_id = ANY(%s::uuid[])", ids
    )
    return {r[0] for r in found}


def cli_json(env: dict[str, str], *args: str) -> Any:
    done = oncely(*args, "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_an_outage_of_the_primary_sends_jobs_to_the_fallback_and_the_ledger_has_each_call(
    redis_url, database_url, redis, pool, stream, providers, client, auth, tmp_path
):
    model, mail = providers
    env = routing_env(redis_url, database_url, model, mail, ONCELY_WORKER_CONCURRENCY="4")
    worker = start(["worker"], env, tmp_path / "worker.log")
    with running(worker):
        # A permanent failure stays where it is: dead, the fallback never asked.
        doomed = await submit(pool, stream, "A request the model refuses. [[fake:400]]")

        async def dead() -> bool:
            return await scalar(pool, "SELECT status FROM jobs WHERE job_id = %s", doomed) == "dead"

        await wait_for(dead, what="the refused job dead")
        assert model.stats().models == {PRIMARY: 1}

        model.model.model_outages[PRIMARY] = "503"
        ids = [await submit(pool, stream, f"Job {i} in an outage. It moves on.") for i in range(40)]
        await wait_for(lambda: all_done(pool, ids), within_s=120, what="every job done")
    assert worker.returncode == 0, tail(tmp_path / "worker.log")

    # Every job answered by the fallback; the dead model asked a handful of
    # times in all (the cooldown), not once per job and attempt (40 × 4):
    # five failing jobs trip it, each with its four attempts, and the jobs
    # started beside the fifth one attempt each.
    assert await models_of(pool, ids) == {BACKUP}
    calls = model.stats().models
    assert calls[BACKUP] == 40
    assert 5 <= calls[PRIMARY] - 1 <= 5 * 4 + 4, calls

    # The ledger: a row per call the fake received, failed ones included,
    # the fake's tokens, priced.
    by_model = dict(await rows(pool, "SELECT model, count(*) FROM model_calls GROUP BY model"))
    assert by_model == calls
    ok = await rows(
        pool,
        "SELECT model, prompt_tokens, completion_tokens, cost_usd, job_id::text FROM model_calls"
        " WHERE outcome = 'ok'",
    )
    tokens = model.stats().tokens[BACKUP]
    assert sum(r[1] for r in ok) == tokens["prompt"]
    assert sum(r[2] for r in ok) == tokens["completion"]
    for name, prompt, completion, cost, _ in ok:
        price_in, price_out = PRICES[name]
        assert float(cost) == pytest.approx((prompt * price_in + completion * price_out) / 1e6)
    outcomes = await rows(pool, "SELECT DISTINCT model, outcome FROM model_calls")
    assert sorted(outcomes) == [(BACKUP, "ok"), (PRIMARY, "permanent"), (PRIMARY, "retryable")]

    # Each job's cost is its calls' cost; GET shows it, and the model per step.
    job = ids[0]
    r = await client.get(f"/v1/summaries/{job}", headers=auth)
    view = r.json()
    assert view["usage"]["model"] == BACKUP
    assert view["steps"][0]["model"] == BACKUP
    cost = await scalar(pool, "SELECT sum(cost_usd) FROM model_calls WHERE job_id = %s", job)
    assert view["usage"]["cost_usd"] == pytest.approx(float(cost))

    # The report: calls, tokens and cost per model; every failed call wasted.
    report = {row["model"]: row for row in cli_json(env, "usage", "report", "--by", "model")}
    assert report[PRIMARY]["calls"] == calls[PRIMARY]
    assert report[PRIMARY]["wasted_calls"] == calls[PRIMARY]
    assert report[BACKUP]["calls"] == 40 and report[BACKUP]["wasted_calls"] == 0
    assert report[BACKUP]["prompt_tokens"] == tokens["prompt"]
    total = sum(float(c) for *_, c, _ in ok)
    assert report[BACKUP]["cost_usd"] == pytest.approx(total)


async def test_the_cooldown_holds_across_worker_processes_and_ends_by_itself(
    redis_url, database_url, redis, pool, stream, providers, tmp_path
):
    model, mail = providers
    metrics_port = free_port()
    env = routing_env(
        redis_url,
        database_url,
        model,
        mail,
        ONCELY_WORKER_CONCURRENCY="1",
        ONCELY_LLM_COOLDOWN_FAILURES="2",
        ONCELY_LLM_COOLDOWN_PROBE_S="3",
    )
    model.model.model_outages[PRIMARY] = "503"
    first = start(["worker"], env, tmp_path / "first.log")
    with running(first):
        ids = [
            await submit(pool, stream, f"Trip {i}. The first worker trips it.") for i in range(2)
        ]
        await wait_for(lambda: all_done(pool, ids), what="the first worker's jobs")
    tripped = model.stats().models[PRIMARY]
    assert tripped == 4 + 1, "two failing jobs trip it: the second one's retries skip the model"

    # A second worker process, which has seen no failure of its own, skips
    # the model too: the cooldown is the fleet's. (A probe may go out if the
    # cooldown ends meanwhile on a slow machine; it fails, and one at most.)
    second = start(["worker"], env | {"ONCELY_METRICS_PORT": str(metrics_port)}, tmp_path / "s.log")
    with running(second):
        ids = [await submit(pool, stream, f"Skip {i}. The second one skips.") for i in range(6)]
        await wait_for(lambda: all_done(pool, ids), what="the second worker's jobs")
        assert await models_of(pool, ids) == {BACKUP}
        assert model.stats().models[PRIMARY] - tripped <= 1

        # The model comes back: once the cooldown is over, a probe finds it
        # and jobs go to it again, with nobody doing anything.
        del model.model.model_outages[PRIMARY]
        answered_by: set[str] = set()

        async def back() -> bool:
            job = await submit(pool, stream, "Back yet? Soon.")
            await wait_for(lambda: all_done(pool, [job]), what="a job")
            answered_by.update(await models_of(pool, [job]))
            return PRIMARY in answered_by

        await wait_for(back, within_s=60, what="jobs answered by the primary again")
        after = await submit(pool, stream, "After the probe. Normal.")
        await wait_for(lambda: all_done(pool, [after]), what="the next job")
        assert await models_of(pool, [after]) == {PRIMARY}
        assert not await redis.hgetall(f"oncely:{{cooldown:{PRIMARY}}}:scopes")
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        assert f'oncely_model_cooldown{{model="{PRIMARY}"}} 0.0' in text


@pytest.fixture
async def tenants(pool) -> AsyncIterator[tuple[str, str]]:
    yield await create_api_key(pool, "acme"), await create_api_key(pool, "globex")


async def test_a_tenants_daily_tokens_hold_under_concurrency_and_keep_the_jobs_it_had(
    redis_url, database_url, redis, pool, providers, tenants, tmp_path
):
    model, mail = providers
    acme, globex = tenants
    env = routing_env(redis_url, database_url, model, mail, ONCELY_TENANT_DAILY_TOKENS="100")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api = start(["api", "--port", str(port)], env, tmp_path / "api.log")
    with running(api):
        await wait_healthy(base, api, tmp_path / "api.log")
        async with httpx.AsyncClient(base_url=base) as http:

            async def post(key: str, idem: str, text: str) -> httpx.Response:
                return await http.post(
                    "/v1/summaries",
                    json={"text": text, "notify": "ada@example.com"},
                    headers={"Authorization": f"Bearer {key}", "Idempotency-Key": idem},
                )

            # Six at once, before any spend: the first reserves more than the
            # budget's 100 tokens (its estimate), so the others are refused:
            # concurrent requests cannot overshoot the budget together.
            texts = [f"Budget job {i}. " + "Tokens add up over the day. " * 20 for i in range(6)]
            answers = await asyncio.gather(
                *(post(acme, f"budget-test-{i:08}", t) for i, t in enumerate(texts))
            )
            assert sorted(r.status_code for r in answers) == [202] + [429] * 5
            accepted = [r for r in answers if r.status_code == 202]
            first = answers.index(accepted[0])
            ids = [r.json()["job_id"] for r in accepted]
            worker = start(["worker"], env, tmp_path / "worker.log")
            with running(worker):
                await wait_for(lambda: all_done(pool, ids), what="every accepted job done")

                async def counted() -> bool:
                    usage = cli_json(env, "tenants", "usage", "acme")
                    return bool(usage["over_budget"])

                await wait_for(counted, what="the day's spend counted")

            idem_keys = len([k async for k in redis.scan_iter(match="oncely:idem:*")])
            refused = await post(acme, "budget-test-refused", "One more. Refused.")
            assert refused.status_code == 429, refused.text
            assert refused.json()["type"].endswith("/budget-exceeded")
            assert 1 <= int(refused.headers["Retry-After"]) <= 86400
            # No key claimed, no job.
            assert len([k async for k in redis.scan_iter(match="oncely:idem:*")]) == idem_keys
            assert await scalar(pool, "SELECT count(*) FROM jobs WHERE tenant = 'acme'") == 1

            # A retry of a job it had is answered as ever; another tenant is not refused.
            again = await post(acme, f"budget-test-{first:08}", texts[first])
            assert again.status_code == 202 and again.headers.get("Idempotent-Replayed") == "true"
            assert (
                await post(globex, "budget-test-refused", "Another tenant. Fine.")
            ).status_code == 202

    usage = cli_json(env, "tenants", "usage", "acme")
    assert usage["tokens"] >= 100 and usage["daily_tokens"] == 100
    assert usage["ledger"]["calls"] == 1
    assert usage["reserved_tokens"] == 0, "the job's spend released its reservation"
    # Without the API's environment, the report still has the API's budget.
    bare = {k: v for k, v in env.items() if k != "ONCELY_TENANT_DAILY_TOKENS"}
    assert cli_json(bare, "tenants", "usage", "acme")["daily_tokens"] == 100
    assert (
        usage["ledger"]["prompt_tokens"] + usage["ledger"]["completion_tokens"] == usage["tokens"]
    )
    assert cli_json(env, "tenants", "usage", "globex")["over_budget"] is False
