"""Real `oncely` processes, stopped with signals and killed with SIGKILL.

The fake model runs in the test process; the worker is a separate process
talking to it, to Redis and to Postgres over real connections.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from oncely.builtin.summaries import summaries
from oncely.fakes.llm import FakeLLMServer
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query
from tests.helpers import scalar

pytestmark = pytest.mark.slow


def start_worker(env: dict[str, str], log: Path, **extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "oncely", "worker"],
        env={**os.environ, **env, **extra},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


@pytest.fixture
async def fake_llm():
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
def worker_env(redis_url, database_url, fake_llm) -> dict[str, str]:
    return {
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_LLM_BASE_URL": fake_llm.url,
        "ONCELY_LOG_FORMAT": "json",
        "ONCELY_BLOCK_MS": "50",
    }


async def submit_jobs(pool, redis, n: int, text: str) -> list[str]:
    stream = Stream(redis, summaries.keys)
    await stream.ensure_group()
    ids = []
    for i in range(n):
        job_id = str(uuid.uuid4())
        payload = {"text": f"{text} (job {i})", "notify": "ada@example.com"}
        async with pool.connection() as conn:
            await conn.execute(query("insert_job"), (job_id, "acme", "summaries", Jsonb(payload)))
        await stream.enqueue(JobMessage.new(job_id, "acme", payload))
        ids.append(job_id)
    return ids


async def wait_for(predicate, within_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def exit_code(proc: subprocess.Popen[bytes], within_s: float = 20.0) -> int:
    return await asyncio.to_thread(proc.wait, within_s)


async def test_sigterm_lets_in_flight_jobs_finish_and_exits_zero(
    pool, redis, fake_llm, worker_env, tmp_path
):
    await submit_jobs(pool, redis, 10, "Slow model. [[fake:sleep=1]]")
    proc = start_worker(worker_env, tmp_path / "worker.log")

    async def all_in_flight() -> bool:
        return fake_llm.stats().in_flight == 10

    await wait_for(all_in_flight)
    proc.send_signal(signal.SIGTERM)
    assert await exit_code(proc) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    assert await scalar(pool, "SELECT count(*) FROM jobs WHERE status = 'done'") == 10
    assert await scalar(pool, "SELECT count(*) FROM outbox") == 10
    assert fake_llm.stats().total == 10
    info: Any = await redis.xpending("oncely:{summaries}:stream", "summarisers")
    assert info["pending"] == 0


async def test_sigkill_mid_job_loses_nothing_and_duplicates_nothing(
    pool, redis, fake_llm, worker_env, tmp_path
):
    """kill -9 with jobs in flight; a second worker reclaims them after
    claim_idle_ms. Every job ends done with one summary and one outbox row."""
    ids = await submit_jobs(pool, redis, 8, "Slow model. [[fake:sleep=0.5]]")
    env = {**worker_env, "ONCELY_CLAIM_IDLE_MS": "500"}
    first = start_worker(env, tmp_path / "first.log")

    async def some_in_flight() -> bool:
        return fake_llm.stats().in_flight >= 4

    await wait_for(some_in_flight)
    first.kill()
    assert await exit_code(first) == -signal.SIGKILL
    second = start_worker(env, tmp_path / "second.log")

    async def all_done() -> bool:
        done = await scalar(pool, "SELECT count(*) FROM jobs WHERE status = 'done'")
        return bool(done == len(ids))

    try:
        await wait_for(all_done, within_s=20)
    finally:
        second.send_signal(signal.SIGTERM)
        assert await exit_code(second) == 0
    assert await scalar(pool, "SELECT count(*) FROM summaries") == len(ids)
    assert await scalar(pool, "SELECT count(*) FROM outbox") == len(ids)
    assert await scalar(pool, "SELECT count(DISTINCT dedupe_key) FROM outbox") == len(ids)
    info: Any = await redis.xpending("oncely:{summaries}:stream", "summarisers")
    assert info["pending"] == 0
    # Killed mid-call: those jobs were paid for twice at most (documented).
    assert fake_llm.stats().total <= 2 * len(ids)


async def add_outbox_rows(pool, n: int) -> None:
    async with pool.connection() as conn:
        for i in range(n):
            job_id = str(uuid.uuid4())
            await conn.execute(
                query("insert_job"),
                (job_id, "acme", "summaries", Jsonb({"text": "t", "notify": "a@x.io"})),
            )
            await conn.execute(
                query("insert_outbox"),
                (
                    "email.summary_ready",
                    f"summary_ready:{job_id}",
                    Jsonb({"job_id": job_id, "to": f"user{i}@example.com", "summary": "s"}),
                ),
            )
        await conn.execute(query("notify_outbox"))


def start_relay(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "oncely", "relay"],
        env={**os.environ, **env},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


async def test_relay_killed_mid_send_resends_with_the_same_key_and_one_effect(
    pool, redis_url, database_url, tmp_path
):
    from oncely.fakes.mail import FakeMailServer, Faults

    async with FakeMailServer(tmp_path / "mailbox.jsonl") as mail:
        env = {
            "ONCELY_REDIS_URL": redis_url,
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_SENDER_URL": mail.url,
            "ONCELY_LOG_FORMAT": "json",
        }
        mail.state.script(Faults(delay_s=1.0))  # the provider is slow to act and answer
        await add_outbox_rows(pool, 5)
        first = start_relay(env, tmp_path / "first.log")

        async def all_requested() -> bool:
            return (await mail.deliveries())["requests"] == 5

        async def provider_acted() -> bool:
            return (await mail.deliveries())["effects"] == 5

        await wait_for(all_requested)
        first.kill()  # mid-send: no answer came back, no row is marked sent
        assert await exit_code(first) == -signal.SIGKILL
        await wait_for(provider_acted)  # the provider still acts on what it received
        assert await scalar(pool, "SELECT count(*) FROM outbox WHERE sent_at IS NULL") == 5
        async with pool.connection() as conn:  # time passes: the leases expire
            await conn.execute("UPDATE outbox SET locked_until = now() - interval '1 s'")
        mail.state.script(Faults())
        second = start_relay(env, tmp_path / "second.log")

        async def all_sent() -> bool:
            return bool(
                await scalar(pool, "SELECT count(*) FROM outbox WHERE sent_at IS NULL") == 0
            )

        try:
            await wait_for(all_sent)
        finally:
            second.send_signal(signal.SIGTERM)
            assert await exit_code(second) == 0
        deliveries = await mail.deliveries()
    assert deliveries["requests"] == 10
    assert deliveries["effects"] == 5
    assert all(n == 2 for n in deliveries["by_key"].values())
    assert len((tmp_path / "mailbox.jsonl").read_text().splitlines()) == 5
    assert await scalar(pool, "SELECT max(attempts) FROM outbox") == 2
