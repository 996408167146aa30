"""The outbox table, as the relay and operators use it (docs/architecture.md).

Leases, not row locks, keep relays apart while a send runs: ``claim`` locks
due rows only for the one statement that leases them, so a slow or hung
provider never pins a transaction open. A live relay ``renew``s the leases
of the rows it holds in short steps, so a dead one's rows are free again
within one short lease. Every later write is fenced by the owner token,
because a lease can still expire under a live relay and pass to another
one. Every statement is bounded on the client (``oncely.sql.bounded``).
"""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.sql import query
from oncely.sql.bounded import StatementResult, run_statement, run_transaction

# Long enough for an operator to tell what went wrong, short enough that a
# provider answering with a whole HTML page does not bloat the row.
_ERROR_CHARS = 2000


@dataclass(frozen=True)
class OutboxRow:
    id: int
    topic: str
    dedupe_key: str
    payload: dict[str, Any]
    attempts: int
    last_error: str | None
    next_attempt_at: datetime
    locked_until: datetime | None
    locked_by: UUID | None
    sent_at: datetime | None
    failed_at: datetime | None
    provider_message_id: str | None
    created_at: datetime
    # The writing delivery's ``traceparent`` (None when it was not traced).
    trace_context: str | None
    # Seconds since created_at when the row was read, by the database's clock,
    # so lag metrics do not depend on the relay host's clock agreeing with it.
    age_s: float


@dataclass(frozen=True)
class ClaimedRow:
    """A row as a relay leased it: what its send and its record need (the
    lease itself is the relay's own ``owner`` and clock)."""

    id: int
    topic: str
    dedupe_key: str
    payload: dict[str, Any]
    attempts: int
    trace_context: str | None
    # A call's checkpoint key (its answer goes there); None for a plain effect.
    call_key: str | None
    age_s: float


@dataclass(frozen=True)
class OutboxCounts:
    """What ``oncely status`` reports about the outbox."""

    unsent: int
    in_flight: int
    failed: int
    oldest_unsent_age_s: float | None


