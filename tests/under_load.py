"""Real ``oncely`` processes under load while something breaks, then the
count: every accepted request one job, one result, one outbox row and one
email. Used by the restart, freeze and cluster failover tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg
from psycopg_pool import AsyncConnectionPool

from oncely.api.auth import create_api_key
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from tests.processes import free_port, running, start, tail, wait_for, wait_healthy

T = TypeVar("T")

# Recovery short enough for a test (docs/settings.md): the reconciler,
# redelivery, the relay's poll and every server bound within seconds.
QUICK_RECOVERY = {
    "ONCELY_LOG_FORMAT": "json",
    "ONCELY_BLOCK_MS": "50",
    "ONCELY_RECONCILE_AFTER_S": "2",
    "ONCELY_CLAIM_IDLE_MS": "3000",
    "ONCELY_REDELIVERY_BASE_S": "0.5",
    "ONCELY_REDELIVERY_MAX_S": "2",
    "ONCELY_RELAY_POLL_S": "0.5",
    "ONCELY_REDIS_TIMEOUT_S": "2",
    "ONCELY_PG_STATEMENT_TIMEOUT_S": "2",
    "ONCELY_CONNECT_TIMEOUT_S": "2",
}


async def submit_until_accepted(client: httpx.AsyncClient, i: int, label: str) -> str:
    """A well-behaved client: the same key until the request is accepted;
    its job id."""
    body = {"text": f"Request {i} survives {label}. [[fake:sleep=0.2]]", "notify": "a@x.io"}
    headers = {"Idempotency-Key": f"{label}-{i:04d}"}
    for _ in range(600):
        with contextlib.suppress(httpx.TransportError):
            r = await client.post("/v1/summaries", json=body, headers=headers)
            if r.status_code == 202:
                return str(r.json()["job_id"])
            assert r.status_code in (409, 500, 503), r.text
        await asyncio.sleep(0.1)
    raise AssertionError(f"request {i} never accepted")


async def later(delay_s: float, coro: Awaitable[T]) -> T:
    await asyncio.sleep(delay_s)
    return await coro


async def scalar(url: str, sql: str) -> Any:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        row = await (await conn.execute(sql)).fetchone()
    return row[0] if row else None


async def every_job_once_under(
    disrupt: Callable[[], Awaitable[None]],
    *,
    database_url: str,
    redis_env: dict[str, str],
    tmp_path: Path,
    label: str,
    requests: int,
    workers: int = 2,
    defaults: tuple[str, ...] = (),
    recovered_within_s: float = 120,
) -> None:
    """An api, ``workers`` workers and a relay; ``requests`` clients, 0.1 s
    apart, each retrying its key until accepted; ``disrupt`` once the first
    emails are out. Then nothing lost, nothing duplicated, no process
    restarted by hand, every email out within ``recovered_within_s`` of the
    disruption's end. ``redis_env``: the processes' Redis settings;
    ``defaults``: settings of QUICK_RECOVERY left at their defaults."""
    async with FakeLLMServer() as model, FakeMailServer() as mail:
        async with AsyncConnectionPool(
            database_url, open=False, kwargs={"autocommit": True}
        ) as pool:
            await pool.open(wait=True)
            key = await create_api_key(pool, "acme")
        port = free_port()
        env = {
            **{k: v for k, v in QUICK_RECOVERY.items() if k not in defaults},
            **redis_env,
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_LLM_BASE_URL": model.url,
            "ONCELY_SENDER_URL": mail.url,
        }
        logs = ["api.log", *(f"worker{n}.log" for n in range(workers)), "relay.log"]
        commands = [["api", "--port", str(port)], *(["worker"] for _ in range(workers)), ["relay"]]
        procs = [start(c, env, tmp_path / log) for c, log in zip(commands, logs, strict=True)]
        base = f"http://127.0.0.1:{port}"
        with running(*procs):
            await wait_healthy(base, procs[0], tmp_path / logs[0])
            async with httpx.AsyncClient(
                base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30
            ) as client:
                load = [
                    asyncio.create_task(later(i * 0.1, submit_until_accepted(client, i, label)))
                    for i in range(requests)
                ]

                async def first_emails_out() -> bool:
                    for task in load:  # a client that failed fails the test now
                        if task.done():
                            task.result()
                    return (await mail.deliveries())["effects"] >= 5

                await wait_for(first_emails_out, within_s=60, what="the first emails")
                await disrupt()
                accepted = await asyncio.gather(*load)

            async def all_delivered() -> bool:
                return (await mail.deliveries())["effects"] >= len(set(accepted))

            await wait_for(
                all_delivered, within_s=recovered_within_s, what="every accepted job's email"
            )
            alive = [p.poll() is None for p in procs]
        assert all(alive), [tail(tmp_path / log) for log in logs]
        deliveries = await mail.deliveries()
        model_calls = model.stats().total
    assert len(set(accepted)) == requests, "one job per key"
    for table in ("jobs", "results", "outbox"):
        assert await scalar(database_url, f"SELECT count(*) FROM {table}") == requests, table
    done = await scalar(database_url, "SELECT count(*) FROM jobs WHERE status = 'done'")
    assert done == requests
    assert deliveries["effects"] == requests, "one email per job, none twice"
    assert set(deliveries["by_key"]) == {f"summary_ready:{j}" for j in accepted}
    # A disruption may cost a job a second model call (its delivery was lost
    # mid-call), never more than a few.
    assert requests <= model_calls <= requests * 2
