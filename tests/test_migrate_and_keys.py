"""Migrations apply once even when processes race; API keys through the real CLI."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from oncely.sql.migrate import (
    NO_TRANSACTION,
    Migration,
    MigrationChanged,
    available,
    migrate,
    schema_state,
)
from tests.helpers import failed_outbox_row
from tests.processes import oncely, wait_for


@pytest.fixture
def empty_database_url(server_urls, database_url) -> str:
    """A database without oncely's tables (the per-test one, emptied)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    return database_url


async def test_concurrent_migrators_apply_each_migration_once(empty_database_url):
    results = await asyncio.gather(*(migrate(empty_database_url) for _ in range(4)))
    versions = [m.version for m in available()]
    assert sorted(v for applied in results for v in applied) == versions
    async with await psycopg.AsyncConnection.connect(empty_database_url) as conn:
        cur = await conn.execute("SELECT version FROM oncely_migrations ORDER BY version")
        assert [r[0] for r in await cur.fetchall()] == versions
    assert await migrate(empty_database_url) == [], "a second run has nothing to do"


async def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        return await (await conn.execute(sql)).fetchall()


async def test_each_applied_migration_keeps_its_files_checksum(empty_database_url):
    await migrate(empty_database_url)
    rows = await _rows(empty_database_url, "SELECT version, checksum FROM oncely_migrations")
    assert dict(rows) == {
        m.version: hashlib.sha256(m.sql.encode()).hexdigest() for m in available()
    }


@pytest.mark.slow
async def test_an_edited_migration_is_refused_by_migrate_and_the_schema_check(
    empty_database_url, redis_url
):
    released = available()
    await migrate(empty_database_url)
    edited = [
        *released[:-1],
        replace(released[-1], sql=released[-1].sql + "\n-- and one more thing\n"),
    ]
    with pytest.raises(MigrationChanged, match=rf"\[{released[-1].version}\] were edited"):
        await migrate(empty_database_url, edited)
    # A process of this code, with the released files, is fine; the database
    # as another version (a changed file) would be refused.
    async with await psycopg.AsyncConnection.connect(empty_database_url) as conn:
        await conn.execute(
            "UPDATE oncely_migrations SET checksum = 'not-this-file' WHERE version = 3"
        )
        await conn.commit()
        state = await schema_state(conn)
    assert state.changed == [3] and not state.current
    assert "restore the released files" in (state.problem() or "")
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": empty_database_url}
    refused = await asyncio.to_thread(oncely, "migrate", env=env)
    assert refused.returncode == 1, refused.stderr
    assert "migrations [3] were edited" in refused.stderr and "Traceback" not in refused.stderr
    worker = await asyncio.to_thread(oncely, "worker", env=env)
    assert worker.returncode == 1 and "migrations [3] were edited" in worker.stderr


async def test_a_database_migrated_before_checksums_gets_them_then_is_checked(
    empty_database_url,
):
    """Migrated by a version of oncely that kept no checksums: the column is
    added and filled from the files as they are, and nothing is applied."""
    await migrate(empty_database_url)
    async with await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True) as conn:
        await conn.execute("ALTER TABLE oncely_migrations DROP COLUMN checksum")
        assert (await schema_state(conn)).current  # the old table still reads
    assert await migrate(empty_database_url) == []
    rows = await _rows(
        empty_database_url, "SELECT count(*) FROM oncely_migrations WHERE checksum IS NULL"
    )
    assert rows == [(0,)]


async def test_a_no_transaction_migration_can_build_an_index_concurrently(empty_database_url):
    await migrate(empty_database_url)
    concurrent = Migration(
        9001,
        "concurrent_index",
        "-- oncely: no-transaction\n"
        "-- Built without locking writes out; safe to run again from the top.\n"
        "DROP INDEX CONCURRENTLY IF EXISTS jobs_test_tenant_created;\n"
        "CREATE INDEX CONCURRENTLY jobs_test_tenant_created\n"
        "    ON jobs (tenant, created_at);\n",
    )
    assert not concurrent.transactional and len(concurrent.statements()) == 2
    assert await migrate(empty_database_url, [*available(), concurrent]) == [9001]
    indexes = await _rows(
        empty_database_url,
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'jobs_test_tenant_created'::regclass",
    )
    assert indexes == [(True,)]
    # In a transaction, as every other migration runs, PostgreSQL refuses it.
    inside = replace(concurrent, version=9002, sql=concurrent.sql.removeprefix(NO_TRANSACTION))
    with pytest.raises(psycopg.errors.ActiveSqlTransaction):
        await migrate(empty_database_url, [*available(), concurrent, inside])
    versions = await _rows(empty_database_url, "SELECT max(version) FROM oncely_migrations")
    assert versions == [(9001,)], "the failed one is not recorded"


