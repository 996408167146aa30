"""The reference workflow: summarise a text, store it once, queue one email.

The job handler (DESIGN §5 steps 1–3; the worker acknowledges, step 4):
1. a summary already stored for this job → nothing to do, no model call;
2. the model call, with classified retries under the delivery's deadline;
3. one transaction: the summary (``ON CONFLICT DO NOTHING RETURNING``) and,
   only for the delivery that inserted it, the outbox row and ``done``.
A duplicate delivery racing this one loses at step 3 and writes nothing.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.batching import GroupCommit
from oncely.errors import PermanentError
from oncely.llm.base import LLM, build_summary_prompt
from oncely.queue.stream import JobMessage
from oncely.retry import Deadline, call_with_retries
from oncely.sql import query

if TYPE_CHECKING:
    from oncely.queue.worker import Delivery
    from oncely.settings import Settings

log = structlog.get_logger("oncely.workflow")

SUMMARY_READY = "email.summary_ready"
NOTIFY_CHANNEL = "oncely_outbox"


def dedupe_key(job_id: str) -> str:
    return f"summary_ready:{job_id}"


class StoredSummaries:
    """Answers "is a summary stored for this job?" for many handlers at once:
    questions asked while one query runs share the next, so the pre-check
    costs a fraction of a round trip per job under load."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        self._lookup: GroupCommit[str, str] = GroupCommit(self._stored, key=lambda job_id: job_id)

    @property
    def queries(self) -> int:
        return self._lookup.flushes

    async def exists(self, job_id: str) -> bool:
        return await self._lookup(job_id)

    async def _stored(self, job_ids: list[str]) -> set[str]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("summaries_stored"), (job_ids,))
            return {str(row[0]) for row in await cur.fetchall()}


class OutboxWakeUp:
    """``NOTIFY oncely_outbox`` after commits, one per burst: while one is on
    its way, later commits only ask for one more. A lost wake-up costs the
    relay's poll interval, never a notification."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        self.sent = 0
        self._wanted = False
        self._task: asyncio.Task[None] | None = None

    def soon(self) -> None:
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._send())

    async def _send(self) -> None:
        while self._wanted:
            self._wanted = False
            try:
                async with self.pool.connection() as conn:
                    await conn.execute(query("notify_outbox"))
                self.sent += 1
            except Exception as exc:
                log.warning("outbox.notify_failed", error=f"{type(exc).__name__}: {exc}")
                return


class SummaryJob:
    """The worker's handler for summary jobs."""

    def __init__(self, pool: AsyncConnectionPool, llm: LLM, settings: Settings) -> None:
        self.pool = pool
        self.llm = llm
        self.settings = settings
        self.stored = StoredSummaries(pool)
        self.wake_relay = OutboxWakeUp(pool)

    async def __call__(self, message: JobMessage, delivery: Delivery) -> str:
        if await self.stored.exists(message.job_id):
            return "duplicate"
        text = message.payload.get("text")
        notify = message.payload.get("notify")
        if not isinstance(text, str) or not isinstance(notify, str):
            raise PermanentError("payload needs text and notify")
        summary = await self._summarise(text)
        outcome = await self._store(message.job_id, notify, summary)
        if outcome == "done":
            self.wake_relay.soon()
        return outcome

    async def _summarise(self, text: str) -> str:
        s = self.settings
        prompt = build_summary_prompt(text)
        return await call_with_retries(
            lambda timeout: self.llm.complete(prompt, timeout),
            deadline=Deadline.after(s.job_budget_s),
            per_call_timeout_s=s.llm_timeout_s,
            max_attempts=s.llm_max_attempts,
            backoff_base_s=s.llm_backoff_base_s,
            backoff_max_s=s.llm_backoff_max_s,
            retry_after_max_s=s.llm_retry_after_max_s,
        )

    async def _store(self, job_id: str, notify: str, summary: str) -> str:
        params = {
            "job_id": job_id,
            "summary": summary,
            "topic": SUMMARY_READY,
            "dedupe_key": dedupe_key(job_id),
            "payload": Jsonb({"job_id": job_id, "to": notify, "summary": summary}),
        }
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("store_summary"), params)
            row = await cur.fetchone()
        return "done" if row is not None and row[0] else "duplicate"


async def mark_dead(pool: AsyncConnectionPool, job_id: str, reason: str) -> None:
    async with pool.connection() as conn:
        await conn.execute(query("mark_job_dead"), (reason[:2000], job_id))
