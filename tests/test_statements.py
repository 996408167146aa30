"""Every statement is bounded (docs/architecture.md, "no wait without a
bound"): oncely takes a pooled connection only in ``oncely.sql.bounded``,
whose ``run_statement`` and ``run_transaction`` answer within a client-side
bound, and opens a connection of its own only where one is listed here with
its reason. And the bound holds: a statement on a server that does not
answer raises ``StatementTimeout`` in time, for the stores moved onto it."""

from __future__ import annotations

import ast
import asyncio
import uuid
from pathlib import Path

import pytest

from oncely.api.auth import list_api_keys
from oncely.outbox.store import OutboxStore
from oncely.sql.bounded import StatementTimeout, run_statement

SRC = Path(__file__).resolve().parent.parent / "src" / "oncely"

# Where a connection is taken outside the bounded runner, and why.
OWN_CONNECTIONS = {
    # The pool's connections, each statement bounded: the one home.
    "sql/bounded.py": "run_statement and run_transaction",
    # Migrations run as long as they need, on a connection of their own
    # under an advisory lock (docs/contributing.md, Migrations).
    "sql/migrate.py": "the migrator's own connection",
    # LISTEN waits by design; the relay pings it within a bound and
    # reconnects (outbox/relay.py).
    "outbox/relay.py": "the relay's LISTEN connection",
    # One connection, after the pool could not open, to say why (a pooler
    # refusing a startup parameter): the pool only says it gave up.
    "bootstrap/clients.py": "the start-up error's one connection",
    # `oncely dev` creating its database on the embedded server.
    "embedded.py": "the embedded server's set-up",
    # An MCP server's key store (oncely.mcp.idempotent): the key's row is
    # held locked while the tool runs, as long as the tool takes, so that a
    # concurrent repeat waits for the first (docs/mcp.md). It runs in the
    # user's server, on its own pool.
    "mcp/server.py": "a keyed tool call's transaction, held while the tool runs",
}


def _connections(path: Path) -> list[int]:
    """Lines of ``path`` that take a connection: ``<pool>.connection(...)``,
    ``AsyncConnection.connect(...)``, ``psycopg.connect(...)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr == "connection" or (
            node.func.attr == "connect"
            and isinstance(node.func.value, ast.Name | ast.Attribute)
            and ast.unparse(node.func.value)
            in {"psycopg", "psycopg.AsyncConnection", "CountedConnection"}
        ):
            found.append(node.lineno)
    return found


def test_only_the_bounded_runner_takes_a_pooled_connection() -> None:
    taken = {
        str(path.relative_to(SRC)): lines
        for path in sorted(SRC.rglob("*.py"))
        if (lines := _connections(path))
    }
    unlisted = {path: lines for path, lines in taken.items() if path not in OWN_CONNECTIONS}
    assert unlisted == {}, "statements outside oncely.sql.bounded have no client-side bound"
    assert set(taken) == set(OWN_CONNECTIONS), "a listed exception that is gone"


async def test_a_statement_past_its_bound_raises_in_time(pool) -> None:
    with pytest.raises(StatementTimeout) as raised:
        await run_statement(pool, "SELECT pg_sleep(5)", timeout_s=0.2)
    assert raised.value.sent


async def test_the_outbox_and_key_stores_are_bounded(pool) -> None:
    """With every pooled connection held, the outbox's and the operators'
    statements give up within their bound instead of waiting on the pool."""
    held = [await pool.getconn() for _ in range(pool.max_size)]
    try:
        store = OutboxStore(pool, statement_timeout_s=0.3)
        for call in (
            store.counts(),
            store.claim(uuid.uuid4(), 10, 30.0),
            list_api_keys(pool, timeout_s=0.3),
        ):
            with pytest.raises(StatementTimeout) as raised:
                await asyncio.wait_for(call, 30)
            assert not raised.value.sent, "it never left: still waiting for a connection"
    finally:
        for conn in held:
            await pool.putconn(conn)
    assert (await OutboxStore(pool).counts()).unsent == 0
