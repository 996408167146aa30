"""`oncely migrate`: apply numbered SQL files once each, in order
(docs/contributing.md, "Migrations").

Safe when many processes start at once: an advisory lock is held for the
whole run, so a second migrator waits and then finds nothing left to do.
Each migration runs in a transaction of its own, together with its row in
``oncely_migrations``; a file whose first line is
``-- oncely: no-transaction`` runs statement by statement outside one (for
``CREATE INDEX CONCURRENTLY``), and is recorded once every statement
succeeded, so it must be safe to run again from the top.

The lock is transaction-level, held by a transaction kept open on a second
connection for the whole run, taken by asking again in short transactions:
behind a transaction pooler (PgBouncer's transaction mode) a session-level
lock would stay with whichever server connection took it and be released
on another, and the pooler keeps an open transaction's server connection
for it. It is the same lock with or without a pooler, so a migrator run
behind one without ``ONCELY_DATABASE_POOLER`` set is as safe; no statement
is prepared either (the next transaction may run on another server
connection).

Every applied migration's row keeps the SHA-256 of its file: a released
migration edited afterwards is refused by ``migrate`` and by every
process's schema check, since the database no longer is what the file says.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
import structlog

from oncely.sql import query

log = structlog.get_logger("oncely.migrate")

# Arbitrary, fixed: "oncely" as a 64-bit advisory lock id.
_LOCK_ID = 0x6F6E63656C79
# How often a migrator waiting for another one asks for the lock again.
_LOCK_POLL_S = 0.1
NO_TRANSACTION = "-- oncely: no-transaction"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def transactional(self) -> bool:
        return not self.sql.lstrip().startswith(NO_TRANSACTION)

    def statements(self) -> list[str]:
        """A no-transaction migration's statements: each ends with ``;`` at
        the end of a line (no ``;`` line ends inside one)."""
        parts = re.split(r";[ \t]*(?:--[^\n]*)?$", self.sql, flags=re.MULTILINE)
        return [p.strip() for p in parts if _code(p)]


def _code(sql: str) -> bool:
    """Whether ``sql`` holds anything besides comments and blanks."""
    return any(line.strip() and not line.strip().startswith("--") for line in sql.splitlines())


def available() -> list[Migration]:
    folder = resources.files(__package__).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            number, _, rest = entry.name.partition("_")
            found.append(Migration(int(number), rest.removesuffix(".sql"), entry.read_text()))
    return sorted(found, key=lambda m: m.version)


class MigrationChanged(Exception):
    """A migration file differs from the one applied to this database."""


async def migrate(conninfo: str, migrations: Sequence[Migration] | None = None) -> list[int]:
    """Apply pending migrations (``migrations``: this code's, by default);
    return the versions applied by this call. Raises ``MigrationChanged``,
    applying nothing, when an applied one's file was edited since."""
    migrations = available() if migrations is None else migrations
    async with (
        _transaction_lock(conninfo),
        await psycopg.AsyncConnection.connect(
            conninfo, autocommit=True, prepare_threshold=None
        ) as conn,
    ):
        return await _migrate_locked(conn, migrations)


async def _migrate_locked(
    conn: psycopg.AsyncConnection[Any], migrations: Sequence[Migration]
) -> list[int]:
    """Every pending migration, the migrators' lock held."""
    applied: list[int] = []
    await conn.execute(query("create_migrations_table"))
    await conn.execute(query("add_migration_checksums"))
    done = await _applied(conn)
    await _check_unchanged(conn, done, migrations)
    for migration in migrations:
        if migration.version not in done:
            await _apply(conn, migration)
            applied.append(migration.version)
            log.info("migrate.applied", version=migration.version, name=migration.name)
    return applied


@asynccontextmanager
async def _transaction_lock(conninfo: str) -> AsyncIterator[None]:
    """The migrators' lock, a transaction-level one held while inside,
    asked again every ``_LOCK_POLL_S`` rather than waited on in a statement:
    a statement that waits holds a snapshot, and ``CREATE INDEX
    CONCURRENTLY`` (a no-transaction migration) waits for every snapshot, so
    the migrator holding the lock would wait on the one waiting for it."""
    async with await psycopg.AsyncConnection.connect(
        conninfo, autocommit=True, prepare_threshold=None
    ) as conn:
        while True:
            # Read committed whatever the server's default (a repeatable read
            # transaction keeps its snapshot, which CREATE INDEX CONCURRENTLY
            # would wait on), and never cut off as idle in transaction (the
            # lock would go with it while the migrations run).
            await conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            await conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
            # No parameters: the simple protocol, which leaves the open
            # transaction no snapshot for CREATE INDEX CONCURRENTLY to wait
            # on (a bound statement's portal keeps one until it ends).
            cur = await conn.execute(f"SELECT pg_try_advisory_xact_lock({_LOCK_ID})")
            row = await cur.fetchone()
            if row is not None and row[0]:
                break
            await conn.execute("ROLLBACK")
            await asyncio.sleep(_LOCK_POLL_S)
        try:
            yield
        finally:
            await conn.execute("ROLLBACK")


async def _applied(conn: psycopg.AsyncConnection[Any]) -> dict[int, str | None]:
    """Applied versions and their files' checksums (None: applied before
    checksums were kept)."""
    cur = await conn.execute(query("applied_migrations"))
    return {int(version): checksum for version, checksum in await cur.fetchall()}


async def _check_unchanged(
    conn: psycopg.AsyncConnection[Any], done: dict[int, str | None], migrations: Sequence[Migration]
) -> None:
    """Refuse edited migrations; keep the checksum of those applied before
    checksums were (their file as it is now is taken to be what ran)."""
    changed = _changed(done, migrations)
    if changed:
        raise MigrationChanged(_changed_line(changed))
    for migration in migrations:
        if migration.version in done and done[migration.version] is None:
            await conn.execute(
                query("record_migration_checksum"), (migration.checksum, migration.version)
            )


async def _apply(conn: psycopg.AsyncConnection[Any], migration: Migration) -> None:
    record = (migration.version, migration.name, migration.checksum)
    if migration.transactional:
        async with conn.transaction():
            await conn.execute(migration.sql.encode())
            await conn.execute(query("record_migration"), record)
        return
    for statement in migration.statements():
        await conn.execute(statement.encode())
    await conn.execute(query("record_migration"), record)


def _changed(done: dict[int, str | None], migrations: Sequence[Migration]) -> list[int]:
    return [
        m.version
        for m in migrations
        if done.get(m.version) is not None and done[m.version] != m.checksum
    ]


def _changed_line(changed: list[int]) -> str:
    return (
        f"migrations {changed} were edited after they were applied to this database "
        "(their checksums differ): restore the released files, and add a new migration instead"
    )


@dataclass(frozen=True)
class SchemaState:
    """Which migrations this code has that the database lacks, the other
    way, and which it applied from a file since edited."""

    pending: list[int]
    unknown: list[int]
    changed: list[int]

    @property
    def current(self) -> bool:
        return not self.pending and not self.unknown and not self.changed

    def problem(self) -> str | None:
        """One readable line when the code and the database disagree."""
        if self.unknown:
            return (
                f"the database has migrations this code does not know ({self.unknown}): "
                "upgrade oncely"
            )
        if self.changed:
            return _changed_line(self.changed)
        if self.pending:
            return f"the database schema is behind ({self.pending} pending): run `oncely migrate`"
        return None


class SchemaMismatch(Exception):
    """A process refuses to start against a database that is behind or ahead."""


async def schema_state(conn: psycopg.AsyncConnection[Any]) -> SchemaState:
    """Compare the applied migrations with this code's (nothing applied: all pending)."""
    cur = await conn.execute(query("migrations_table_exists"))
    row = await cur.fetchone()
    done: dict[int, str | None] = {}
    if row is not None and row[0]:
        cur = await conn.execute(query("migrations_have_checksums"))
        checksums = await cur.fetchone()
        listed = "applied_migrations" if checksums and checksums[0] else "applied_versions"
        cur = await conn.execute(query(listed))
        done = {int(r[0]): (r[1] if len(r) > 1 else None) for r in await cur.fetchall()}
    migrations = available()
    known = {m.version for m in migrations}
    return SchemaState(
        pending=sorted(known - set(done)),
        unknown=sorted(set(done) - known),
        changed=_changed(done, migrations),
    )


async def check_schema(conninfo: str) -> SchemaState:
    async with await psycopg.AsyncConnection.connect(conninfo) as conn:
        return await schema_state(conn)
