"""Behind a connection pooler (docs/production.md): with
``ONCELY_DATABASE_POOLER=transaction`` oncely sends no startup ``options``
and prepares no statement, bounds each transaction on the server with
``SET LOCAL``, and the relay polls rather than LISTENs. The slow tests run
real `oncely api`, `worker` and `relay` processes through a PgBouncer in
transaction mode, configured otherwise as it ships (skipped where PgBouncer
is not installed: `apt-get install pgbouncer`)."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg import conninfo
from psycopg_pool import AsyncConnectionPool

from oncely.api.auth import create_api_key
from oncely.bootstrap import listen_url, open_pool, pooler_refusal, postgres_pool
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from oncely.outbox.relay import LISTENER_APPLICATION_NAME
from oncely.settings import Settings
from oncely.sql.bounded import TransactionPooled, run_statement, run_transaction
from oncely.sql.migrate import migrate
from tests.helpers import scalar
from tests.processes import (
    deployment_env,
    free_port,
    oncely,
    running,
    start,
    tail,
    wait_for,
    wait_healthy,
)

JOBS = 60

# -- the settings, pure ---------------------------------------------------------


def test_a_transaction_pooler_gets_no_options_and_no_prepared_statements() -> None:
    url = "postgresql://u@db:6432/app"
    direct = postgres_pool(url, Settings(database_url=url))
    pooled = postgres_pool(url, Settings(database_url=url, database_pooler="transaction"))
    session = postgres_pool(url, Settings(database_url=url, database_pooler="session"))
    assert isinstance(direct.kwargs, dict) and isinstance(pooled.kwargs, dict)
    assert direct.kwargs["options"] == "-c statement_timeout=10000"
    assert not isinstance(direct, TransactionPooled)
    assert isinstance(pooled, TransactionPooled)
    assert "options" not in pooled.kwargs and pooled.kwargs["prepare_threshold"] is None
    assert pooled.bound_sql() == "SET LOCAL statement_timeout = 10000"
    assert isinstance(session.kwargs, dict) and "options" not in session.kwargs
    assert "prepare_threshold" not in session.kwargs, "a session pooler keeps prepared statements"


def test_the_relay_listens_on_the_direct_url_or_polls_behind_a_transaction_pooler() -> None:
    url, direct = "postgresql://u@pooler:6432/app", "postgresql://u@db:5432/app"
    assert listen_url(Settings(database_url=url)) == url
    assert listen_url(Settings(database_url=url, database_pooler="session")) == url
    assert listen_url(Settings(database_url=url, database_pooler="transaction")) is None
    with_direct = Settings(
        database_url=url, database_pooler="transaction", database_listen_url=direct
    )
    assert listen_url(with_direct) == direct


def test_a_refused_startup_parameter_is_named_with_the_setting_that_fixes_it() -> None:
    error = (
        'connection failed: connection to server at "127.0.0.1", port 6432 failed: '
        "FATAL:  unsupported startup parameter: options"
    )
    line = pooler_refusal(error)
    assert line is not None and "`options`" in line
    assert "ONCELY_DATABASE_POOLER=transaction" in line and "\n" not in line
    assert pooler_refusal("connection refused") is None


# -- the bound per transaction, on the real server ---------------------------------


async def test_each_transaction_is_bounded_on_the_server_and_no_session_keeps_it(
    database_url: str,
) -> None:
    pool = TransactionPooled(
        database_url,
        statement_timeout_ms=1500,
        min_size=1,
        max_size=1,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": None},
    )
    async with pool:
        await pool.open(wait=True)
        one = await run_statement(pool, "SHOW statement_timeout", timeout_s=5)

        async def show(conn: psycopg.AsyncConnection) -> str:
            row = await (await conn.execute("SHOW statement_timeout")).fetchone()
            assert row is not None
            return str(row[0])

        inside = await run_transaction(pool, show, timeout_s=5)
        async with pool.connection() as conn:  # the same, only connection
            after = await show(conn)
        with pytest.raises(psycopg.errors.QueryCanceled):
            await run_statement(pool, "SELECT pg_sleep(5)", timeout_s=10)
    assert one.rows == [("1500ms",)] and inside == "1500ms"
    assert after == "0", "SET LOCAL ends with its transaction: nothing stays on the session"


# -- real processes through PgBouncer ----------------------------------------------


def _pgbouncer() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
    )


@pytest.fixture
def pgbouncer(database_url: str) -> Iterator[str]:
    """A PgBouncer in transaction mode, otherwise as it ships, in front of
    the test's database: the URL that reaches the database through it."""
    yield from _in_front_of(database_url, "transaction")


