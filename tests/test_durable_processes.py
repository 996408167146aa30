"""Multi-step workflows through real `oncely api`, `worker` and `relay`
processes (``--app tests.steps_app:app``), killed with SIGKILL, with Redis
losing its data, and cancelled from the CLI. Counted at the fakes: model
calls per prompt, effects at the provider, side calls in their file."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from oncely.api.auth import create_api_key
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from tests.helpers import scalar
from tests.processes import free_port, oncely, running, start, wait_for, wait_healthy
from tests.steps_app import SIDE_CALLS, side_calls

pytestmark = pytest.mark.slow

APP = "tests.steps_app:app"


@pytest.fixture
async def providers(tmp_path: Path) -> AsyncIterator[tuple[FakeLLMServer, FakeMailServer]]:
    async with FakeLLMServer() as model, FakeMailServer(tmp_path / "mailbox.jsonl") as mail:
        yield model, mail


@pytest.fixture
def env(redis_url, database_url, providers, tmp_path) -> dict[str, str]:
    model, mail = providers
    return {
        "ONCELY_APP": APP,
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_LLM_BASE_URL": model.url,
        "ONCELY_SENDER_URL": mail.url,
        "ONCELY_WEBHOOK_URL": mail.events_url,
        "ONCELY_WEBHOOK_SECRET": "whsec_" + "c2VjcmV0LWZvci10ZXN0cy1vbmx5LTEyMzQ1Njc4",
        "ONCELY_LOG_FORMAT": "json",
        "ONCELY_BLOCK_MS": "50",
        # A killed worker's entries are reclaimed after 1.5 s; leases renew every 0.5 s.
        "ONCELY_CLAIM_IDLE_MS": "1500",
        "ONCELY_RECONCILE_AFTER_S": "2",
        SIDE_CALLS: str(tmp_path / "side-calls.jsonl"),
    }


def calls(model: FakeLLMServer, contains: str) -> int:
    return sum(p.count for p in model.stats(contains).prompts)


class Deployment:
    """An API, a relay, and a worker that a test may kill and start again;
    ``with deployment:`` stops every one of them, the ones started later
    included."""

    def __init__(self, env: dict[str, str], tmp_path: Path) -> None:
        self.env = env
        self.tmp_path = tmp_path
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api = start(["api", "--port", str(self.port)], env, tmp_path / "api.log")
        self.relay = start(["relay"], env, tmp_path / "relay.log")
        self.workers = [self.start_worker()]

    def start_worker(self) -> Any:
        n = len(getattr(self, "workers", []))
        return start(["worker"], self.env, self.tmp_path / f"worker-{n}.log")

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *_: object) -> None:
        with running(self.api, self.relay, *self.workers):
            pass

    def log(self, name: str) -> str:
        return (self.tmp_path / name).read_text()[-4000:]


async def post(client: httpx.AsyncClient, route: str, body: dict[str, Any], key: str) -> str:
    r = await client.post(route, json=body, headers={"Idempotency-Key": key})
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


async def test_sigkill_during_the_third_model_call_repeats_nothing_paid_for(
    pool, providers, env, tmp_path
):
    """Four checkpoints; the worker is killed while the third model call is
    in flight. Another worker finishes the job: the first two model calls and
    the side step ran once, the interrupted call at most twice, one effect."""
    model, mail = providers
    key = await create_api_key(pool, "acme")
    side_file = Path(env[SIDE_CALLS])
    d = Deployment(env, tmp_path)
    with d:
        await wait_healthy(d.base, d.api, tmp_path / "api.log")
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=d.base, headers=auth) as client:
            body = {"text": "sku-7 a long order. Three lamps.", "hold": "[[fake:sleep=2]]"}
            job_id = await post(client, "/v1/chain", body, "sigkill-third-call-0001")

            async def third_call_in_flight() -> bool:
                return model.stats("final:").in_flight == 1

            await wait_for(third_call_in_flight, what="the third model call in flight")
            d.workers[0].send_signal(signal.SIGKILL)
            d.workers[0].wait(10)
            d.workers.append(d.start_worker())

            async def delivered() -> bool:
                return (await mail.deliveries())["effects"] >= 1

            await wait_for(delivered, within_s=60, what="the order's webhook")
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


async def test_a_sleep_outlives_sigkill_of_the_worker(pool, providers, env, tmp_path):
    """Jobs sleep; the only worker is killed; a new one, started later,
    resumes them when their time has come, each once."""
    model, mail = providers
    key = await create_api_key(pool, "acme")
    d = Deployment(env, tmp_path)
    with d:
        await wait_healthy(d.base, d.api, tmp_path / "api.log")
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=d.base, headers=auth) as client:
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
            d.workers[0].send_signal(signal.SIGKILL)
            d.workers[0].wait(10)
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
    pool, redis, providers, env, tmp_path
):
    model, _ = providers
    key = await create_api_key(pool, "acme")
    d = Deployment(env, tmp_path)
    with d:
        await wait_healthy(d.base, d.api, tmp_path / "api.log")
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=d.base, headers=auth) as client:
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
    pool, providers, env, tmp_path
):
    model, mail = providers
    key = await create_api_key(pool, "acme")
    d = Deployment(env, tmp_path)
    with d:
        await wait_healthy(d.base, d.api, tmp_path / "api.log")
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=d.base, headers=auth) as client:
            body = {"text": "sku-8 cancel me", "hold": "[[fake:sleep=60]]"}
            job_id = await post(client, "/v1/chain", body, "cancel-in-flight-0001")

            async def third_call_in_flight() -> bool:
                return model.stats("final:").in_flight == 1

            await wait_for(third_call_in_flight, what="the last model call in flight")
            cancelled = await asyncio.to_thread(oncely, "jobs", "cancel", job_id, "--json", env=env)
            assert cancelled.returncode == 0, cancelled.stderr
            assert json.loads(cancelled.stdout)["status"] == "cancelled"

            async def call_cancelled() -> bool:
                return model.stats("final:").abandoned == 1

            await wait_for(call_cancelled, what="the in-flight call cancelled")

            async def acknowledged() -> bool:
                outcome = await scalar(
                    pool,
                    "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id DESC",
                    job_id,
                )
                return outcome == "cancelled"

            await wait_for(acknowledged, what="the delivery recorded as cancelled")
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
