"""The ``jobs``, ``results`` and ``job_deliveries`` tables, and the one way a
job gets dispatched.

Only this module runs SQL on those tables. PostgreSQL is the record of
acceptance and Redis only the dispatch path, so every way into a stream goes
through ``Jobs``: ``accept`` inserts the row then enqueues (the intake
does the two as ``record`` then ``enqueue_call``, the enqueue sent in one
round trip with the stored response), ``replay`` sets a dead job back to
queued then enqueues (operators), and ``restore`` enqueues a job whose row
is still queued but whose message Redis lost (the reconciler). A crash
between the two steps leaves a queued row without a message, which the
reconciler puts back; never a message without a row.

Every statement is bounded on the client as well as on the server
(``statement_timeout``): a frozen server never enforces its own timeout.
An intake whose insert got no answer is answered 503, so ``record`` then
*withdraws* it in the background: once PostgreSQL answers again, the
attempt is recorded as unanswered on its row, which becomes ``withdrawn``
once every attempt that touched it (its writer and the retries that adopted
it) was unanswered; if the insert has not landed yet, a ``withdrawn`` row
is written first so that the late insert changes nothing. A withdrawn row is
never dispatched, reads as 404, and a retry with the same key takes it over.

A job's deliveries are recorded without a round trip of their own on the
happy path: the successful one by the statement that stores the result
(``finish``), the failed ones by the worker when it settles them
(``record_deliveries``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg
import structlog
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from redis.exceptions import RedisError

from oncely import tracing
from oncely.batching import GroupRead, each_at_fault
from oncely.errors import NotInApp, RequestInProgress
from oncely.jobs.records import (
    Acceptance,
    DeadJob,
    DeliveryRecord,
    DeliveryReport,
    JobDetail,
    JobRecord,
    JobSpec,
)
from oncely.jobs.rows import delivery_fields, effect_rows, step_summary, utc_moment
from oncely.jobs.transitions import Transitions
from oncely.journal import Writes
from oncely.queue.stream import JobMessage, Stream
from oncely.redis_client import ScriptCall, call_together
from oncely.sql import query
from oncely.sql.bounded import StatementResult, outcome_unknown, run_statement
from oncely.statuses import ROW_STATUSES

log = structlog.get_logger("oncely.jobs")

_ERROR_CHARS = 2000
NOTHING = Writes()
# Withdrawals retry while PostgreSQL does not answer: first after this long,
# doubling up to the cap.
_WITHDRAW_RETRY_S = (0.2, 2.0)
# A batch's errors that are one delivery's own fault (a value PostgreSQL
# refuses): that delivery alone gets them.
_RESULT_FAULTS = (psycopg.errors.DataError,)
# Accepted jobs whose enqueue failed that one process retries itself.
_REDISPATCH_MAX = 10_000


class Jobs:
    def __init__(
        self,
        pool: AsyncConnectionPool,
        streams: Mapping[str, Stream],
        *,
        statement_timeout_s: float = 10.0,
        transitions: Transitions | None = None,
    ) -> None:
        self.pool = pool
        # workflow name -> its stream
        self.streams = streams
        # Told of every status change made through these stores.
        self.transitions = transitions or Transitions()
        # The client-side bound on every statement (ONCELY_PG_STATEMENT_TIMEOUT_S).
        self.statement_timeout_s = statement_timeout_s
        self._withdrawals = _Withdrawals(self._run)
        self._redispatch = _Redispatch(streams)
        # Results finished while one statement runs share the next one.
        self._finished: GroupRead[dict[str, Any], int, bool | Exception] = GroupRead(
            self._finish_batch, key=id
        )

    async def _run(self, name: str, params: Any = None) -> StatementResult:
        return await run_statement(
            self.pool, query(name), params, timeout_s=self.statement_timeout_s
        )

    # -- dispatch: the row first, then the stream ------------------------------

    async def accept(self, job: JobSpec, *, fingerprint: str | None = None) -> Acceptance:
        """Record the job, then enqueue it. Idempotent per job id. Once the
        row is committed the job is accepted: a failed enqueue is logged and
        left to the reconciler. (The intake does the two steps itself, to
        send the enqueue with its stored response: ``api/workflows.py``.)"""
        acceptance = await self.record(job, fingerprint=fingerprint)
        if acceptance.fresh:
            await call_together(self.streams[job.kind].redis, [self.enqueue_call(job)])
        return acceptance

    async def record(self, job: JobSpec, *, fingerprint: str | None = None) -> Acceptance:
        """The intake's first step: one statement inserts the row with the
        request's ``fingerprint``, or answers the row already there. A fresh
        row must then be enqueued (``enqueue_call``, or ``accept`` does
        both); a row that was there is not (a lost message is the
        reconciler's to restore). An insert whose outcome is unknown is
        withdrawn (module docstring)."""
        token = uuid.uuid4()
        params = {
            "job_id": job.job_id,
            "tenant": job.tenant,
            "kind": job.kind,
            "payload": Jsonb(job.payload),
            "fingerprint": fingerprint,
            "token": token,
        }
        try:
            result = await self._run("accept_job", params)
        except BaseException as exc:
            if outcome_unknown(exc):
                self._withdrawals.add(job, token)
            raise
        return _acceptance(result)

    def enqueue_call(self, job: JobSpec) -> ScriptCall:
        """The enqueue of a recorded job, to send with other writes in one
        round trip (``redis_client.call_together``). Its failure is logged:
        the row is the record of acceptance, and this process dispatches it
        again as soon as Redis answers (the reconciler would, later)."""

        def failed(exc: RedisError) -> None:
            log.warning("jobs.enqueue_failed", job_id=job.job_id, error=type(exc).__name__)
            self._redispatch.add(job)

        message = JobMessage.new(job.job_id, job.tenant, job.payload)
        return self.streams[job.kind].enqueue_call(message, on_error=failed)

    async def finish_withdrawals(self, within_s: float) -> None:
        """Wait up to ``within_s`` for pending withdrawals (shutdown)."""
        await self._withdrawals.finish(within_s)

    async def replay(self, job: JobSpec) -> bool:
        """A dead job back to queued, then enqueued; False if it was not dead.
        ``NotInApp`` (nothing changed) for a workflow this app does not have."""
        if job.kind not in self.streams:
            raise NotInApp(job.kind)
        result = await self._run("mark_job_requeued", (job.job_id,))
        # A cancel remembered from an earlier run must not stop this one.
        await self.streams[job.kind].forget_cancel(job.job_id)
        await self._enqueue(job)
        if result.rowcount == 0:
            return False
        self.transitions.changed(job.kind, job.job_id, "queued")
        return True

    async def restore(self, job: JobSpec) -> None:
        """A queued job whose message is gone, enqueued again (same job id)."""
        await self._enqueue(job)

    async def _enqueue(self, job: JobSpec) -> None:
        await self.streams[job.kind].enqueue(JobMessage.new(job.job_id, job.tenant, job.payload))

    # -- the worker's side -----------------------------------------------------

    async def finish(
        self,
        workflow: str,
        job_id: str,
        result: Mapping[str, Any],
        usage: Mapping[str, int] | None,
        writes: Writes = NOTHING,
        *,
        generation: int = 0,
        delivery: DeliveryReport | None = None,
    ) -> bool:
        """Store ``done``, the result with the run's unwritten checkpoints
        (kept in the result's row: a done job is never replayed) and the
        emitted outbox rows atomically, with ``delivery`` in the job's
        history (same statement). False when nothing was stored: another
        delivery stored this job's result first, or the job no longer runs
        in this ``generation`` (cancelled, dead, rerun); then nothing of this
        delivery is written but its history row, as ``duplicate``."""
        finished = {
            "job_id": job_id,
            "workflow": workflow,
            "generation": generation,
            "result": result,
            "usage": usage,
            "steps": [step_summary(c) for c in writes.checkpoints] or None,
            "effects": effect_rows(writes),
            # The relay's send continues the delivery's trace.
            "trace_context": tracing.traceparent(),
            **delivery_fields(delivery),
        }
        outcome = await self._finished.read(finished)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome is True

    async def _finish_batch(self, batch: list[dict[str, Any]]) -> dict[int, bool | Exception]:
        """``finish_job`` for every delivery in ``batch`` (GroupRead's
        flush): whether each stored its result, by ``id``. A job finished
        twice in one batch has its second delivery go in the next
        statement; a value PostgreSQL refuses fails its own delivery only."""
        first: dict[str, dict[str, Any]] = {}
        later = []
        for row in batch:
            if row["job_id"] in first:
                later.append(row)
            else:
                first[row["job_id"]] = row
        outcomes = await each_at_fault(self._finish_rows, list(first.values()), _RESULT_FAULTS)
        return outcomes | (await self._finish_batch(later) if later else {})

    async def _finish_rows(self, rows: list[dict[str, Any]]) -> dict[int, bool]:
        numbered = [{**row, "n": n} for n, row in enumerate(rows)]
        answered = (await self._run("finish_job", {"finished": Jsonb(numbered)})).rows
        stored = {n for (n,) in answered}
        return {id(row): n in stored for n, row in enumerate(rows)}

    async def mark_dead(self, job_id: str, reason: str, generation: int | None = None) -> bool:
        """The job dead with ``reason``, if it still runs in ``generation``
        (any, when None). True when it died here and is a map's child (its
        end must be counted in its map: ``Children.settle``)."""
        params = {"error": reason[:_ERROR_CHARS], "job_id": job_id, "generation": generation}
        rows = (await self._run("mark_job_dead", params)).rows
        return bool(rows) and rows[0][0] is not None

    async def record_deliveries(self, reports: Sequence[DeliveryReport]) -> None:
        """Failed deliveries into their jobs' histories, in one statement.
        Reports naming no job id (a malformed message) are left out."""
        reports = [r for r in reports if _is_uuid(r.job_id)]
        if not reports:
            return
        params = {
            "job_ids": [r.job_id for r in reports],
            "deliveries": [r.number for r in reports],
            "consumers": [r.consumer for r in reports],
            "started_at": [utc_moment(r.started_at) for r in reports],
            "outcomes": [r.outcome for r in reports],
            "errors": [r.error for r in reports],
            "model_calls": [r.model_calls for r in reports],
        }
        await self._run("record_deliveries", params)

    # -- readers ---------------------------------------------------------------

    async def get(self, kind: str, job_id: uuid.UUID, tenant: str) -> JobRecord | None:
        """The job, only if it is of this workflow and this tenant's."""
        rows = (await self._run("get_job", (job_id, tenant, kind))).rows
        return JobRecord(*rows[0]) if rows else None

    async def dead(self, kind: str, limit: int) -> list[DeadJob]:
        """The workflow's dead jobs, newest first."""
        rows = (await self._run("dead_jobs", {"kind": kind, "limit": limit})).rows
        return [DeadJob(*row) for row in rows]

    async def dead_job(self, job_id: uuid.UUID, kind: str | None = None) -> JobSpec | None:
        """A dead job, to replay (of workflow ``kind`` if given)."""
        rows = (await self._run("dead_job", {"job_id": job_id, "kind": kind})).rows
        if not rows:
            return None
        found, tenant, k, payload = rows[0]
        return JobSpec(str(found), tenant, k, payload)

    async def stale_queued(
        self,
        kind: str,
        older_than_s: float,
        limit: int,
        after: tuple[datetime, str] | None = None,
    ) -> tuple[list[JobSpec], tuple[datetime, str] | None]:
        """A page of the workflow's jobs queued longer than ``older_than_s``,
        oldest first, after the cursor ``after``; and the cursor of the next
        page (None: this was the last)."""
        params = {
            "kind": kind,
            "age_s": older_than_s,
            "limit": limit,
            "after_at": after[0] if after else None,
            "after_id": after[1] if after else None,
        }
        rows = (await self._run("queued_jobs_older_than", params)).rows
        jobs = [JobSpec(str(job_id), tenant, k, payload) for job_id, tenant, k, payload, _ in rows]
        cursor = (rows[-1][4], str(rows[-1][0])) if len(rows) == limit else None
        return jobs, cursor

    async def counts(self) -> dict[str, dict[str, int]]:
        """Jobs by workflow and status (withdrawn intakes are not jobs)."""
        rows = (await self._run("jobs_by_kind_and_status")).rows
        counts: dict[str, dict[str, int]] = {}
        for kind, status, n in rows:
            counts.setdefault(kind, dict.fromkeys(ROW_STATUSES, 0))[status] = int(n)
        return counts

    async def recent(
        self,
        kind: str | None,
        status: str | None,
        limit: int,
        reason: str | None = None,
        *,
        parent: uuid.UUID | None = None,
    ) -> list[JobRecord]:
        """Jobs of any tenant, newest first: of a workflow, a status, a dead
        reason (``nondeterministic``) and a parent (a map's children) when
        given."""
        params: dict[str, Any] = {"kind": kind, "status": status, "limit": limit}
        params |= {"reason": reason, "parent": parent}
        rows = (await self._run("list_jobs", params)).rows
        return [JobRecord(*row) for row in rows]

    async def detail(self, kind: str | None, job_id: uuid.UUID) -> JobDetail | None:
        """The job with its request, whatever its tenant: for operators only.
        Of workflow ``kind``, or of any when None."""
        rows = (await self._run("get_job_for_operator", {"job_id": job_id, "kind": kind})).rows
        return JobDetail(*rows[0]) if rows else None

    async def deliveries(self, job_id: uuid.UUID) -> list[DeliveryRecord]:
        """The job's deliveries that reported back, oldest first."""
        rows = (await self._run("job_deliveries", (job_id,))).rows
        return [DeliveryRecord(*row) for row in rows]

    # -- lifecycle ---------------------------------------------------------------

    async def purge_finished(self, older_than_s: float, batch: int = 1000) -> int:
        """Delete finished jobs (with results, outbox rows and deliveries) last changed
        more than ``older_than_s`` ago whose effects have all been sent,
        ``batch`` per statement; how many jobs went."""
        total = 0
        for name in ("purge_finished_jobs", "purge_withdrawn_jobs"):
            while True:
                result = await self._run(name, {"age_s": older_than_s, "batch": batch})
                total += max(result.rowcount, 0)
                if result.rowcount < batch:
                    break
        return total

    async def erase_tenant(self, tenant: str) -> dict[str, int]:
        """Every job, result, outbox row, delivery, checkpoint and event of
        ``tenant``; the counts deleted."""
        result = await self._run("erase_tenant_jobs", {"tenant": tenant})
        row = result.rows[0] if result.rows else None
        names = ("jobs", "results", "outbox", "deliveries", "checkpoints", "events")
        return dict(zip(names, (int(n) for n in row or (0,) * len(names)), strict=True))


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _acceptance(result: StatementResult) -> Acceptance:
    if not result.rows:
        # The row appeared after this statement's snapshot: another request
        # with the same key is recording it right now.
        raise RequestInProgress("a request with this Idempotency-Key is still running")
    fresh, fingerprint = result.rows[0]
    return Acceptance(bool(fresh), fingerprint)


class _Withdrawals:
    """Intakes answered 503 whose insert may still land, withdrawn together
    in one statement per round until PostgreSQL answers (docs/decisions.md:
    "Truthful 503"). A task runs only while some are pending."""

    def __init__(self, run: Callable[[str, Any], Awaitable[StatementResult]]) -> None:
        self._run = run
        # job id -> (job, the attempts' intake tokens)
        self._pending: dict[str, tuple[JobSpec, list[uuid.UUID]]] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, job: JobSpec, token: uuid.UUID) -> None:
        self._pending.setdefault(job.job_id, (job, []))[1].append(token)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())
            self._task.add_done_callback(_log_death)

    async def finish(self, within_s: float) -> None:
        task = self._task
        if task is None or task.done():
            return
        await asyncio.wait({task}, timeout=within_s)
        if self._pending:
            # The API stops here: these rows, if they landed, will run.
            log.error("intake.withdrawals_abandoned", job_ids=sorted(self._pending))
            task.cancel()

    async def _drain(self) -> None:
        delay, cap = _WITHDRAW_RETRY_S
        while self._pending:
            # One token per job per round: a statement may touch a row once.
            batch = [(job, tokens[0]) for job, tokens in self._pending.values()]
            try:
                result = await self._run("withdraw_jobs", _withdraw_params(batch))
            except (psycopg.Error, PoolTimeout) as exc:
                log.warning("intake.withdraw_retrying", jobs=len(batch), error=type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)
                continue
            self._done(batch, {str(job_id) for job_id, undone in result.rows if undone})

    def _done(self, batch: list[tuple[JobSpec, uuid.UUID]], undone: set[str]) -> None:
        for job, token in batch:
            tokens = self._pending[job.job_id][1]
            tokens.remove(token)
            if not tokens:
                del self._pending[job.job_id]
            # "undone": the insert had landed; without this the job would run.
            log.info("intake.withdrawn", job_id=job.job_id, undone=job.job_id in undone)


