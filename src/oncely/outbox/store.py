"""The outbox table, as the relay and operators use it (docs/architecture.md).

Leases, not row locks, keep relays apart while a send runs: ``claim`` locks
due rows only for the one statement that leases them, so a slow or hung
provider never pins a transaction open. Every later write is fenced by the
owner token, because a lease can expire under a live relay and pass to
another one.
"""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from psycopg.rows import class_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.sql import query

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
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    # -- the relay's side -------------------------------------------------

    async def claim(self, owner: UUID, limit: int, lease_s: float) -> builtins.list[ClaimedRow]:
        """Lease up to ``limit`` due rows to ``owner`` for ``lease_s``, counting
        an attempt each. Only the columns a send needs come back: every
        timestamp more is one more parse per row."""
        params = {"owner": owner, "limit": limit, "lease_s": lease_s}
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(ClaimedRow))
            await cur.execute(query("outbox_claim"), params)
            return await cur.fetchall()

    async def mark_sent_many(
        self, owner: UUID, sends: builtins.list[tuple[int, str | None]]
    ) -> set[int]:
        """Record many sends at once; returns the ids ``owner`` still held."""
        params = {
            "ids": [row_id for row_id, _ in sends],
            "provider_message_ids": [message_id for _, message_id in sends],
            "owner": owner,
        }
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("outbox_mark_sent_many"), params)
            return {int(row[0]) for row in await cur.fetchall()}

    async def mark_answered(
        self, row_id: int, owner: UUID, provider_message_id: str | None, answer: Any
    ) -> tuple[bool, str | None]:
        """A call's answer, with the row marked sent and the call's wait
        ended (``outbox_mark_answered``): whether ``owner`` still held the
        row, and the job to resume (None: none waits for it)."""
        params = {
            "id": row_id,
            "owner": owner,
            "provider_message_id": provider_message_id,
            "answer": Jsonb(answer),
        }
        return await self._call_outcome("outbox_mark_answered", params)

    async def call_failed(
        self, row_id: int, owner: UUID, error: str, failure: dict[str, Any]
    ) -> tuple[bool, str | None]:
        """A call that will never be answered: the row failed and its wait
        ended with ``failure`` (a failed checkpoint's value); as
        ``mark_answered``."""
        params = {
            "id": row_id,
            "owner": owner,
            "error": error[:_ERROR_CHARS],
            "failure": json.dumps(failure),
        }
        return await self._call_outcome("outbox_call_failed", params)

    async def _call_outcome(self, name: str, params: dict[str, Any]) -> tuple[bool, str | None]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query(name), params)
            row = await cur.fetchone()
        if row is None:  # one row always
            return False, None
        held, woken = row
        return bool(held), None if woken is None else str(woken)

    async def mark_failed_attempt(
        self,
        row_id: int,
        owner: UUID,
        error: str,
        *,
        next_attempt_at_delay_s: float,
        give_up: bool,
    ) -> bool:
        """Record a failed send and release the lease: retry after the delay, or
        (``give_up``) stop for an operator. False if ``owner`` lost the row."""
        params = {
            "id": row_id,
            "owner": owner,
            "error": error[:_ERROR_CHARS],
            "delay_s": next_attempt_at_delay_s,
            "give_up": give_up,
        }
        return await self._fenced("outbox_mark_failed_attempt", params)

    async def _fenced(self, name: str, params: dict[str, Any]) -> bool:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query(name), params)
            return await cur.fetchone() is not None

    # -- operators ----------------------------------------------------------

    async def get(self, row_id: int) -> OutboxRow | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(OutboxRow))
            await cur.execute(query("outbox_get"), (row_id,))
            return await cur.fetchone()

    async def list(
        self, *, failed_only: bool = False, limit: int = 100
    ) -> builtins.list[OutboxRow]:
        """Unsent rows (pending, in flight, failed) oldest first; or only the failed ones."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(OutboxRow))
            await cur.execute(query("outbox_list"), {"failed_only": failed_only, "limit": limit})
            return await cur.fetchall()

    async def for_job(self, job_id: UUID) -> builtins.list[OutboxRow]:
        """Every row one job emitted, sent or not, in emission order."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(OutboxRow))
            await cur.execute(query("list_outbox_for_job"), (job_id,))
            return await cur.fetchall()

    async def retry(self, row_id: int) -> bool:
        """Give a failed row a fresh set of attempts now; False if it is not failed."""
        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(query("outbox_retry"), (row_id,))
            retried = await cur.fetchone() is not None
            if retried:
                await conn.execute(query("notify_outbox"))
        return retried

    async def retry_all_failed(self) -> builtins.list[int]:
        """Every failed row back to sending; their ids."""
        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(query("outbox_retry_all_failed"))
            ids = [int(row[0]) for row in await cur.fetchall()]
            if ids:
                await conn.execute(query("notify_outbox"))
        return ids

    async def delete_sent_before(self, age_s: float, batch: int = 1000) -> int:
        """Delete rows sent more than ``age_s`` ago, ``batch`` per transaction; how many went."""
        total = 0
        while True:
            async with self.pool.connection() as conn:
                cur = await conn.execute(
                    query("outbox_delete_sent_before"), {"age_s": age_s, "batch": batch}
                )
            total += cur.rowcount
            if cur.rowcount < batch:
                return total

    async def counts(self) -> OutboxCounts:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(OutboxCounts))
            await cur.execute(query("outbox_counts"))
            row = await cur.fetchone()
        if row is None:  # an aggregate always answers one row
            raise RuntimeError("outbox_counts returned no row")
        return row