class OutboxStore:
    """The outbox's rows; every statement answered within
    ``statement_timeout_s`` (the wait for a connection included)."""

    def __init__(self, pool: AsyncConnectionPool, *, statement_timeout_s: float = 10.0) -> None:
        self.pool = pool
        self.statement_timeout_s = statement_timeout_s

    async def _run(
        self, name: str, params: Any = None, row: type[Any] | None = None
    ) -> StatementResult:
        return await run_statement(
            self.pool,
            query(name),
            params,
            timeout_s=self.statement_timeout_s,
            row_factory=None if row is None else class_row(row),
        )

    # -- the relay's side -------------------------------------------------

    async def claim(self, owner: UUID, limit: int, lease_s: float) -> builtins.list[ClaimedRow]:
        """Lease up to ``limit`` due rows to ``owner`` for ``lease_s``, counting
        an attempt each. Only the columns a send needs come back: every
        timestamp more is one more parse per row."""
        params = {"owner": owner, "limit": limit, "lease_s": lease_s}
        return (await self._run("outbox_claim", params, ClaimedRow)).rows

    async def renew(
        self, owner: UUID, row_ids: builtins.list[int], lease_s: float, *, timeout_s: float
    ) -> set[int]:
        """Lease ``row_ids`` to ``owner`` for ``lease_s`` more from now; the
        ids it still held, unsent, with their lease not yet ended. Bounded
        by ``timeout_s`` (a renewal later than the lease is of no use)."""
        params = {"ids": row_ids, "owner": owner, "lease_s": lease_s}
        result = await run_statement(
            self.pool,
            query("outbox_renew"),
            params,
            timeout_s=min(timeout_s, self.statement_timeout_s),
        )
        return {int(row[0]) for row in result.rows}

    async def mark_sent_many(
        self, owner: UUID, sends: builtins.list[tuple[ClaimedRow, str | None]]
    ) -> set[tuple[int, int]]:
        """Record many sends at once (each row as claimed, with the
        provider's message id); returns the claims (id, attempt) that still
        held their rows."""
        params = {
            "ids": [row.id for row, _ in sends],
            "attempts": [row.attempts for row, _ in sends],
            "provider_message_ids": [message_id for _, message_id in sends],
            "owner": owner,
        }
        rows = (await self._run("outbox_mark_sent_many", params)).rows
        return {(int(row_id), int(attempt)) for row_id, attempt in rows}

    async def mark_answered(
        self, row: ClaimedRow, owner: UUID, provider_message_id: str | None, answer: Any
    ) -> tuple[bool, str | None]:
        """A call's answer, with the row marked sent and the call's wait
        ended (``outbox_mark_answered``): whether the claim still held the
        row, and the job to resume (None: none waits for it)."""
        params = {
            "id": row.id,
            "attempts": row.attempts,
            "owner": owner,
            "provider_message_id": provider_message_id,
            "answer": Jsonb(answer),
        }
        return await self._call_outcome("outbox_mark_answered", params)

    async def call_failed(
        self, row: ClaimedRow, owner: UUID, error: str, failure: dict[str, Any]
    ) -> tuple[bool, str | None]:
        """A call that will never be answered: the row failed and its wait
        ended with ``failure`` (a failed checkpoint's value); as
        ``mark_answered``."""
        params = {
            "id": row.id,
            "attempts": row.attempts,
            "owner": owner,
            "error": error[:_ERROR_CHARS],
            "failure": json.dumps(failure),
        }
        return await self._call_outcome("outbox_call_failed", params)

    async def _call_outcome(self, name: str, params: dict[str, Any]) -> tuple[bool, str | None]:
        rows = (await self._run(name, params)).rows
        if not rows:  # one row always
            return False, None
        held, woken = rows[0]
        return bool(held), None if woken is None else str(woken)

    async def mark_failed_attempt(
        self,
        row: ClaimedRow,
        owner: UUID,
        error: str,
        *,
        next_attempt_at_delay_s: float,
        give_up: bool,
    ) -> bool:
        """Record a failed send and release the lease: retry after the delay, or
        (``give_up``) stop for an operator. False if the claim lost the row."""
        params = {
            "id": row.id,
            "attempts": row.attempts,
            "owner": owner,
            "error": error[:_ERROR_CHARS],
            "delay_s": next_attempt_at_delay_s,
            "give_up": give_up,
        }
        return await self._fenced("outbox_mark_failed_attempt", params)

    async def _fenced(self, name: str, params: dict[str, Any]) -> bool:
        return bool((await self._run(name, params)).rows)

    # -- operators ----------------------------------------------------------

    async def get(self, row_id: int) -> OutboxRow | None:
        rows = (await self._run("outbox_get", (row_id,), OutboxRow)).rows
        return rows[0] if rows else None

    async def list(
        self, *, failed_only: bool = False, limit: int = 100
    ) -> builtins.list[OutboxRow]:
        """Unsent rows (pending, in flight, failed) oldest first; or only the failed ones."""
        params = {"failed_only": failed_only, "limit": limit}
        return (await self._run("outbox_list", params, OutboxRow)).rows

    async def for_job(self, job_id: UUID) -> builtins.list[OutboxRow]:
        """Every row one job emitted, sent or not, in emission order."""
        return (await self._run("list_outbox_for_job", (job_id,), OutboxRow)).rows

    async def retry(self, row_id: int) -> bool:
        """Give a failed row a fresh set of attempts now; False if it is not failed."""

        async def retry(conn: psycopg.AsyncConnection[Any]) -> bool:
            cur = await conn.execute(query("outbox_retry"), (row_id,))
            retried = await cur.fetchone() is not None
            if retried:
                await conn.execute(query("notify_outbox"))
            return retried

        return await run_transaction(self.pool, retry, timeout_s=self.statement_timeout_s)

    async def retry_all_failed(self) -> builtins.list[int]:
        """Every failed row back to sending; their ids."""

        async def retry(conn: psycopg.AsyncConnection[Any]) -> builtins.list[int]:
            cur = await conn.execute(query("outbox_retry_all_failed"))
            ids = [int(row[0]) for row in await cur.fetchall()]
            if ids:
                await conn.execute(query("notify_outbox"))
            return ids

        return await run_transaction(self.pool, retry, timeout_s=self.statement_timeout_s)

    async def delete_sent_before(self, age_s: float, batch: int = 1000) -> int:
        """Delete rows sent more than ``age_s`` ago, ``batch`` per transaction; how many went."""
        total = 0
        while True:
            params = {"age_s": age_s, "batch": batch}
            deleted = (await self._run("outbox_delete_sent_before", params)).rowcount
            total += deleted
            if deleted < batch:
                return total

    async def counts(self) -> OutboxCounts:
        rows = (await self._run("outbox_counts", None, OutboxCounts)).rows
        if not rows:  # an aggregate always answers one row
            raise RuntimeError("outbox_counts returned no row")
        counts: OutboxCounts = rows[0]
        return counts
