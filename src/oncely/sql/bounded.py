"""Bounded PostgreSQL statements: every statement oncely runs on a pooled
connection is answered within a client-side bound, the wait for a
connection included, or raises ``StatementTimeout`` (docs/architecture.md,
"no wait without a bound"). A frozen server never enforces its own
``statement_timeout``, so the bound must be the client's.

A leaf: it knows psycopg and nothing of oncely's tables, so every store
(jobs, checkpoints, the outbox, API keys, the ledger) runs its SQL through
it. The only connections taken without it are listed, each with its reason,
in ``tests/test_statements.py``.

Behind a transaction pooler (``TransactionPooled``) a server connection is
ours for one transaction only, so the server's own bound cannot be set once
per session: each statement runs in a transaction that sets it first
(``SET LOCAL statement_timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
import structlog
from psycopg.rows import RowFactory
from psycopg_pool import AsyncConnectionPool, PoolTimeout

log = structlog.get_logger("oncely.sql")


class StatementTimeout(psycopg.OperationalError):
    """No answer within the client-side bound. ``sent``: the statement had
    reached the server (its outcome is unknown), rather than still waiting
    for a pooled connection."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


@dataclass(frozen=True)
class StatementResult:
    """The rows a statement answered (tuples, or what its ``row_factory``
    made of them) and how many rows it touched."""

    rows: list[Any]
    rowcount: int


class _Sent:
    """Set once the statement left for the server."""

    def __init__(self) -> None:
        self.value = False


# Statements given up on by their callers, finishing in the background.
_abandoned: set[asyncio.Task[Any]] = set()

T = TypeVar("T")


