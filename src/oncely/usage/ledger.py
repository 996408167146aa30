"""The usage ledger: one ``model_calls`` row per model call that reached a
provider (docs/model-routing.md). Only this module runs SQL on that table.

A call is in the ledger from when it is sent (``sending``): a call in
flight for a whole batch interval when a batch is written is written as
``sent``, and its row is replaced once it ends, so a process killed
mid-call leaves a row for what the provider may bill. (Younger calls wait
for the next batch: most end before it, and cost no row of their own.)
A call ends answered or not: ``ok``, ``retryable`` (a 429, a 5xx, a
connection that failed), ``timeout`` (cut off by its attempt's time, or
cancelled with its job: made, maybe paid for, its answer lost),
``permanent`` (a 400, say), ``refused`` (the model declined to answer) or
``invalid_output`` (answered, but the answer did not validate and was asked
again). Each row names the call's dialect (``chat``, ``anthropic``:
docs/providers.md) and lane (``standard``, ``flex``, ``batch``: docs/lanes.md,
with what the lane saved against the standard price). Whether its answer became a
checkpoint is not known then, and need not be: a report counts a job's
stored model checkpoints against its calls (``usage_report``).

Recording costs the call an append to a list. Each worker process writes
its list every ``flush_s`` in one statement (sooner when ``batch`` rows
wait), and adds each tenant's tokens and cost to its day's spend in Redis
(``oncely.usage.budgets``) in one round trip. A batch PostgreSQL did not
take is kept and tried again with the next (at most ``max_rows`` are held;
past that the oldest are dropped, and counted). On shutdown the ledger
writes what it holds after the workers have finished; a process killed
with -9 loses at most its last ``flush_s`` of rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import psycopg
import structlog
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.sql import query
from oncely.sql.bounded import StatementTimeout, run_statement
from oncely.usage.budgets import Budgets, Spent, utc_day
from oncely.usage.calls import Call, CallSite, Sending
from oncely.usage.prices import Prices

log = structlog.get_logger(__name__)

GroupBy = Literal["tenant", "workflow", "model", "dialect", "lane", "day", "workflow/dialect/model"]

# How often a pass deletes a batch of rows past the retention, at most.
_PRUNE_EVERY_S = 3600.0
_PRUNE_BATCH = 10_000


@dataclass(frozen=True)
class UsageRow:
    """One group of ``oncely usage report``: of its prompt tokens, those
    read from the provider's cache (``cached_tokens``) and written to it
    (``cache_write_tokens``), and what the cache saved (``cache_saved_usd``:
    the reads' discount net of the writes' premium, docs/model-routing.md;
    None when no call of the group has a price)."""

    group: str
    calls: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None
    wasted_calls: int
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    cache_saved_usd: float | None = None
    # What cheaper lanes saved against the standard price (docs/lanes.md).
    lane_saved_usd: float | None = None

    def to_json(self, by: str) -> dict[str, Any]:
        return {
            by: self.group,
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost_usd": self.cost_usd,
            "wasted_calls": self.wasted_calls,
            "cached_tokens": self.cached_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "cache_saved_usd": self.cache_saved_usd,
            "lane_saved_usd": self.lane_saved_usd,
        }


class Ledger:
    """This process's calls, on their way to ``model_calls`` (module docstring)."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        *,
        prices: Prices | None = None,
        budgets: Budgets | None = None,
        flush_s: float = 0.25,
        batch: int = 2000,
        max_rows: int = 100_000,
        retention_s: float = 90 * 86400.0,
        statement_timeout_s: float = 10.0,
        in_flight_after_s: float | None = None,
    ) -> None:
        self.pool = pool
        # How long a call is in flight before a batch writes it as ``sent``
        # (default ``flush_s``: a kill loses at most that much either way).
        self.in_flight_after_s = flush_s if in_flight_after_s is None else in_flight_after_s
        self.prices = prices or Prices()
        self.budgets = budgets
        # Spend Redis did not take yet, added with the next batch.
        self._uncounted: dict[tuple[str, str], Spent] = {}
        self.flush_s = flush_s
        self.batch = batch
        self.max_rows = max_rows
        self.retention_s = retention_s
        self.statement_timeout_s = statement_timeout_s
        self.dropped = 0
        # Calls not written yet, and the batches PostgreSQL refused (their
        # spend already counted).
        self._rows: list[Call] = []
        self._unwritten: list[Call] = []
        # Calls in flight, and the ``sent`` rows a batch may have written
        # whose calls have ended since (deleted with the next batch).
        self._in_flight: set[Sending] = set()
        self._ended: list[str] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._pruned_at = float("-inf")

    def sending(
        self,
        site: CallSite,
        step: str | None,
        model: str,
        attempt: int,
        dialect: str = "chat",
        lane: str = "standard",
    ) -> Sending:
        """A call about to be sent (no I/O): in the ledger as ``sent`` until
        it is recorded or withdrawn."""
        call = Call(site, step, model, attempt, "sent", 0, 0, 0, None, dialect=dialect, lane=lane)
        sent = Sending(call)
        self._in_flight.add(sent)
        return sent

    def record(self, call: Call, sent: Sending | None = None) -> None:
        """Keep ``call`` for the next write (no I/O); it is the end of
        ``sent``, whose row it replaces."""
        if sent is not None:
            self.withdraw(sent)
        self._rows.append(call)
        if len(self._rows) >= self.batch:
            self._wake.set()

    def withdraw(self, sent: Sending) -> None:
        """``sent`` has ended without a row of its own (it never left)."""
        if sent in self._in_flight:
            self._in_flight.discard(sent)
            if sent.call_id is not None:
                self._ended.append(sent.call_id)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Ledger]:
        """Write batches in the background while the block runs, then
        whatever is left once it has ended (the workers inside it are done)."""
        self._stopping = False
        task = asyncio.create_task(self._loop(), name="ledger")
        try:
            yield self
        finally:
            self._stopping = True
            self._wake.set()
            await task

    async def _loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_s)
            self._wake.clear()
            await self.flush()
            if not self._stopping:
                await self._prune_now_and_then()
        await self.flush()

    async def flush(self) -> int:
        """Write every call held; how many were written (0 if PostgreSQL
        refused them: they are kept for the next try)."""
        fresh, self._rows = self._rows, []
        rows, self._unwritten = self._unwritten + fresh, []
        ended, self._ended = self._ended, []
        sent_before = time.time() - self.in_flight_after_s
        sends = [
            sent for sent in self._in_flight if not sent.written and sent.call.at <= sent_before
        ]
        if not (rows or ended or sends):
            await self._count(fresh)
            return 0
        for sent in sends:
            # Named before the statement goes: a call ending while it runs
            # deletes its row with the next batch.
            sent.call_id = sent.call_id or str(uuid.uuid4())
        try:
            await self._insert(rows, sends, ended)
        except (psycopg.Error, StatementTimeout, OSError) as exc:
            self._keep(rows)
            self._ended = ended + self._ended
            log.warning("ledger.not_written", rows=len(rows), error=type(exc).__name__)
            return 0
        finally:
            await self._count(fresh)
        for sent in sends:
            sent.written = True
        return len(rows)

    async def _count(self, fresh: Sequence[Call]) -> None:
        """Each call's spend against its tenant's budgets, once, written or
        not; what Redis did not take is added with the next batch."""
        if self.budgets is None or not (fresh or self._uncounted):
            return
        spent, jobs = _spent_by_tenant_day(fresh)
        for key, more in self._uncounted.items():
            spent[key] = spent.get(key, Spent()) + more
        self._uncounted = {}
        if spent:
            self._uncounted = await self.budgets.add(spent, jobs)

    async def _insert(
        self, rows: Sequence[Call], sends: Sequence[Sending] = (), ended: Sequence[str] = ()
    ) -> None:
        """One statement: the ended calls' ``sent`` rows out, the calls in
        flight in (once each), the ended calls' rows in."""
        document = Jsonb([row.to_json() for row in rows] + [sent.to_json() for sent in sends])
        await run_statement(
            self.pool,
            query("insert_model_calls"),
            {"rows": document, "ended": list(ended)},
            timeout_s=self.statement_timeout_s,
        )

    def _keep(self, rows: list[Call]) -> None:
        """Keep a batch that was not written for the next try, within ``max_rows``."""
        over = len(rows) - self.max_rows
        if over > 0:
            self.dropped += over
            log.error("ledger.rows_dropped", rows=over, dropped=self.dropped)
            rows = rows[over:]
        self._unwritten = rows

    async def _prune_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._pruned_at < _PRUNE_EVERY_S:
            return
        self._pruned_at = now
        try:
            await self.prune()
        except (psycopg.Error, StatementTimeout, OSError) as exc:
            log.warning("ledger.prune_failed", error=type(exc).__name__)

    async def prune(self) -> int:
        """Delete rows older than the retention (by PostgreSQL's clock, which
        wrote their ``created_at``), a batch at a time; how many."""
        total = 0
        while True:
            result = await run_statement(
                self.pool,
                query("prune_model_calls"),
                (self.retention_s, _PRUNE_BATCH),
                timeout_s=self.statement_timeout_s,
            )
            total += result.rowcount
            if result.rowcount < _PRUNE_BATCH:
                return total


