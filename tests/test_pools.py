"""Each process's PostgreSQL pool (docs/production.md, "Connection budget"):
it starts with one connection, grows on demand to ``ONCELY_PG_POOL_MAX``,
closes idle ones back down; a connection PostgreSQL refuses is counted by
reason and said in one line that names the server, never the password."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import conninfo
from pydantic import ValidationError
from structlog.testing import capture_logs

from oncely.bootstrap.clients import open_pool, postgres_pool
from oncely.settings import Settings
from oncely.sql import connect
from oncely.sql.bounded import run_statement
from tests.processes import wait_for

_roles = itertools.count()
PASSWORD = "pw-never-logged-7f3a"


def refusals(reason: str) -> float:
    return REGISTRY.get_sample_value("oncely_db_connect_errors_total", {"reason": reason}) or 0.0


@pytest.fixture
def fresh_refusal_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """No line held back by an earlier test's refusals."""
    monkeypatch.setattr(connect, "_refusals", connect._RefusalLog())


@pytest.fixture
def limited_url(database_url: str) -> Iterator[str]:
    """The test's database as a role that may hold one connection at a time
    (CONNECTION LIMIT 1): refusals without touching the server's own limit,
    which other tests share."""
    role = f"oncely_limited_{os.getpid()}_{next(_roles)}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{PASSWORD}' CONNECTION LIMIT 1")
    params = conninfo.conninfo_to_dict(database_url)
    params.update(user=role, password=PASSWORD)
    try:
        yield conninfo.make_conninfo(**params)  # type: ignore[arg-type]
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')


async def test_the_pool_starts_with_one_grows_on_demand_and_closes_idle_ones(
    settings: Settings,
) -> None:
    assert settings.database_url is not None
    s = settings.model_copy(update={"pg_pool_idle_s": 0.3, "pg_pool_max": 4})
    pool = postgres_pool(settings.database_url, s, "worker")
    await open_pool(pool, settings.database_url, s)
    try:
        assert pool.get_stats()["pool_size"] == 1
        assert pool.kwargs["application_name"] == "oncely-worker"  # type: ignore[index]
        await asyncio.gather(
            *(run_statement(pool, "SELECT pg_sleep(0.3)", timeout_s=10) for _ in range(6))
        )
        grown = pool.get_stats()["pool_size"]
        assert 1 < grown <= 4

        async def back_to_one() -> bool:
            return pool.get_stats()["pool_size"] == 1

        await wait_for(back_to_one, within_s=30, what="the idle pool back to one connection")
    finally:
        await pool.close()


async def test_one_failed_statement_replaces_every_connection_the_server_dropped(
    settings: Settings,
) -> None:
    """PostgreSQL restarted (here: every backend of the pool terminated):
    the first statement on a dead connection fails, and the pool then
    checks the idle ones at once, so the next statements all succeed
    instead of one failing per stale connection."""
    assert settings.database_url is not None
    s = settings.model_copy(update={"pg_pool_min": 5, "pg_pool_max": 5})
    pool = postgres_pool(settings.database_url, s, "repaired")
    await open_pool(pool, settings.database_url, s)
    try:
        await pool.wait()
        assert pool.get_stats()["pool_size"] == 5
        with psycopg.connect(settings.database_url, autocommit=True) as admin:
            ended = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = 'oncely-repaired' AND datname = current_database()"
            ).fetchone()
        assert ended == (5,)
        failed = 0
        for _ in range(10):
            try:
                await run_statement(pool, "SELECT 1", timeout_s=10)
            except psycopg.OperationalError:
                failed += 1
        assert failed <= 1, f"{failed} statements failed on connections the server had dropped"
    finally:
        await pool.close()


def test_the_defaults_and_a_minimum_above_the_maximum_refused() -> None:
    fields = Settings.model_fields
    assert fields["pg_pool_min"].default == 1
    assert fields["pg_pool_idle_s"].default == 60.0
    unset = Settings()
    assert [unset.pool_max(kind) for kind in ("api", "worker", "relay", "cli")] == [20, 10, 10, 10]
    assert Settings(pg_pool_max=4).pool_max("api") == 4
    with pytest.raises(ValidationError, match="ONCELY_PG_POOL_MIN"):
        Settings(pg_pool_min=5, pg_pool_max=4)
    with pytest.raises(ValidationError, match="unset: 10"):
        Settings(pg_pool_min=15)