@pytest.mark.slow
async def test_keys_create_prints_only_the_key_and_stores_only_its_hash(
    redis_url, database_url, pool, client
):
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url}
    created = await asyncio.to_thread(oncely, "keys", "create", "--tenant", "acme", env=env)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert created.stdout == key + "\n", "stdout holds the key alone"
    assert key.startswith("onc_")
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT key_hash, tenant FROM api_keys")
        [(key_hash, tenant)] = await cur.fetchall()
    assert tenant == "acme"
    assert key not in key_hash

    auth = {"Authorization": f"Bearer {key}"}
    assert (
        await client.get("/v1/summaries/00000000-0000-4000-8000-000000000000", headers=auth)
    ).status_code == 404
    revoked = await asyncio.to_thread(oncely, "keys", "revoke", key, env=env)
    assert revoked.returncode == 0, revoked.stderr
    assert "ONCELY_API_KEY_CACHE_S" in revoked.stderr, "says when it takes effect"

    async def refused() -> bool:
        url = "/v1/summaries/00000000-0000-4000-8000-000000000000"
        return (await client.get(url, headers=auth)).status_code == 401

    await wait_for(refused, 10, "the revoked key refused")
    again = await asyncio.to_thread(oncely, "keys", "revoke", key, env=env)
    assert again.returncode == 3, "not found"
    assert "no such active key" in again.stderr


@pytest.mark.slow
async def test_cli_reports_bad_settings_readably():
    bad = await asyncio.to_thread(oncely, "worker", env={"ONCELY_WORKER_CONCURRENCY": "lots"})
    assert bad.returncode == 2
    assert "ONCELY_WORKER_CONCURRENCY" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
async def test_operator_commands_show_and_retry_a_failed_outbox_row(redis_url, database_url, pool):
    row_id = await failed_outbox_row(
        pool, "email.summary_ready", "summary_ready:failed-one", 10, "HTTP 503"
    )
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url, "COLUMNS": "200"}

    listed = await asyncio.to_thread(oncely, "outbox", "list", "--failed", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "summary_ready:failed-one" in listed.stdout
    status = await asyncio.to_thread(oncely, "status", "--json", env=env)
    assert json.loads(status.stdout)["outbox"]["failed"] == 1

    retried = await asyncio.to_thread(oncely, "outbox", "retry", str(row_id), env=env)
    assert retried.returncode == 0, retried.stderr
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT failed_at, attempts FROM outbox WHERE id = %s", (row_id,))
        assert await cur.fetchone() == (None, 0)
    status = await asyncio.to_thread(oncely, "status", "--json", env=env)
    assert json.loads(status.stdout)["outbox"]["failed"] == 0
    unknown = await asyncio.to_thread(oncely, "outbox", "retry", "999999", env=env)
    assert unknown.returncode == 3, "not found"


@pytest.mark.slow
@pytest.mark.timeout(240)  # ten CLI processes: a minute alone on a loaded 2-core machine
async def test_operator_commands_answer_json_dry_runs_and_exit_codes(redis_url, database_url, pool):
    async with pool.connection() as conn:
        for key in ("summary_ready:first-failed-row-with-a-long-id", "summary_ready:second"):
            await conn.execute(
                "INSERT INTO outbox (topic, dedupe_key, payload, attempts, last_error, failed_at)"
                " VALUES ('email.summary_ready', %s, '{}', 10, 'HTTP 503', now())",
                (key,),
            )
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url, "COLUMNS": "60"}

    listed = await asyncio.to_thread(oncely, "outbox", "list", "--failed", env=env)
    assert "summary_ready:first-failed-row-with-a-long-id" in listed.stdout, "ids are never cut"
    rows = json.loads((await asyncio.to_thread(oncely, "outbox", "list", "--json", env=env)).stdout)
    assert [r["state"] for r in rows] == ["failed", "failed"]
    dry = await asyncio.to_thread(
        oncely, "outbox", "retry", "--all-failed", "--dry-run", "--json", env=env
    )
    assert json.loads(dry.stdout) == {"dry_run": True, "scheduled": [r["id"] for r in rows]}
    async with pool.connection() as conn:
        still = await (
            await conn.execute("SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL")
        ).fetchone()
    assert still == (2,), "a dry run changes nothing"
    done = await asyncio.to_thread(oncely, "outbox", "retry", "--all-failed", "--json", env=env)
    assert sorted(json.loads(done.stdout)["scheduled"]) == sorted(r["id"] for r in rows)
    replay = await asyncio.to_thread(oncely, "dlq", "replay", "--all", "--json", env=env)
    assert json.loads(replay.stdout) == {"dry_run": False, "replayed": []}
    missing = await asyncio.to_thread(oncely, "dlq", "replay", "1-0", env=env)
    assert missing.returncode == 3
    usage = await asyncio.to_thread(oncely, "dlq", "replay", env=env)
    assert usage.returncode == 2
    down = await asyncio.to_thread(
        oncely,
        "status",
        env={"ONCELY_REDIS_URL": "redis://127.0.0.1:9", **{"ONCELY_DATABASE_URL": database_url}},
    )
    assert down.returncode == 69 and "did not answer" in down.stderr
    version = await asyncio.to_thread(oncely, "--version", env=env)
    assert version.returncode == 0 and version.stdout.startswith("oncely ")


