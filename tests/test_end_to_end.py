"""POST → summary → exactly one email, through the same composition the
`oncely api`, `oncely worker` and `oncely relay` processes use, against real
Redis, real Postgres, the fake model and the fake mail provider over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from oncely.bootstrap import Resources, WorkerGroup, build_relay, connect_llm
from oncely.builtin import app as builtin_app
from oncely.fakes.mail import FakeMailServer
from oncely.settings import Settings
from tests.helpers import asgi_app, scalar, service_running

BODY = {"text": "One request. One summary. One email.", "notify": "ada@example.com"}


@pytest.fixture
async def mail(tmp_path) -> AsyncIterator[FakeMailServer]:
    async with FakeMailServer(tmp_path / "mailbox.jsonl") as server:
        yield server


@pytest.fixture
def e2e_settings(worker_settings: Settings, mail: FakeMailServer) -> Settings:
    return worker_settings.model_copy(
        update={"sender": "http", "sender_url": mail.url, "relay_poll_s": 30.0, "block_ms": 50}
    )


@pytest.mark.parametrize("llm_client", ["openai", "lean"])
async def test_retried_and_concurrent_posts_end_in_exactly_one_email(
    e2e_settings, redis, pool, auth, fake_llm, mail, tmp_path, llm_client
):
    e2e_settings = e2e_settings.model_copy(update={"llm_client": llm_client})
    res = Resources(e2e_settings, redis, pool)
    app = asgi_app(e2e_settings, redis, pool)
    llm = connect_llm(e2e_settings)
    expected = {"openai": "OpenAICompatible", "lean": "LeanOpenAICompatible"}[llm_client]
    assert type(llm).__name__ == expected  # ONCELY_LLM_CLIENT picks the client
    worker = WorkerGroup(builtin_app, res, llm)
    relay, sender = build_relay(builtin_app, res)
    headers = {**auth, "Idempotency-Key": "signup-42-welcome-summary"}
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            service_running(worker),
            service_running(relay),
            httpx.AsyncClient(transport=transport, base_url="http://oncely.test") as client,
        ):
            # A client that retries, plus duplicates racing each other.
            first = await client.post("/v1/summaries", json=BODY, headers=headers)
            racing = await asyncio.gather(
                *(client.post("/v1/summaries", json=BODY, headers=headers) for _ in range(10))
            )
            assert first.status_code == 202
            assert all(r.status_code in (202, 409) for r in racing)
            job_url = first.headers["location"]
            for _ in range(200):
                if (await mail.deliveries())["effects"] == 1:
                    break
                await asyncio.sleep(0.05)
            job = (await client.get(job_url, headers=auth)).json()
    finally:
        await sender.aclose()
        await llm.aclose()

    assert job["status"] == "done"
    assert job["summary"]
    assert relay.stats["woken_by_notify"] >= 1, "the worker's NOTIFY woke the relay, not a poll"
    deliveries = await mail.deliveries()
    assert deliveries["effects"] == 1
    assert deliveries["requests"] == 1
    assert fake_llm.stats().total == 1
    assert await scalar(pool, "SELECT count(*) FROM jobs") == 1
    assert await scalar(pool, "SELECT count(*) FROM summaries") == 1
    assert await scalar(pool, "SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL") == 1
    [line] = (tmp_path / "mailbox.jsonl").read_text().splitlines()
    email = json.loads(line)
    assert email["to"] == "ada@example.com"
    assert email["idempotency_key"] == f"summary_ready:{job['job_id']}"
    assert job["summary"] in email["text"]