def _spent_by_tenant_day(
    rows: Sequence[Call],
) -> tuple[dict[tuple[str, str], Spent], dict[tuple[str, str], list[str]]]:
    """What a batch adds to each tenant's day, and the jobs whose budget
    reservations it releases; shadow calls are nobody's."""
    spent: dict[tuple[str, str], Spent] = {}
    jobs: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        if row.site.shadow or not row.site.tenant:
            continue
        key = (row.site.tenant, utc_day(row.at))
        tokens = row.prompt_tokens + row.completion_tokens
        spent[key] = spent.get(key, Spent()) + Spent(tokens, row.cost_usd or 0.0)
        if row.site.job_id and row.site.job_id not in jobs.setdefault(key, []):
            jobs[key].append(row.site.job_id)
    return spent, jobs


# -- reading -------------------------------------------------------------------------


async def usage_report(
    pool: AsyncConnectionPool,
    *,
    since: datetime,
    by: GroupBy = "workflow",
    tenant: str | None = None,
    timeout_s: float = 30.0,
) -> list[UsageRow]:
    """Calls since ``since`` grouped ``by``: calls, tokens, cost, wasted
    calls, the cache's tokens and savings."""
    result = await run_statement(
        pool,
        query("usage_report"),
        {"since": since, "by": by, "tenant": tenant},
        timeout_s=timeout_s,
    )
    return [
        UsageRow(
            str(group),
            int(calls),
            int(prompt),
            int(completion),
            None if cost is None else float(cost),
            int(wasted),
            int(cached),
            int(written),
            None if saved is None else float(saved),
            None if lane_saved is None else float(lane_saved),
        )
        for (
            group,
            calls,
            prompt,
            completion,
            cost,
            wasted,
            cached,
            written,
            saved,
            lane_saved,
        ) in result.rows
    ]


async def erase_tenant(pool: AsyncConnectionPool, tenant: str, *, timeout_s: float = 60.0) -> int:
    """Delete the tenant's rows; how many."""
    result = await run_statement(
        pool, query("erase_tenant_model_calls"), (tenant,), timeout_s=timeout_s
    )
    return result.rowcount