def test_the_api_pool_grows_to_its_own_default_and_a_worker_to_its_own(
    settings: Settings,
) -> None:
    assert settings.database_url is not None
    plain = settings.model_copy(update={"pg_pool_max": None})
    assert postgres_pool(settings.database_url, plain, "api").max_size == 20
    assert postgres_pool(settings.database_url, plain, "worker").max_size == 10


def test_a_url_that_names_its_application_keeps_it(settings: Settings) -> None:
    assert settings.database_url is not None
    named = conninfo.make_conninfo(settings.database_url, application_name="billing-oncely")
    assert "application_name" not in postgres_pool(named, settings, "api").kwargs  # type: ignore[operator]
    unnamed = postgres_pool(settings.database_url, settings, "api").kwargs
    assert unnamed["application_name"] == "oncely-api"  # type: ignore[index]


@pytest.mark.usefixtures("fresh_refusal_log")
async def test_a_refused_connection_is_counted_and_said_without_the_password(
    limited_url: str, settings: Settings
) -> None:
    s = settings.model_copy(update={"pg_pool_max": 3})
    before = refusals("too_many_clients")
    pool = postgres_pool(limited_url, s, "worker")
    with capture_logs() as logs:
        await open_pool(pool, limited_url, s)
        try:
            # Three statements at once: the pool tries to grow past the
            # role's one connection and is refused; the statements still
            # run, one after another, on the connection it has.
            await asyncio.gather(
                *(run_statement(pool, "SELECT pg_sleep(0.3)", timeout_s=10) for _ in range(3))
            )
        finally:
            await pool.close()
    assert refusals("too_many_clients") > before
    said = [e for e in logs if e["event"] == "postgres.connect_refused"]
    assert len(said) == 1, "one line for a burst of refusals"
    line = said[0]
    assert line["log_level"] == "warning"
    assert line["reason"] == "too_many_clients"
    assert line["user"] == conninfo.conninfo_to_dict(limited_url)["user"]
    assert "ONCELY_PG_POOL_MAX" in line["hint"]
    assert "too many connections" in line["error"]
    assert PASSWORD not in repr(logs)


@pytest.mark.usefixtures("fresh_refusal_log")
async def test_a_server_nobody_answers_at_is_counted_as_unreachable() -> None:
    before = refusals("unreachable")
    with capture_logs() as logs, pytest.raises(psycopg.OperationalError):
        await connect.CountedConnection.connect(
            f"postgresql://oncely:{PASSWORD}@127.0.0.1:1/oncely", connect_timeout=2
        )
    assert refusals("unreachable") == before + 1
    (line,) = [e for e in logs if e["event"] == "postgres.connect_refused"]
    assert (line["reason"], line["host"], line["port"]) == ("unreachable", "127.0.0.1", "1")
    assert PASSWORD not in repr(logs)


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ('FATAL:  sorry, too many clients already', "too_many_clients"),
        ('FATAL:  too many connections for role "x"', "too_many_clients"),
        ("FATAL:  remaining connection slots are reserved for …", "too_many_clients"),
        ('FATAL:  password authentication failed for user "x"', "auth"),
        ('FATAL:  no pg_hba.conf entry for host "10.0.0.1", user "x"', "auth"),
        ("Connection refused\n\tIs the server running on that host?", "unreachable"),
        ("FATAL:  the database system is starting up", "unreachable"),
        ("failed to resolve host 'db': [Errno -2] Name or service not known", "unreachable"),
        ("ERROR:  no more connections allowed (max_client_conn)", "too_many_clients"),
        ("ERROR:  pgbouncer cannot connect to server", "unreachable"),
        ('FATAL:  database "x" does not exist', "other"),
    ],
)  # fmt: skip
def test_refusals_are_told_apart_by_what_the_server_says(message: str, reason: str) -> None:
    assert connect.refusal_reason(psycopg.OperationalError(message)) == reason
