"""Multi-step workflows through real `oncely api`, `worker` and `relay`
processes (``--app tests.steps_app:app``), killed with SIGKILL, with Redis
losing its data, and cancelled from the CLI. Counted at the fakes: model
calls per prompt, effects at the provider, side calls in their file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

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


async def wait_in_flight(model: FakeLLMServer, contains: str, what: str) -> None:
    """Wait until the model call whose prompt holds ``contains`` is in flight."""

    async def in_flight() -> bool:
        return model.stats(contains).in_flight == 1

    await wait_for(in_flight, what=what)


def calls(model: FakeLLMServer, contains: str) -> int:
    return sum(p.count for p in model.stats(contains).prompts)


async def test_sigkill_during_the_third_model_call_repeats_nothing_paid_for(
    api_key, pool, providers, env, tmp_path
):
    """Four checkpoints; the worker is killed while the third model call is
    in flight. Another worker finishes the job: the first two model calls and
    the side step ran once, the interrupted call at most twice, one effect."""
    model, mail = providers
    side_file = Path(env[SIDE_CALLS])
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            body = {"text": "sku-7 a long order. Three lamps.", "hold": "[[fake:sleep=2]]"}
            job_id = await post(client, "/v1/chain", body, "sigkill-third-call-0001")

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


async def test_a_sleep_outlives_sigkill_of_the_worker(api_key, pool, providers, env, tmp_path):
    """Jobs sleep; the only worker is killed; a new one, started later,
    resumes them when their time has come, each once."""
    model, mail = providers
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            ids = [
                await post(
                    client, "/v1/naps", {"text": f"zz-{n} nap", "sleep_s": 2}, f"nap-{n:013}"
                )
                for n in range(4)
            ]

            async def all_waiting() -> bool:
                n = await scalar(pool, "SELECT count(*) FROM jobs WHERE status = 'waiting'")
                return bool(n == 4)

            await wait_for(all_waiting, what="four sleeping jobs")
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
            sleepers = [
                await post(
                    client, "/v1/naps", {"text": f"zz-{n} flush", "sleep_s": 3}, f"flush-{n:012}"
                )
                for n in range(3)
            ]
            waiter = await post(
                client, "/v1/approvals", {"text": "times out", "wait_s": 3}, "flush-waiter-00001"
            )

            async def all_waiting() -> bool:
                n = await scalar(pool, "SELECT count(*) FROM jobs WHERE status = 'waiting'")
                return bool(n == 4)

            await wait_for(all_waiting, what="four waiting jobs")
            # FLUSHALL as this database sees it: the server's other databases
            # are other test workers'.
            await redis.flushdb()

            async def all_done() -> bool:
                n = await scalar(pool, "SELECT count(*) FROM jobs WHERE status = 'done'")
                return bool(n == 4)

            await wait_for(all_done, within_s=60, what="every waiting job done")
            timed_out = (await client.get(f"/v1/approvals/{waiter}")).json()

    assert timed_out["result"]["approved"] is None
    assert calls(model, "after the nap:") == 3
    assert calls(model, "review:") == 1
    for job_id in sleepers:
        assert await scalar(pool, "SELECT count(*) FROM outbox WHERE job_id = %s", job_id) == 1


async def test_cancel_from_the_cli_stops_an_in_flight_call_and_writes_nothing(
    api_key, pool, providers, env, tmp_path
):
    model, mail = providers
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            body = {"text": "sku-8 cancel me", "hold": "[[fake:sleep=60]]"}
            job_id = await post(client, "/v1/chain", body, "cancel-in-flight-0001")

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