class _Redispatch:
    """Accepted jobs whose enqueue failed, dispatched again by this process
    as soon as Redis answers, not a reconcile pass later (docs/production.md,
    "Failover"). The enqueue skips a job the index already knows (its lost
    reply may hide a landed XADD). Bounded: past ``_REDISPATCH_MAX`` jobs,
    the rest are the reconciler's. A task runs only while some are pending."""

    def __init__(self, streams: Mapping[str, Stream]) -> None:
        self._streams = streams
        self._pending: dict[str, JobSpec] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, job: JobSpec) -> None:
        if len(self._pending) >= _REDISPATCH_MAX:
            return
        self._pending[job.job_id] = job
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())
            self._task.add_done_callback(_log_death)

    async def _drain(self) -> None:
        delay, cap = _WITHDRAW_RETRY_S
        while self._pending:
            job = next(iter(self._pending.values()))
            message = JobMessage.new(job.job_id, job.tenant, job.payload)
            try:
                await self._streams[job.kind].enqueue_unless_indexed(message)
            except RedisError as exc:
                log.info(
                    "jobs.redispatch_waiting", jobs=len(self._pending), error=type(exc).__name__
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)
                continue
            delay = _WITHDRAW_RETRY_S[0]
            del self._pending[job.job_id]
            log.info("jobs.redispatched", job_id=job.job_id)


def _withdraw_params(batch: list[tuple[JobSpec, uuid.UUID]]) -> dict[str, Any]:
    return {
        "job_ids": [job.job_id for job, _ in batch],
        "tenants": [job.tenant for job, _ in batch],
        "kinds": [job.kind for job, _ in batch],
        "tokens": [token for _, token in batch],
    }


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("intake.withdraw_failed", exc_info=exc)
