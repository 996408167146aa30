"""A worker and a relay started with ONCELY_METRICS_PORT can be scraped for
backlog and latency, and answer liveness and readiness."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from oncely.fakes.llm import FakeLLMServer
from tests.helpers import submit
from tests.processes import free_port, running, start, wait_for

pytestmark = pytest.mark.slow


async def get(url: str) -> httpx.Response | None:
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            return await client.get(url)
    except httpx.TransportError:
        return None


async def test_worker_and_relay_serve_metrics_health_and_readiness(
    redis_url, database_url, redis, pool, stream, tmp_path
):
    async with FakeLLMServer() as model:
        for i in range(3):
            await submit(pool, stream, f"Scrape me {i}.")
        ports = {"worker": free_port(), "relay": free_port()}
        env = {
            "ONCELY_REDIS_URL": redis_url,
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_LLM_BASE_URL": model.url,
            "ONCELY_SENDER_URL": "http://127.0.0.1:9/v1/messages",  # nobody there
            "ONCELY_BLOCK_MS": "50",
        }
        procs = [
            start([name], {**env, "ONCELY_METRICS_PORT": str(port)}, tmp_path / f"{name}.log")
            for name, port in ports.items()
        ]
        with running(*procs):
            worker = f"http://127.0.0.1:{ports['worker']}"
            relay = f"http://127.0.0.1:{ports['relay']}"

            async def three_done() -> bool:
                r = await get(f"{worker}/metrics")
                return r is not None and (
                    'oncely_jobs_total{outcome="done",workflow="summaries"} 3.0' in r.text
                )

            async def relay_up() -> bool:
                return await get(f"{relay}/metrics") is not None

            await wait_for(three_done, what="the worker's metrics to count 3 jobs")
            await wait_for(relay_up, what="the relay's metrics port")
            await asyncio.sleep(0.1)
            worker_metrics = (await get(f"{worker}/metrics")).text  # type: ignore[union-attr]
            relay_metrics = (await get(f"{relay}/metrics")).text  # type: ignore[union-attr]
            health = await get(f"{worker}/healthz")
            ready = await get(f"{relay}/readyz")
    assert health is not None and health.status_code == 200 and health.json()["alive"]
    assert ready is not None
    assert ready.json() == {"ready": True, "redis": True, "postgres": True, "wake_up": "notify"}
    assert 'oncely_stream_length{workflow="summaries"}' in worker_metrics
    assert 'oncely_stream_pending{workflow="triage"} 0.0' in worker_metrics
    assert 'oncely_job_seconds_count{workflow="summaries"} 3.0' in worker_metrics
    assert "oncely_model_call_seconds_bucket" in worker_metrics
    # Nobody answers at the mail address: three emails wait in the outbox.
    assert "oncely_outbox_unsent 3.0" in relay_metrics
    assert "oncely_outbox_oldest_unsent_age_seconds" in relay_metrics


async def test_the_api_moves_metrics_off_its_public_port(redis_url, database_url, redis, tmp_path):
    port, metrics_port = free_port(), free_port()
    env = {
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_METRICS_PORT": str(metrics_port),
    }
    api = start(["api", "--port", str(port)], env, tmp_path / "api.log")
    with running(api):

        async def up() -> bool:
            r = await get(f"http://127.0.0.1:{metrics_port}/metrics")
            return r is not None and r.status_code == 200

        await wait_for(up, what="the API's metrics port")
        public = await get(f"http://127.0.0.1:{port}/metrics")
        private = await get(f"http://127.0.0.1:{metrics_port}/metrics")
        ready = await get(f"http://127.0.0.1:{metrics_port}/readyz")
    assert public is not None and public.status_code == 404
    assert private is not None and "oncely_requests_total" in private.text
    assert ready is not None and ready.json()["ready"] is True
