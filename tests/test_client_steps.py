"""oncely.client with multi-step jobs: ``wait`` that stops at a wait,
``send_event`` with the key contract, ``cancel``, and the 409s no retry
changes; against the real API in process and a real worker group serving
``tests.steps_app``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from oncely.bootstrap import Resources, WorkerGroup, connect_llm
from oncely.client import (
    AsyncClient,
    Backoff,
    EventAlreadyReceived,
    JobFinished,
    WaitTimedOut,
)
from tests import steps_app
from tests.helpers import asgi_app, count
from tests.test_client import AsyncFaults

BASE = "http://oncely.test"
FAST = Backoff(base_s=0.01, max_s=0.05)


@pytest.fixture
def api(settings, redis, pool) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=asgi_app(settings, redis, pool, steps_app.app))


@pytest.fixture
async def worker(worker_settings, redis, pool) -> AsyncIterator[None]:
    settings = worker_settings.model_copy(update={"block_ms": 50})
    llm = connect_llm(settings)
    group = WorkerGroup(steps_app.app, Resources(settings, redis, pool), llm)
    task = asyncio.create_task(group.run())
    yield
    group.stop()
    await task
    await llm.aclose()


async def test_wait_until_waiting_then_send_the_event_once_and_wait_for_the_end(
    api, api_key, worker, pool
):
    transport = AsyncFaults(api, "cut")  # the event's first try: stored, answer lost
    events = AsyncClient(BASE, api_key, transport=transport, backoff=FAST)
    async with AsyncClient(BASE, api_key, transport=api, poll=FAST) as c, events:
        accepted = await c.submit("/v1/approvals", {"text": "a refund of 30 EUR"})
        waiting = await c.wait("/v1/approvals", accepted.job_id, timeout_s=20, until_waiting=True)
        assert waiting.status == "waiting"
        assert waiting.waiting is not None and waiting.waiting.event == "approval"
        assert [(s.key, s.status) for s in waiting.steps] == [
            ("model", "done"),
            ("approval", "waiting"),
        ]
        received = await events.send_event(
            "/v1/approvals", accepted.job_id, "approval", {"approved": True, "by": "ada"}
        )
        assert received.replayed  # the retry got the stored answer
        assert (received.event, received.status) == ("approval", "received")
        keys = transport.script.keys()
        assert len(keys) == 2 and keys[0] == keys[1], "the retry sent the same key"
        done = await c.wait("/v1/approvals", accepted.job_id, timeout_s=20)
    assert done.status == "done"
    assert done.result is not None and done.result["by"] == "ada"
    assert done.usage is not None and done.usage.model_calls == 1
    assert await count(pool, "SELECT count(*) FROM job_events") == 1


async def test_the_409s_no_retry_changes_are_raised_at_once(api, api_key, worker):
    transport = AsyncFaults(api)
    async with AsyncClient(BASE, api_key, transport=transport, poll=FAST, backoff=FAST) as c:
        accepted = await c.submit("/v1/approvals", {"text": "a refund of 50 EUR"})
        job_id = accepted.job_id
        await c.wait("/v1/approvals", job_id, timeout_s=20, until_waiting=True)
        await c.send_event("/v1/approvals", job_id, "approval", {"approved": False, "by": "bo"})
        sent = len(transport.script.requests)
        with pytest.raises(EventAlreadyReceived):
            await c.send_event("/v1/approvals", job_id, "approval", {"approved": True, "by": "x"})
        assert len(transport.script.requests) == sent + 1, "not retried"
        await c.wait("/v1/approvals", job_id, timeout_s=20)
        before_cancel = len(transport.script.requests)
        with pytest.raises(JobFinished) as finished:
            await c.cancel("/v1/approvals", job_id)
        assert finished.value.job_status == "done"
        assert len(transport.script.requests) == before_cancel + 1, "not retried"


async def test_cancel_a_waiting_job_and_wait_sees_it_finished(api, api_key, worker):
    async with AsyncClient(BASE, api_key, transport=api, poll=FAST) as c:
        accepted = await c.submit("/v1/approvals", {"text": "never mind"})
        await c.wait("/v1/approvals", accepted.job_id, timeout_s=20, until_waiting=True)
        with pytest.raises(WaitTimedOut) as timed_out:
            await c.wait("/v1/approvals", accepted.job_id, timeout_s=2)
        assert "waiting for event 'approval'" in str(timed_out.value)
        cancelled = await c.cancel("/v1/approvals", accepted.job_id)
        again = await c.cancel("/v1/approvals", accepted.job_id)
        job = await c.wait("/v1/approvals", accepted.job_id, timeout_s=5)
    assert cancelled == again
    assert cancelled.status == "cancelled"
    assert job.status == "cancelled" and job.finished
