"""The ``responses:`` dialect through real `oncely api`, `worker` and `relay`
processes (``--app tests.steps_app:app``, the ``chain`` workflow: three model
calls, the last one held by its ``hold`` directive): background calls that
outlive a worker killed with SIGKILL, a cancelled job's background response
cancelled at the provider, and a route from an overloaded ``anthropic:``
primary to a ``responses:`` fallback (docs/providers.md). Counted at the fake
model (creates, retrieves, cancels per dialect) and in the ledger
(``model_calls``)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from oncely.fakes.llm import FakeLLMServer
from tests.helpers import rows
from tests.processes import Deployment, deployment_env, post, wait_effects, wait_for, wait_outcome
from tests.test_durable_processes import chain, steps_env
from tests.test_streams_processes import killed_mid_stream

pytestmark = pytest.mark.slow

__all__ = ["chain"]  # the fixture of tests/test_durable_processes.py, on this module's env

APP = "tests.steps_app:app"
MODEL = "gpt-fake"


@pytest.fixture
def env(redis, redis_url, database_url, providers, tmp_path) -> dict[str, str]:
    """The processes' settings, on a flushed Redis database (``redis``)."""
    return steps_env(redis_url, database_url, providers, tmp_path) | BACKGROUND


# Every attempt may take 20 s, more than 2: each goes in background mode.
BACKGROUND = {
    "ONCELY_LLM_MODEL": f"responses:{MODEL}",
    "ONCELY_LLM_TIMEOUT_S": "20",
    "ONCELY_LLM_BACKGROUND_S": "2",
}


async def ledger(pool: Any, job_id: str) -> list[tuple[Any, ...]]:
    """The job's ``model_calls`` rows: (step, model, dialect, outcome), by step."""
    return await rows(
        pool,
        "SELECT step, model, dialect, outcome FROM model_calls WHERE job_id = %s ORDER BY step, id",
        job_id,
    )


async def intents(pool: Any, job_id: str) -> list[str]:
    found = await rows(
        pool,
        "SELECT key FROM checkpoints WHERE job_id = %s AND kind = 'intent' ORDER BY ordinal",
        job_id,
    )
    return [str(key) for (key,) in found]


async def last_call_written(pool: Any, job_id: str, outcome: str, what: str) -> list[Any]:
    """Once the last call's (``model#3``) ledger row says ``outcome``: the
    job's ledger rows."""

    async def written() -> bool:
        rows = await ledger(pool, job_id)
        return [r[3] for r in rows if r[0] == "model#3"] == [outcome]

    await wait_for(written, what=what)
    return await ledger(pool, job_id)


def created(model: FakeLLMServer, contains: str) -> int:
    """Creates (POST /v1/responses) of the prompts containing ``contains``."""
    return sum(p.count for p in model.stats(contains).prompts)


async def test_sigkill_while_a_background_response_thinks_reattaches_and_pays_once(
    pool, providers, chain
):
    """The worker is killed while the last call's background response
    thinks; another worker re-attaches to it by the id the first one stored:
    the provider saw one create, the ledger has one row for that call."""
    model, mail = providers
    order = chain("sku-5 think it over.", "responses-sigkill-0001", hold_s=6)
    async with order as (d, client, job_id):

        async def final_id_kept_and_sent() -> bool:
            # The first two calls' rows and the last one's ``sent`` row
            # written (a worker killed with -9 loses its last batch).
            return len(await intents(pool, job_id)) == 3 and await ledger(pool, job_id) == [
                ("model", MODEL, "responses", "ok"),
                ("model#2", MODEL, "responses", "ok"),
                ("model#3", MODEL, "responses", "sent"),
            ]

        await wait_for(final_id_kept_and_sent, what="the last call's response id stored")
        assert created(model, "final:") == 1
        d.kill_worker()
        retrieved = model.stats().background["retrieved"]
        d.workers.append(d.start_worker())

        await wait_effects(mail, within_s=60, what="the order's webhook")
        job = (await client.get(f"/v1/chain/{job_id}")).json()

        rows = await last_call_written(pool, job_id, "ok", "the last call's ledger row")

    assert job["status"] == "done", job
    assert job["result"]["final"] == "final: sku-5 think it over."
    # One create per call: the killed worker's last call was re-attached to
    # (read by id, polled by the new worker), not sent again.
    stats = model.stats()
    assert (created(model, "classify:"), created(model, "draft:"), created(model, "final:")) == (
        1,
        1,
        1,
    )
    assert stats.dialects == {"responses": 3}
    assert stats.background["created"] == 3
    assert stats.background["cancelled"] == 0
    assert stats.background["retrieved"] > retrieved
    assert await intents(pool, job_id) == ["model/response", "model#2/response", "model#3/response"]
    # One row per call, each ok, the re-attached one in place of the `sent`
    # row the killed worker left.
    assert rows == [
        ("model", MODEL, "responses", "ok"),
        ("model#2", MODEL, "responses", "ok"),
        ("model#3", MODEL, "responses", "ok"),
    ]
    assert (await mail.deliveries())["effects"] == 1


