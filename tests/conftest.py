"""Real servers for every test: embedded ones, or the URLs in
ONCELY_TEST_REDIS_URL / ONCELY_TEST_DATABASE_URL.

Isolation: each test gets a fresh database cloned from a migrated template,
and a flushed Redis database. Under pytest-xdist (``make test`` runs four
workers), each worker starts its own embedded servers; on servers named by
the environment, worker N takes the Redis database N below the URL's (15,
14, … for ``/15``), so that no worker flushes another's.

Cluster mode (ONCELY_TEST_REDIS_CLUSTER=1): Redis is a three-node Valkey
cluster started from the embedded binary (or the cluster whose node
ONCELY_TEST_REDIS_URL names); tests get a cluster client, every process
they start inherits ONCELY_REDIS_CLUSTER=true, and each test flushes every
primary. The URL handed out names a node that does not own the summaries
stream's slot, so every test follows a redirection. Tests marked
``standalone_redis`` are skipped there.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import pytest
from psycopg import conninfo
from psycopg_pool import AsyncConnectionPool
from redis.crc import key_slot

from oncely.api.auth import create_api_key
from oncely.bootstrap import connect_llm, make_redis, step_config
from oncely.builtin import app as builtin_app
from oncely.builtin.summaries import summaries
from oncely.embedded import EmbeddedCluster, EmbeddedServers
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from oncely.jobs.checkpoints import Checkpoints
from oncely.jobs.handler import WorkflowHandler
from oncely.jobs.store import Jobs
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.stream import Stream
from oncely.redis_client import RedisClient
from oncely.settings import Settings
from oncely.sql.migrate import migrate
from tests.durable import custom, harness  # noqa: F401 (fixtures for the multi-step tests)
from tests.helpers import asgi_app, own_folder

_counter = itertools.count()

CLUSTER = os.environ.get("ONCELY_TEST_REDIS_CLUSTER", "") not in ("", "0", "false")


def pytest_configure(config: pytest.Config) -> None:
    if CLUSTER:
        # Settings() in this process and every `oncely` process a test starts.
        os.environ["ONCELY_REDIS_CLUSTER"] = "true"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """A test that starts a process belongs to the slow tier (`make test`
    stays fast on a loaded machine): in any other, starting one fails the
    test, saying so. Fixtures' servers start before the test and count not."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    real = subprocess.Popen.__init__

    def refused(self: subprocess.Popen[Any], args: Any, *rest: Any, **options: Any) -> None:
        raise AssertionError(
            f"{item.nodeid} starts a process ({args!r:.80}): mark it @pytest.mark.slow"
        )

    subprocess.Popen.__init__ = refused  # type: ignore[method-assign]
    try:
        return (yield)
    finally:
        subprocess.Popen.__init__ = real  # type: ignore[method-assign]


# The modules CI runs again on a cluster (marked ``cluster``): everything that
# talks to Redis on the request and job paths, the erasure and the console.
CLUSTER_SUITE = {
    "test_api_hardening.py",
    "test_api_intake.py",
    "test_call_together.py",
    "test_console.py",
    "test_dead_letters.py",
    "test_durable_steps.py",
    "test_end_to_end.py",
    "test_idempotency.py",
    "test_key_slots.py",
    "test_lifecycle.py",
    "test_limiter.py",
    "test_model_routing.py",
    "test_reconcile.py",
    "test_redis_cluster.py",
    "test_tenant_limit.py",
    "test_withdrawals.py",
    "test_worker.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in CLUSTER_SUITE:
            item.add_marker(pytest.mark.cluster)
    if not CLUSTER:
        return
    for item in items:
        mark = item.get_closest_marker("standalone_redis")
        if mark is not None:
            reason = mark.args[0] if mark.args else "needs a single Redis server"
            item.add_marker(pytest.mark.skip(reason=f"not on a Redis Cluster: {reason}"))


def _worker_number() -> int:
    """This pytest-xdist worker's number (``gw3`` → 3), 0 without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw") or 0)


def _own_database(redis_url: str) -> str:
    """The Redis URL with this worker's own database (see the module's docstring)."""
    number = _worker_number()
    if number == 0 or CLUSTER:
        return redis_url  # a cluster has one database: its runs are not split
    parsed = urlsplit(redis_url)
    base = int(parsed.path.strip("/") or 0)
    return urlunsplit(parsed._replace(path=f"/{(base - number) % 16}"))


@pytest.fixture(scope="session")
def server_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    redis_url = os.environ.get("ONCELY_TEST_REDIS_URL")
    if redis_url:
        redis_url = _own_database(redis_url)
    database_url = os.environ.get("ONCELY_TEST_DATABASE_URL")
    servers = cluster = None
    if CLUSTER and not redis_url:
        cluster = EmbeddedCluster(tmp_path_factory.mktemp("cluster"))
        cluster.start()
        redis_url = cluster.url_not_owning(key_slot(summaries.keys.stream.encode()))
    with own_folder("oncely-test-servers-") as own:
        if not redis_url or not database_url:
            servers = EmbeddedServers(own)
            urls = servers.start()
            redis_url = redis_url or urls.redis_url
            if not database_url:
                database_url = urls.database_url
                _without_flushes(database_url)
        yield redis_url, database_url
        if servers is not None:
            servers.stop()
        if cluster is not None:
            cluster.stop()


@pytest.fixture
def servers_dir() -> Iterator[Path]:
    """A folder for a test's own embedded servers (``own_folder``)."""
    with own_folder("oncely-test-own-") as own:
        yield own


