"""Multi-step workflows through real `oncely api`, `worker` and `relay`
processes (``--app tests.steps_app:app``), killed with SIGKILL, with Redis
losing its data, and cancelled from the CLI. Counted at the fakes: model
calls per prompt, effects at the provider, side calls in their file."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from oncely.fakes.llm import FakeLLMServer
from tests.helpers import scalar
from tests.processes import (
    Deployment,
    deployment_env,
    oncely,
    post,
    wait_effects,
    wait_for,
    wait_outcome,
)
from tests.steps_app import SIDE_CALLS, side_calls

pytestmark = pytest.mark.slow

APP = "tests.steps_app:app"


@pytest.fixture
def env(redis_url, database_url, providers, tmp_path) -> dict[str, str]:
    return steps_env(redis_url, database_url, providers, tmp_path)


def steps_env(redis_url, database_url, providers, tmp_path) -> dict[str, str]:
    """The settings of a deployment of ``tests.steps_app``, with a side-calls
    file in ``tmp_path``."""
    model, mail = providers
    return deployment_env(
        redis_url,
        database_url,
        model,
        mail,
        ONCELY_APP=APP,
        # A killed worker's entries are reclaimed after 1.5 s; leases renew every 0.5 s.
        ONCELY_CLAIM_IDLE_MS="1500",
        ONCELY_RECONCILE_AFTER_S="2",
        **{SIDE_CALLS: str(tmp_path / "side-calls.jsonl")},
    )


@asynccontextmanager
async def chain_order(
    env: dict[str, str], tmp_path: Path, api_key: str, text: str, key: str, hold_s: int
) -> AsyncIterator[tuple[Deployment, httpx.AsyncClient, str]]:
    """A deployment of ``env`` and an order of ``text`` posted to
    ``/v1/chain`` (idempotency key ``key``), its last model call held
    ``hold_s`` at the fake model: the deployment, a client, the job's id."""
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            body = {"text": text, "hold": f"[[fake:sleep={hold_s}]]"}
            yield d, client, await post(client, "/v1/chain", body, key)


@pytest.fixture
def chain(env, tmp_path, api_key) -> Callable[..., AbstractAsyncContextManager[Any]]:
    """``chain(text, key, hold_s)``: ``chain_order`` on the test's ``env``."""
    return functools.partial(chain_order, env, tmp_path, api_key)


async def wait_in_flight(model: FakeLLMServer, contains: str, what: str) -> None:
    """Wait until the model call whose prompt holds ``contains`` is in flight."""

    async def in_flight() -> bool:
        return model.stats(contains).in_flight == 1

    await wait_for(in_flight, what=what)


def calls(model: FakeLLMServer, contains: str) -> int:
    return sum(p.count for p in model.stats(contains).prompts)


async def test_sigkill_during_the_third_model_call_repeats_nothing_paid_for(
    pool, providers, env, chain
):
    """Four checkpoints; the worker is killed while the third model call is
    in flight. Another worker finishes the job: the first two model calls and
    the side step ran once, the interrupted call at most twice, one effect."""
    model, mail = providers
    side_file = Path(env[SIDE_CALLS])
    order = chain("sku-7 a long order. Three lamps.", "sigkill-third-call-0001", hold_s=2)
    async with order as (d, client, job_id):
        await wait_in_flight(model, "final:", "the third model call in flight")
        d.kill_worker()
        d.workers.append(d.start_worker())

        await wait_effects(mail, within_s=60, what="the order's webhook")
        job = (await client.get(f"/v1/chain/{job_id}")).json()

    assert job["status"] == "done", job
    assert [s["key"] for s in job["steps"]] == ["model", "lookup", "model#2", "model#3"]
    assert calls(model, "classify:") == 1
    assert calls(model, "draft:") == 1
    assert 1 <= calls(model, "final:") <= 2
    assert len(side_calls(side_file, "lookup")) == 1
    deliveries = await mail.deliveries()
    assert deliveries["effects"] == 1
    assert list(deliveries["by_key"]) == [f"order.fulfilled:{job_id}"]
    assert await scalar(pool, "SELECT count(*) FROM outbox WHERE job_id = %s", job_id) == 1


async def naps(client: httpx.AsyncClient, tag: str, n: int, sleep_s: int) -> list[str]:
    """``n`` jobs of ``/v1/naps`` sleeping ``sleep_s``, tagged ``tag``: their ids."""
    return [
        await post(
            client, "/v1/naps", {"text": f"zz-{i} {tag}", "sleep_s": sleep_s}, f"{tag}-{i:013}"
        )
        for i in range(n)
    ]