async def test_a_job_cancelled_while_its_background_response_thinks_cancels_it(
    pool, providers, chain
):
    model, mail = providers
    order = chain("sku-6 never mind.", "responses-cancel-0001", hold_s=60)
    async with order as (_, client, job_id):

        async def final_id_kept() -> bool:
            return len(await intents(pool, job_id)) == 3

        await wait_for(final_id_kept, what="the last call's response id stored")
        r = await client.post(f"/v1/chain/{job_id}/cancel")
        assert (r.status_code, r.json()["status"]) == (202, "cancelled"), r.text

        async def cancelled_at_the_provider() -> bool:
            return model.stats().background["cancelled"] == 1

        await wait_for(cancelled_at_the_provider, what="the response cancelled")

        await wait_outcome(pool, job_id, "cancelled", "the delivery recorded as cancelled")
        job = (await client.get(f"/v1/chain/{job_id}")).json()

        rows = await last_call_written(pool, job_id, "timeout", "the cancelled call's ledger row")

    assert job["status"] == "cancelled"
    stats = model.stats()
    assert (stats.background["created"], stats.background["cancelled"]) == (3, 1)
    assert created(model, "final:") == 1
    # Cancelled with its job: made, maybe paid for, its answer lost.
    assert [r for r in rows if r[0] == "model#3"] == [("model#3", MODEL, "responses", "timeout")]
    assert (await mail.deliveries())["effects"] == 0


async def test_an_overloaded_anthropic_primary_falls_back_to_responses(
    api_key, pool, providers, env, tmp_path
):
    """A route across providers: every call of the ``anthropic:`` primary
    answers 529 (the fake's outage for that model); each call falls back to
    the ``responses:`` model on the same endpoint, and the ledger names each
    row's dialect."""
    model, mail = providers
    env = env | {
        "ONCELY_LLM_MODEL": "anthropic:claude-fake",
        "ONCELY_LLM_FALLBACKS": f"responses:{MODEL}",
        "ONCELY_LLM_MAX_ATTEMPTS": "2",
        "ONCELY_LLM_BACKOFF_BASE_S": "0.05",
        "ONCELY_LLM_BACKOFF_MAX_S": "0.1",
        "ONCELY_LLM_RETRY_AFTER_MAX_S": "0.1",
    }
    async with httpx.AsyncClient(base_url=model.root_url) as fake:
        outage = await fake.post("/_outage", json={"fault": "529", "model": "claude-fake"})
        assert outage.status_code == 200, outage.text
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            body = {"text": "sku-9 the primary is busy."}
            job_id = await post(client, "/v1/chain", body, "responses-fallback-0001")

            await wait_effects(mail, within_s=60, what="the order's webhook")
            job = (await client.get(f"/v1/chain/{job_id}")).json()

            async def written() -> bool:
                rows = await ledger(pool, job_id)
                return sum(r[3] == "ok" for r in rows) == 3

            await wait_for(written, what="the job's ledger rows")
            rows = await ledger(pool, job_id)

    assert job["status"] == "done", job
    assert job["result"]["final"] == "final: sku-9 the primary is busy."
    stats = model.stats()
    # The primary was tried (and overloaded), the fallback answered each call.
    assert stats.models["claude-fake"] >= 2
    assert stats.dialects == {"anthropic": stats.models["claude-fake"], "responses": 3}
    primary = [r for r in rows if r[1] == "claude-fake"]
    assert primary and {r[2:] for r in primary} == {("anthropic", "retryable")}
    assert len(primary) == stats.models["claude-fake"]
    assert [r for r in rows if r[1] == MODEL] == [
        ("model", MODEL, "responses", "ok"),
        ("model#2", MODEL, "responses", "ok"),
        ("model#3", MODEL, "responses", "ok"),
    ]


async def test_a_worker_killed_mid_stream_of_a_background_response_goes_on_from_its_last_piece(
    redis_url, database_url, api_key, pool, redis, providers, tmp_path
):
    """The summaries workflow streams; its call runs in background mode.
    The worker is SIGKILLed while the response's words stream; the next one
    re-attaches to the stored response and streams it from the number of
    the last piece the live stream holds: the provider saw one create and
    one stream from that number, the client saw no ``reset`` and no piece
    twice, and the tokens it keeps are the stored summary."""
    model, mail = providers
    env = deployment_env(redis_url, database_url, model, mail, ONCELY_CLAIM_IDLE_MS="1500")
    # A word every 0.3 s: the worker is killed while the answer streams.
    words = " ".join(f"word{i}" for i in range(24))
    text = f"[[fake:typing=0.3]] A background answer, streamed. {words}. Done."
    key = "background-mid-stream-0001"
    killed = killed_mid_stream(env | BACKGROUND, tmp_path, api_key, mail, text, key)
    async with killed as (job_id, events, got):

        async def billed() -> bool:
            return [r[3] for r in await ledger(pool, job_id)] == ["ok"]

        await wait_for(billed, what="the call's one ledger row")

    assert got["status"] == "done" and events[-1] == ("end", got)
    tokens = [data for kind, data in events if kind == "token"]
    assert "reset" not in [kind for kind, _ in events]
    assert "".join(t["text"] for t in tokens) == got["result"]["summary"]
    numbers = [t["seq"] for t in tokens]
    assert numbers == sorted(set(numbers)), "no piece streamed twice"
    assert {t["response"] for t in tokens} == {"model/response"}
    stats = model.stats()
    assert (stats.background["created"], stats.dialects) == (1, {"responses": 1})
    # Streamed again once, from the last piece the killed worker published.
    [after] = model.model.resumed_after
    assert after in numbers[:-1] and numbers[numbers.index(after) + 1] > after
    assert await intents(pool, job_id) == ["model/response"]
    assert (await mail.deliveries())["effects"] == 1