class Pool(AsyncConnectionPool):
    """oncely's pool. A connection that comes back broken (the server
    restarted, a pooler or a failover dropped it) has the pool check every
    idle connection at once and replace the dead ones, so that one failed
    statement clears them all: without it each stale connection would fail
    one more request, an API process answering 503 for as many requests as
    it held connections (docs/production.md)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checking: asyncio.Task[None] | None = None

    async def putconn(self, conn: Any) -> None:
        broken = bool(conn.broken)
        await super().putconn(conn)
        if broken and (self._checking is None or self._checking.done()) and not self.closed:
            self._checking = asyncio.create_task(self._check_idle())

    async def _check_idle(self) -> None:
        try:
            await self.check()
        except Exception as exc:  # the pool closing meanwhile: nothing to repair
            log.debug("postgres.pool_check_failed", error=type(exc).__name__)


class TransactionPooled(Pool):
    """A pool whose connections reach PostgreSQL through a transaction
    pooler (PgBouncer's transaction mode, RDS Proxy, the Supabase and Neon
    poolers): the server's ``statement_timeout`` of ``statement_timeout_ms``
    is set in each transaction rather than at connect time (a pooler
    refuses the startup ``options``, and a session setting would outlive
    the transaction on a connection another client gets next)."""

    def __init__(self, *args: Any, statement_timeout_ms: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.statement_timeout_ms = statement_timeout_ms

    def bound_sql(self) -> str:
        """The statement that bounds the rest of a transaction on the server."""
        return f"SET LOCAL statement_timeout = {int(self.statement_timeout_ms)}"


async def run_statement(
    pool: AsyncConnectionPool,
    sql: str,
    params: Any = None,
    *,
    timeout_s: float,
    row_factory: RowFactory[Any] | None = None,
) -> StatementResult:
    """One statement on a pooled connection, answered within ``timeout_s``
    (the wait for a connection included) or ``StatementTimeout``; its rows
    made by ``row_factory`` (psycopg's, e.g. ``class_row``) when given.

    Cancelling a psycopg query makes psycopg cancel it on the server and,
    if the server does not answer that either, close the connection: up to
    10 s more on a frozen server (psycopg #1371). So the statement runs in
    its own task, and a caller past its bound stops waiting for it: the task
    finishes in the background and the pool discards the connection if
    psycopg closed it (a cancelled query that the server acknowledged leaves
    a healthy one)."""
    sent = _Sent()
    work = _execute(pool, sql, params, sent, row_factory)
    return (await _finished(work, sent, timeout_s)).result()


async def run_transaction(
    pool: AsyncConnectionPool,
    work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]],
    *,
    timeout_s: float,
) -> T:
    """``work`` in one transaction on a pooled connection, within
    ``timeout_s`` as ``run_statement`` (the whole transaction: a caller past
    it stops waiting, and the transaction ends in the background)."""
    sent = _Sent()

    async def execute() -> T:
        async with pool.connection() as conn:
            sent.value = True
            async with conn.transaction():
                if isinstance(pool, TransactionPooled):
                    await conn.execute(pool.bound_sql())
                return await work(conn)

    return (await _finished(execute(), sent, timeout_s)).result()


async def _finished(work: Coroutine[Any, Any, T], sent: _Sent, timeout_s: float) -> asyncio.Task[T]:
    """``work``'s task, finished within ``timeout_s`` (else ``StatementTimeout``,
    and the task left to end in the background). Its result is read by the
    caller, so that a failure's traceback names the caller, not this."""
    task = asyncio.create_task(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        _abandon(task)
        raise
    if not done:
        _abandon(task)
        raise StatementTimeout(f"no answer within {timeout_s:g} s", sent=sent.value)
    return task


async def _execute(
    pool: AsyncConnectionPool,
    sql: str,
    params: Any,
    sent: _Sent,
    row_factory: RowFactory[Any] | None,
) -> StatementResult:
    async with pool.connection() as conn:
        sent.value = True
        if isinstance(pool, TransactionPooled):
            return await _bounded(conn, pool, sql, params, row_factory)
        if row_factory is None:
            cur = await conn.execute(sql, params)
        else:
            cur = await conn.cursor(row_factory=row_factory).execute(sql, params)
        rows = await cur.fetchall() if cur.description is not None else []
        return StatementResult(rows, cur.rowcount)


async def _bounded(
    conn: psycopg.AsyncConnection[Any],
    pool: TransactionPooled,
    sql: str,
    params: Any,
    row_factory: RowFactory[Any] | None,
) -> StatementResult:
    """The statement in a transaction of its own that bounds it first, all
    sent at once (``BEGIN``, the bound, the statement, ``COMMIT`` in one
    pipeline: one round trip)."""
    try:
        async with conn.pipeline():  # leaving it sends them and reads every answer
            await conn.execute("BEGIN")
            await conn.execute(pool.bound_sql())
            cur = conn.cursor(row_factory=row_factory) if row_factory else conn.cursor()
            await cur.execute(sql, params)
            await conn.execute("COMMIT")
        rows = await cur.fetchall() if cur.description is not None else []
    except BaseException:
        # On a broken connection the pool discards it; rolling back is moot.
        with contextlib.suppress(psycopg.Error):
            await conn.rollback()
        raise
    return StatementResult(rows, cur.rowcount)


def _abandon(task: asyncio.Task[Any]) -> None:
    task.cancel()
    _abandoned.add(task)
    task.add_done_callback(_forget)


def abandoned_statements() -> int:
    """Statements whose callers gave up on them, still finishing (psycopg
    cancelling them on the server, or closing their connections)."""
    return len(_abandoned)


def _forget(task: asyncio.Task[Any]) -> None:
    _abandoned.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.debug("sql.abandoned_statement_failed", error=repr(task.exception()))


def outcome_unknown(exc: BaseException) -> bool:
    """Whether a failed write may still have been (or still be) applied:
    anything but "never sent" and "the server answered with an error"."""
    if isinstance(exc, StatementTimeout):
        return exc.sent
    if isinstance(exc, PoolTimeout):
        return False
    if isinstance(exc, psycopg.Error) and exc.sqlstate:
        # An error answer rolls the (single, autocommitted) statement back;
        # class 08 is the connection failing, with no answer.
        return exc.sqlstate.startswith("08")
    return True