@pytest.fixture
def pgbouncer_session(database_url: str) -> Iterator[str]:
    """The same in session mode (PgBouncer's default)."""
    yield from _in_front_of(database_url, "session")


def _in_front_of(database_url: str, pool_mode: str) -> Iterator[str]:
    binary = _pgbouncer()
    if binary is None:
        pytest.skip("PgBouncer is not installed (apt-get install pgbouncer)")
    params = conninfo.conninfo_to_dict(database_url)
    port = free_port()
    # Readable by the user PgBouncer drops to when started as root.
    folder = Path(tempfile.mkdtemp(prefix="oncely-pgbouncer-"))
    folder.chmod(0o755)
    server = f"host={params.get('host', '127.0.0.1')} port={params.get('port', 5432)}"
    if params.get("password"):
        server += f" password={params['password']}"
    user = str(params.get("user") or "postgres")
    (folder / "userlist.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = {server}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {folder / 'userlist.txt'}\n"
        f"pool_mode = {pool_mode}\n"
    )
    for file in folder.iterdir():
        file.chmod(0o644)
    as_user = ["-u", _unprivileged(str(params.get("host") or ""))] if os.geteuid() == 0 else []
    log = folder / "pgbouncer.log"
    proc = subprocess.Popen(
        [binary, *as_user, str(folder / "pgbouncer.ini")],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = conninfo.make_conninfo(database_url, host="127.0.0.1", port=str(port))
    try:
        _wait_for_pgbouncer(url, proc, log)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def _unprivileged(host: str) -> str:
    """The user PgBouncer (which refuses to run as root) runs as: behind a
    Unix socket (the suite's embedded PostgreSQL), the socket directory's
    owner, the one user that may reach it; else ``postgres``."""
    if host.startswith("/"):
        return pwd.getpwuid(os.stat(host).st_uid).pw_name
    try:
        return pwd.getpwnam("postgres").pw_name
    except KeyError:
        return "nobody"


def _wait_for_pgbouncer(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    for _ in range(200):
        assert proc.poll() is None, f"PgBouncer exited {proc.returncode}: {tail(log)}"
        try:
            with psycopg.connect(url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
                return
        except psycopg.OperationalError:
            subprocess.run(["sleep", "0.05"], check=True)
    raise AssertionError(f"PgBouncer did not answer: {tail(log)}")


def _env(redis_url: str, url: str, model: FakeLLMServer, mail: FakeMailServer) -> dict[str, str]:
    # Few server connections for many statements: each is reused often, as
    # a prepared statement would be, by other processes' transactions.
    pooled = {"ONCELY_PG_POOL_MIN": "1", "ONCELY_PG_POOL_MAX": "4"}
    return deployment_env(
        redis_url, url, model, mail, ONCELY_DATABASE_POOLER="transaction", **pooled
    )


async def _listeners(pool: AsyncConnectionPool) -> object:
    """The relay's LISTEN connections to the test's database."""
    return await scalar(
        pool,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        f" AND application_name = '{LISTENER_APPLICATION_NAME}'",
    )


@pytest.mark.slow
@pytest.mark.parametrize("wake_up", ["poll", "notify"])
async def test_api_worker_and_relay_through_pgbouncer_in_transaction_mode_do_each_job_once(
    wake_up: str,
    redis_url: str,
    database_url: str,
    redis: object,
    pool: AsyncConnectionPool,
    pgbouncer: str,
    providers: tuple[FakeLLMServer, FakeMailServer],
    tmp_path: Path,
) -> None:
    """Every job done once with one effect, none failed on a prepared
    statement, the outbox delivered: by polling, or (``notify``) by a
    LISTEN on the direct URL ``ONCELY_DATABASE_LISTEN_URL`` names."""
    model, mail = providers
    key = await create_api_key(pool, "acme")
    port, metrics_port = free_port(), free_port()
    env = _env(redis_url, pgbouncer, model, mail)
    if wake_up == "notify":
        env["ONCELY_DATABASE_LISTEN_URL"] = database_url
    logs = {name: tmp_path / f"{name}.log" for name in ("api", "worker", "relay")}
    procs = [
        start(["api", "--port", str(port)], env, logs["api"]),
        start(["worker"], env, logs["worker"]),
        start(["relay"], {**env, "ONCELY_METRICS_PORT": str(metrics_port)}, logs["relay"]),
    ]
    base = f"http://127.0.0.1:{port}"
    with running(*procs):
        await wait_healthy(base, procs[0], logs["api"])
        if wake_up == "notify":

            async def listening() -> bool:
                return await _listeners(pool) == 1

            await wait_for(listening, what="the relay's LISTEN on the direct URL")
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {key}"}
        ) as c:
            answers = await asyncio.gather(
                *(
                    c.post(
                        "/v1/summaries",
                        json={"text": f"Note {i}: effects happen once.", "notify": "a@example.com"},
                        headers={"Idempotency-Key": f"through-pgbouncer-{i:04d}"},
                    )
                    for i in range(JOBS)
                )
            )
            assert all(a.status_code == 202 for a in answers), [a.text for a in answers[:3]]

            async def all_delivered() -> bool:
                for proc, log in zip(procs, logs.values(), strict=True):
                    assert proc.poll() is None, f"exited {proc.returncode}: {tail(log)}"
                return (await mail.deliveries())["effects"] >= JOBS

            await wait_for(all_delivered, within_s=120, what=f"{JOBS} emails through PgBouncer")
        async with httpx.AsyncClient() as plain:
            ready = (await plain.get(f"http://127.0.0.1:{metrics_port}/readyz")).json()
        listeners = await _listeners(pool)

    job_ids = {a.json()["job_id"] for a in answers}
    deliveries = await mail.deliveries()
    assert deliveries["effects"] == JOBS
    assert set(deliveries["by_key"]) == {f"summary_ready:{j}" for j in job_ids}
    assert await scalar(pool, "SELECT count(*) FROM jobs WHERE status = 'done'") == JOBS
    assert await scalar(pool, "SELECT count(*) FROM jobs WHERE status <> 'done'") == 0
    assert await scalar(pool, "SELECT count(*) FROM outbox WHERE sent_at IS NULL") == 0
    assert ready == {"ready": True, "redis": True, "postgres": True, "wake_up": wake_up}
    assert listeners == (1 if wake_up == "notify" else 0)
    text = "".join(log.read_text() for log in logs.values())
    assert "prepared statement" not in text and "does not exist" not in text
    events = [json.loads(line)["event"] for line in logs["relay"].read_text().splitlines()]
    assert ("outbox.polling_only" in events) == (wake_up == "poll")
    assert "dead_letter" not in " ".join(events)


@pytest.mark.slow
async def test_without_the_setting_a_process_names_the_pooler_that_refused_it(
    pgbouncer: str, redis_url: str
) -> None:
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": pgbouncer}
    done = oncely("worker", env={**env, "ONCELY_CONNECT_TIMEOUT_S": "1"})
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "refused the startup parameter `options`" in lines[-1], done.stderr[-2000:]
    assert "ONCELY_DATABASE_POOLER=transaction" in lines[-1]


@pytest.mark.slow
async def test_behind_a_session_pooler_the_bound_is_set_once_per_connection(
    pgbouncer_session: str,
) -> None:
    settings = Settings(
        database_url=pgbouncer_session, database_pooler="session", pg_statement_timeout_s=1.5
    )
    pool = postgres_pool(pgbouncer_session, settings)
    await open_pool(pool, pgbouncer_session, settings)
    try:
        shown = await run_statement(pool, "SHOW statement_timeout", timeout_s=5)
    finally:
        await pool.close()
    assert shown.rows == [("1500ms",)]


@pytest.mark.slow
async def test_migrators_through_pgbouncer_apply_each_migration_once(
    pgbouncer: str, pool: AsyncConnectionPool
) -> None:
    async with pool.connection() as conn:
        await conn.execute("DROP SCHEMA public CASCADE")
        await conn.execute("CREATE SCHEMA public")
    # Three at once, and nothing tells them a pooler stands in front (an
    # operator who did not set ONCELY_DATABASE_POOLER): one lock all the same.
    both = await asyncio.gather(migrate(pgbouncer), migrate(pgbouncer), migrate(pgbouncer))
    versions = await scalar(
        pool, "SELECT array_agg(version ORDER BY version) FROM oncely_migrations"
    )
    assert sorted(both[0] + both[1] + both[2]) == versions, "each migration applied once"
    assert await migrate(pgbouncer) == []
