"""Redis and PostgreSQL for a benchmark: embedded ones for its length, or
given ones (FLUSHED and TRUNCATED before every run), and the CPU their
processes use (embedded only: given servers may be anywhere)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psutil
import psycopg
from psycopg import sql
from redis.asyncio import Redis

from bench.harness.measure import cpu_s
from bench.harness.processes import clean_env, oncely

# Every table a run leaves rows in (the outbox and results depend on jobs).
TABLES = (
    "jobs, results, outbox, job_deliveries, shadow_results, checkpoints, job_events,"
    " job_maps, schedules"
)


@dataclass(frozen=True)
class Servers:
    redis_url: str
    database_url: str
    kind: str  # "embedded" | "given"
    pgdata: Path | None = None  # the embedded PostgreSQL's data directory

    def cpu(self) -> dict[int, float] | None:
        """CPU seconds per server process (postmaster, its backends, Valkey),
        or None for given servers."""
        if self.pgdata is None:
            return None
        procs = [p for p in psutil.Process().children() if "valkey" in p.name()]
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
            postmaster = psutil.Process(pid)
            procs += [postmaster, *postmaster.children(recursive=True)]
        cpu: dict[int, float] = {}
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                cpu[proc.pid] = cpu_s(proc)
        return cpu


@contextlib.contextmanager
def servers(redis_url: str | None, database_url: str | None, data_dir: Path) -> Iterator[Servers]:
    """The given servers, or embedded ones (started here, stopped after)."""
    if redis_url and database_url:
        yield Servers(redis_url, database_url, "given")
        return
    from oncely.embedded import EmbeddedServers

    embedded = EmbeddedServers(data_dir / "servers")
    try:
        urls = embedded.start()
        pgdata = None if database_url else data_dir / "servers" / "postgres"
        yield Servers(
            redis_url or urls.redis_url, database_url or urls.database_url, "embedded", pgdata
        )
    finally:
        embedded.stop()


async def fresh_state(redis: Redis, db: psycopg.AsyncConnection[Any]) -> None:
    """An empty Redis database and empty tables, freshly analysed."""
    await redis.flushdb()
    await db.execute(f"TRUNCATE {TABLES} RESTART IDENTITY")
    await db.execute("ANALYZE jobs")


async def fresh_tables(redis: Redis, db: psycopg.AsyncConnection[Any]) -> None:
    """``fresh_state`` on an earlier schema (``--against``'s database): the
    tables of ``TABLES`` it has."""
    cur = await db.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
        " AND tablename = ANY(%s)",
        ([t.strip() for t in TABLES.split(",")],),
    )
    names = [sql.Identifier(str(row[0])) for row in await cur.fetchall()]
    await redis.flushdb()
    await db.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(sql.SQL(", ").join(names)))
    await db.execute("ANALYZE jobs")


def checkout_env(checkout: str, **onc: str) -> dict[str, str]:
    """``clean_env(**onc)`` for a process of another checkout: its oncely
    package first on the path."""
    return clean_env(**onc) | {"PYTHONPATH": f"{checkout}/src"}


def checkout_revision(checkout: str) -> str:
    """Another checkout's HEAD (short), or "unknown"."""
    done = subprocess.run(
        ["git", "-C", checkout, "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else "unknown"


async def against_database(servers: Servers, checkout: str) -> str:
    """A database of its own on the same server for ``--against``'s checkout,
    migrated by that checkout's ``oncely migrate``: a release refuses a
    schema with migrations it does not know. Its URL. Every run of that
    checkout's contender starts from ``fresh_tables`` on it and is checked
    there."""
    url = urlsplit(servers.database_url)
    name = f"{url.path.lstrip('/') or 'oncely'}_against"
    async with await psycopg.AsyncConnection.connect(servers.database_url, autocommit=True) as db:
        await db.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        await db.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    against_url = urlunsplit(url._replace(path=f"/{name}"))
    env = checkout_env(checkout, redis_url=servers.redis_url, database_url=against_url)
    await oncely("migrate", env=env)
    return against_url


async def against_key(servers: Servers, checkout: str, database_url: str, tenant: str) -> str:
    """A bearer key for ``tenant`` in ``--against``'s database, made by that
    checkout's ``oncely keys create`` (which prints the key alone on stdout)."""
    env = checkout_env(
        checkout, redis_url=servers.redis_url, database_url=database_url, log_level="WARNING"
    )
    key = await oncely("keys", "create", "--tenant", tenant, env=env)
    if not key or key.split() != [key]:
        raise RuntimeError(f"oncely keys create printed no key alone: {key[-200:]!r}")
    return key


async def server_info(redis: Redis, db: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for setting in ("server_version", "synchronous_commit", "fsync", "shared_buffers"):
        row = await (await db.execute(f"SHOW {setting}")).fetchone()
        info[f"postgres_{setting}"] = row[0] if row else None
    server = await redis.info("server")
    info["redis_version"] = server.get("valkey_version") or server.get("redis_version")
    info["redis_server"] = "valkey" if server.get("valkey_version") else "redis"
    return info


async def count(db: psycopg.AsyncConnection[Any], sql: str, params: Any = None) -> int:
    row = await (await db.execute(sql, params)).fetchone()
    return int(row[0]) if row else 0


async def migrated(database_url: str) -> psycopg.AsyncConnection[Any]:
    """The schema (what ``oncely migrate`` runs), and an autocommit
    connection for loading, waiting and checking."""
    from oncely.sql.migrate import migrate

    await migrate(database_url)
    return await psycopg.AsyncConnection.connect(database_url, autocommit=True)


async def migrate_and_key(database_url: str, tenant: str) -> str:
    """The schema (what ``oncely migrate`` runs) and a bearer key for ``tenant``
    (what ``oncely keys create`` makes), without two more interpreters."""
    from psycopg_pool import AsyncConnectionPool

    from oncely.api.auth import create_api_key
    from oncely.sql.migrate import migrate

    await migrate(database_url)
    async with AsyncConnectionPool(database_url, min_size=1, max_size=1, open=False) as pool:
        await pool.open(wait=True)
        return await create_api_key(pool, tenant)
