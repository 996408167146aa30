"""`oncely migrate`: apply numbered SQL files once each, in order.

Safe when many processes start at once: everything runs in one transaction
under a transaction-scoped advisory lock, so a second migrator waits and then
finds nothing left to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
import structlog

from oncely.sql import query

log = structlog.get_logger("oncely.migrate")

# Arbitrary, fixed: "oncely" as a 64-bit advisory lock id.
_LOCK_ID = 0x6F6E63656C79


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    folder = resources.files(__package__).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            number, _, rest = entry.name.partition("_")
            found.append(Migration(int(number), rest.removesuffix(".sql"), entry.read_text()))
    return sorted(found, key=lambda m: m.version)


async def migrate(conninfo: str) -> list[int]:
    """Apply pending migrations; return the versions applied by this call."""
    applied: list[int] = []
    async with await psycopg.AsyncConnection.connect(conninfo) as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_ID,))
        await conn.execute(query("create_migrations_table"))
        cur = await conn.execute(query("applied_migrations"))
        done = {row[0] for row in await cur.fetchall()}
        for migration in available():
            if migration.version in done:
                continue
            await conn.execute(migration.sql.encode())
            await conn.execute(query("record_migration"), (migration.version, migration.name))
            applied.append(migration.version)
            log.info("migrate.applied", version=migration.version, name=migration.name)
    return applied


@dataclass(frozen=True)
class SchemaState:
    """Which migrations this code has that the database lacks, and the other way."""

    pending: list[int]
    unknown: list[int]

    @property
    def current(self) -> bool:
        return not self.pending and not self.unknown

    def problem(self) -> str | None:
        """One readable line when the code and the database disagree."""
        if self.unknown:
            return (
                f"the database has migrations this code does not know ({self.unknown}): "
                "upgrade oncely"
            )
        if self.pending:
            return f"the database schema is behind ({self.pending} pending): run `oncely migrate`"
        return None


class SchemaMismatch(Exception):
    """A process refuses to start against a database that is behind or ahead."""


async def schema_state(conn: psycopg.AsyncConnection[Any]) -> SchemaState:
    """Compare the applied migrations with this code's (nothing applied: all pending)."""
    cur = await conn.execute(query("migrations_table_exists"))
    row = await cur.fetchone()
    done: set[int] = set()
    if row is not None and row[0]:
        cur = await conn.execute(query("applied_migrations"))
        done = {int(r[0]) for r in await cur.fetchall()}
    known = {m.version for m in available()}
    return SchemaState(pending=sorted(known - done), unknown=sorted(done - known))


async def check_schema(conninfo: str) -> SchemaState:
    async with await psycopg.AsyncConnection.connect(conninfo) as conn:
        return await schema_state(conn)