async def jobs_are(pool: Any, status: str, n: int) -> bool:
    """Whether exactly ``n`` jobs have ``status``."""
    return await scalar(pool, "SELECT count(*) FROM jobs WHERE status = %s", status) == n


async def test_a_sleep_outlives_sigkill_of_the_worker(api_key, pool, providers, env, tmp_path):
    """Jobs sleep; the only worker is killed; a new one, started later,
    resumes them when their time has come, each once."""
    model, mail = providers
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            ids = await naps(client, "nap", 4, sleep_s=2)
            await wait_for(lambda: jobs_are(pool, "waiting", 4), what="four sleeping jobs")
            d.kill_worker()
            # Their time passes with no worker at all (rewound in the database).
            due = await scalar(
                pool,
                "WITH due AS (UPDATE jobs SET wait_until = now() - interval '1 second'"
                " WHERE status = 'waiting' RETURNING 1) SELECT count(*) FROM due",
            )
            assert due == 4
            d.workers.append(d.start_worker())

            async def all_delivered() -> bool:
                return (await mail.deliveries())["effects"] == 4

            await wait_for(all_delivered, within_s=60, what="four webhooks")
            jobs = [(await client.get(f"/v1/naps/{job_id}")).json() for job_id in ids]

    assert [j["status"] for j in jobs] == ["done"] * 4
    assert calls(model, "after the nap:") == 4
    assert len(side_calls(Path(env[SIDE_CALLS]), "lookup")) == 4
    assert (await mail.deliveries())["requests"] == 4


async def test_waiting_jobs_resume_on_time_after_redis_lost_its_data(
    api_key, pool, redis, providers, env, tmp_path
):
    model, _ = providers
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            sleepers = await naps(client, "flush", 3, sleep_s=3)
            waiter = await post(
                client, "/v1/approvals", {"text": "times out", "wait_s": 3}, "flush-waiter-00001"
            )

            await wait_for(lambda: jobs_are(pool, "waiting", 4), what="four waiting jobs")
            # FLUSHALL as this database sees it: the server's other databases
            # are other test workers'.
            await redis.flushdb()

            await wait_for(
                lambda: jobs_are(pool, "done", 4), within_s=60, what="every waiting job done"
            )
            timed_out = (await client.get(f"/v1/approvals/{waiter}")).json()

    assert timed_out["result"]["approved"] is None
    assert calls(model, "after the nap:") == 3
    assert calls(model, "review:") == 1
    for job_id in sleepers:
        assert await scalar(pool, "SELECT count(*) FROM outbox WHERE job_id = %s", job_id) == 1


async def test_cancel_from_the_cli_stops_an_in_flight_call_and_writes_nothing(
    pool, providers, env, chain
):
    model, mail = providers
    order = chain("sku-8 cancel me", "cancel-in-flight-0001", hold_s=60)
    async with order as (_, client, job_id):
        await wait_in_flight(model, "final:", "the last model call in flight")
        cancelled = await asyncio.to_thread(oncely, "jobs", "cancel", job_id, "--json", env=env)
        assert cancelled.returncode == 0, cancelled.stderr
        assert json.loads(cancelled.stdout)["status"] == "cancelled"

        async def call_cancelled() -> bool:
            return model.stats("final:").abandoned == 1

        await wait_for(call_cancelled, what="the in-flight call cancelled")

        await wait_outcome(pool, job_id, "cancelled", "the delivery recorded as cancelled")
        job = (await client.get(f"/v1/chain/{job_id}")).json()
        again = await asyncio.to_thread(oncely, "jobs", "cancel", job_id, env=env)

    assert job["status"] == "cancelled"
    assert [s["key"] for s in job["steps"]] == ["model", "lookup", "model#2"]
    assert await scalar(pool, "SELECT count(*) FROM outbox WHERE job_id = %s", job_id) == 0
    assert await scalar(pool, "SELECT count(*) FROM results WHERE job_id = %s", job_id) == 0
    assert (await mail.deliveries())["effects"] == 0
    assert calls(model, "final:") == 1
    assert again.returncode == 0  # cancelling twice: the same answer
    shown = await asyncio.to_thread(oncely, "jobs", "show", job_id, "--json", env=env)
    detail = json.loads(shown.stdout)
    assert [c["key"] for c in detail["checkpoints"]] == ["model", "lookup", "model#2"]
    assert detail["checkpoints"][1]["value"] == {"sku": "sku-8"}
    rewind = await asyncio.to_thread(oncely, "jobs", "rewind", job_id, "--to", "nope", env=env)
    assert rewind.returncode == 3, rewind.stderr
    assert "model#2" in rewind.stderr