@pytest.mark.slow
def test_a_wrong_app_or_workflow_is_one_readable_line_and_exit_code_2(redis_url, database_url):
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url}
    missing = oncely("--app", "no_such_module:app", "status", env=env)
    assert missing.returncode == 2
    assert "cannot import 'no_such_module'" in missing.stderr
    assert "Traceback" not in missing.stderr
    not_an_app = oncely("status", env={**env, "ONCELY_APP": "oncely.builtin:summaries"})
    assert not_an_app.returncode == 2 and "not an oncely App" in not_an_app.stderr
    unknown = oncely("worker", "--workflow", "refunds", env=env)
    assert unknown.returncode == 2
    assert "no workflow ['refunds']" in unknown.stderr


@pytest.mark.slow
def test_migrate_check_and_processes_refuse_a_schema_behind_or_ahead(empty_database_url, redis_url):
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": empty_database_url}
    behind = oncely("migrate", "--check", env=env)
    assert behind.returncode == 1 and "pending" in behind.stderr
    for process in ("worker", "api"):
        refused = oncely(process, env=env)
        assert refused.returncode == 1, process
        assert "run `oncely migrate`" in refused.stderr and "Traceback" not in refused.stderr

    assert oncely("migrate", env=env).returncode == 0
    assert oncely("migrate", "--check", env=env).returncode == 0
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO oncely_migrations (version, name) VALUES (999, 'future')")
    relay = oncely("relay", env=env)
    assert relay.returncode == 1 and "upgrade oncely" in relay.stderr
    assert oncely("migrate", "--check", env=env).returncode == 1


@pytest.mark.slow
async def test_keys_have_ids_are_listed_without_secrets_and_revoked_by_id(
    redis_url, database_url, pool, client
):
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url}
    created = json.loads(
        (
            await asyncio.to_thread(oncely, "keys", "create", "--tenant", "acme", "--json", env=env)
        ).stdout
    )
    other = (
        await asyncio.to_thread(oncely, "keys", "create", "--tenant", "globex", env=env)
    ).stdout
    auth = {"Authorization": f"Bearer {created['key']}"}
    probe = "/v1/summaries/00000000-0000-4000-8000-000000000000"
    assert (await client.get(probe, headers=auth)).status_code == 404  # known key: used now

    listed = await asyncio.to_thread(oncely, "keys", "list", "--json", env=env)
    keys = {k["id"]: k for k in json.loads(listed.stdout)}
    assert set(keys) >= {created["id"]}
    assert keys[created["id"]]["tenant"] == "acme"
    assert keys[created["id"]]["last_used_at"] is not None
    assert created["key"] not in listed.stdout and other.strip() not in listed.stdout
    only = json.loads(
        (
            await asyncio.to_thread(oncely, "keys", "list", "--tenant", "globex", "--json", env=env)
        ).stdout
    )
    assert [k["tenant"] for k in only] == ["globex"]

    revoked = await asyncio.to_thread(oncely, "keys", "revoke", "--id", created["id"], env=env)
    assert revoked.returncode == 0, revoked.stderr

    async def probe_refused() -> bool:
        return (await client.get(probe, headers=auth)).status_code == 401

    await wait_for(probe_refused, 10, "the revoked key refused")
    again = await asyncio.to_thread(oncely, "keys", "revoke", "--id", created["id"], env=env)
    assert again.returncode == 3
    assert (await asyncio.to_thread(oncely, "keys", "revoke", env=env)).returncode == 2


def _database_default(url: str, name: str, value: str) -> None:
    """A server default for new connections to this database, as an
    operator may have set it."""
    with psycopg.connect(url, autocommit=True) as conn:
        dbname = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
        conn.execute(f"ALTER DATABASE \"{dbname}\" SET {name} = '{value}'")


async def test_an_index_built_concurrently_under_a_repeatable_read_default(empty_database_url):
    """The lock's transaction is read committed whatever the database's
    default: a repeatable read one would keep the snapshot CREATE INDEX
    CONCURRENTLY waits for, and the migrator would wait on its own lock."""
    await migrate(empty_database_url)
    _database_default(empty_database_url, "default_transaction_isolation", "repeatable read")
    concurrent = Migration(
        9001,
        "concurrent_index",
        "-- oncely: no-transaction\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_rr ON jobs (tenant);\n",
    )
    applied = await asyncio.wait_for(migrate(empty_database_url, [*available(), concurrent]), 60)
    assert applied == [9001]


async def test_the_lock_outlives_an_idle_in_transaction_timeout(empty_database_url):
    """The lock's transaction sits idle while the migrations run: a server
    that ends idle transactions after a second must not take the lock with
    it (a second migrator would go ahead)."""
    await migrate(empty_database_url)
    _database_default(empty_database_url, "idle_in_transaction_session_timeout", "1s")
    slow = Migration(9002, "slow", "SELECT pg_sleep(2.5);\n")
    running = asyncio.create_task(migrate(empty_database_url, [*available(), slow]))

    async def held() -> bool:
        rows = await _rows(
            empty_database_url, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        )
        return rows == [(1,)]

    await wait_for(held, within_s=30, what="the migrators' lock taken")
    await asyncio.sleep(1.5)  # past the server's idle timeout, the migration still running
    assert await held(), "the lock went with a transaction the server ended"
    assert await running == [9002]