def _without_flushes(database_url: str) -> None:
    """The suite's own PostgreSQL does not wait for the disk: every test
    creates and drops a database, and four workers' flushes on one disk
    made single commits take most of a second. Stopping and restarting it
    cleanly (the fault tests' restarts) still loses nothing."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        for setting in ("fsync", "synchronous_commit", "full_page_writes"):
            conn.execute(f"ALTER SYSTEM SET {setting} = off")
        conn.execute("SELECT pg_reload_conf()")


def _with_dbname(url: str, dbname: str) -> str:
    params = conninfo.conninfo_to_dict(url)
    params["dbname"] = dbname
    return conninfo.make_conninfo(**params)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def template_db(server_urls: tuple[str, str]) -> Iterator[str]:
    """A migrated database that every test's database is cloned from."""
    _, admin_url = server_urls
    name = f"oncely_tmpl_{os.getpid()}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    asyncio.run(migrate(_with_dbname(admin_url, name)))
    yield name
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _cloned_database(admin_url: str, template_db: str, prefix: str) -> Iterator[str]:
    """A fresh database cloned from the migrated template, dropped afterwards."""
    name = f"{prefix}_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield _with_dbname(admin_url, name)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(server_urls: tuple[str, str], template_db: str) -> Iterator[str]:
    yield from _cloned_database(server_urls[1], template_db, "oncely_t")


@pytest.fixture(scope="module")
def module_database_url(server_urls: tuple[str, str], template_db: str) -> Iterator[str]:
    """A database for one module's tests to share, e.g. behind a real process
    they all talk to (each test still flushes Redis)."""
    yield from _cloned_database(server_urls[1], template_db, "oncely_m")


@pytest.fixture
def redis_url(server_urls: tuple[str, str]) -> str:
    return server_urls[0]


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[RedisClient]:
    client = make_redis(redis_url, cluster=CLUSTER)
    await client.flushdb()  # on a cluster: every primary
    yield client
    await client.aclose()


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[AsyncConnectionPool]:
    async with AsyncConnectionPool(
        database_url, min_size=1, max_size=10, open=False, kwargs={"autocommit": True}
    ) as p:
        await p.open(wait=True)
        yield p


@pytest.fixture
def settings(redis_url: str, database_url: str, tmp_path: Path) -> Settings:
    return Settings(
        redis_url=redis_url,
        database_url=database_url,
        data_dir=tmp_path,
        log_format="console",
        # Short, so that tests of revocation wait a moment, not the default 10 s.
        api_key_cache_s=0.5,
        redis_cluster=CLUSTER,
    )


@pytest.fixture
async def client(
    settings: Settings, redis: RedisClient, pool: AsyncConnectionPool
) -> AsyncIterator[httpx.AsyncClient]:
    app = asgi_app(settings, redis, pool)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://oncely.test") as c:
        yield c


@pytest.fixture
async def api_key(pool: AsyncConnectionPool) -> str:
    return await create_api_key(pool, "acme")


@pytest.fixture
def auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture
async def fake_llm() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
def mailbox(tmp_path: Path) -> Path:
    """Where the fake mail server of ``mail`` writes what it received."""
    return tmp_path / "mailbox.jsonl"


@pytest.fixture
async def mail(mailbox: Path) -> AsyncIterator[FakeMailServer]:
    """The fake mail and webhook receiver, writing to ``mailbox``."""
    async with FakeMailServer(mailbox) as server:
        yield server


@pytest.fixture
async def providers(tmp_path: Path) -> AsyncIterator[tuple[FakeLLMServer, FakeMailServer]]:
    """The fake model and the fake mail and webhook receiver (its mailbox in
    ``tmp_path``), for the processes a test starts."""
    async with FakeLLMServer() as model, FakeMailServer(tmp_path / "mailbox.jsonl") as mail:
        yield model, mail


@pytest.fixture
def worker_settings(settings: Settings, fake_llm: FakeLLMServer) -> Settings:
    return settings.model_copy(
        update={
            "llm_base_url": fake_llm.url,
            # Bounds no busy machine reaches: a call cut off by its timeout is
            # retried, and tests count calls. Tests of the bounds set their own.
            "llm_timeout_s": 20.0,
            "job_budget_s": 60.0,
            "llm_backoff_base_s": 0.01,
            "llm_backoff_max_s": 0.05,
            "llm_retry_after_max_s": 0.05,
        }
    )


@pytest.fixture
def jobs(pool: AsyncConnectionPool, redis: RedisClient) -> Jobs:
    """Jobs of the built-in app's workflows, each with its stream."""
    return Jobs(pool, {w.name: Stream(redis, w.keys) for w in builtin_app})


@pytest.fixture
def checkpoints(jobs: Jobs) -> Checkpoints:
    """The checkpoints of the built-in app's jobs, a map child's end counted
    in its map as a worker process wires it."""
    found = Checkpoints(jobs)
    jobs.transitions.when_ended(found.children.on_end)
    return found


@pytest.fixture
def stream(jobs: Jobs) -> Stream:
    """The summaries workflow's stream."""
    return jobs.streams["summaries"]


@pytest.fixture
async def summary_job(
    pool: AsyncConnectionPool, jobs: Jobs, worker_settings: Settings
) -> AsyncIterator[WorkflowHandler]:
    """The worker's handler for summaries, on the real model adapter and the fake model."""
    llm = connect_llm(worker_settings)
    yield WorkflowHandler(summaries, jobs, llm, step_config(worker_settings), OutboxWakeUp(pool))
    await llm.aclose()
