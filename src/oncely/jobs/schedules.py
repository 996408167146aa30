"""Schedules: a workflow's job started at every tick of its timetable,
exactly once across the fleet (docs/fanout.md, Schedules).

Only this module runs SQL on the ``schedules`` table (``sql/schedules.sql``).

Every worker process runs this service. Each pass reads the schedules'
rows; a tick that has come (the latest at or before now, after the row's
``last_tick``; now is this process's clock, never ahead of PostgreSQL's,
and the claim itself refuses a tick PostgreSQL's clock has not reached)
is claimed by the update that moves ``last_tick`` forward,
which one process wins, and the tick's job is recorded in the same
transaction, as the intake would record a ``POST`` with the idempotency
key ``schedule:<workflow>:<tick>`` for tenant ``ONCELY_SCHEDULE_TENANT``.
The job is enqueued after the commit; a crash in between leaves a queued
row without a message, which the reconciler restores.

Ticks missed while every process was down: only the latest runs, once
(``ONCELY_SCHEDULE_CATCH_UP=latest``), or none (``none``: a tick more than
``MISSED_AFTER_S`` old when first seen is skipped). A schedule seen for
the first time starts after the tick before now.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import psycopg
import structlog
from psycopg.types.json import Jsonb

from oncely.identity import Scope, fingerprint
from oncely.jobs.records import JobSpec
from oncely.jobs.store import Jobs
from oncely.redis_client import call_together
from oncely.services import Progress
from oncely.sql import query
from oncely.sql.bounded import run_statement, run_transaction
from oncely.timetable import Timetable

if TYPE_CHECKING:
    from oncely.workflow import Workflow

log = structlog.get_logger("oncely.schedules")

CatchUp = Literal["latest", "none"]
# A tick older than this when first seen was missed (every process was down).
MISSED_AFTER_S = 60.0


@dataclass(frozen=True)
class Scheduled:
    """A workflow on a timetable: its name and route (the job's identity),
    and its request for a tick (JSON)."""

    workflow: str
    route: str
    timetable: Timetable
    request: Callable[[datetime], dict[str, Any]]

    def key(self, tick: datetime) -> str:
        """The tick's idempotency key."""
        return f"schedule:{self.workflow}:{tick.astimezone(UTC).isoformat()}"

    def job_id(self, tenant: str, tick: datetime) -> str:
        return str(Scope(tenant, "POST", self.route, self.key(tick)).job_id)


def scheduled(workflows: Iterable[Workflow[Any, Any]]) -> list[Scheduled]:
    """The workflows that run on a timetable."""
    return [
        Scheduled(w.name, w.route, w.timetable, w.scheduled_request)
        for w in workflows
        if w.timetable is not None
    ]


@dataclass(frozen=True)
class ScheduleState:
    """A schedule as ``oncely schedules list`` shows it."""

    workflow: str
    expression: str
    tz: str
    last_tick: datetime | None
    last_job_id: str | None
    next_tick: datetime


class Scheduler:
    def __init__(
        self,
        jobs: Jobs,
        scheduled: Sequence[Scheduled],
        *,
        tenant: str = "scheduler",
        catch_up: CatchUp = "latest",
        every_s: float = 1.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.jobs = jobs
        self.scheduled = {s.workflow: s for s in scheduled}
        self.tenant = tenant
        self.catch_up = catch_up
        self.every_s = every_s
        self.clock = clock
        self.progress = Progress()
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        while not self._stopping.is_set():
            self.progress.tick()
            try:
                await self.run_once()
            except psycopg.Error as exc:
                log.warning("schedules.failed", error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.every_s)

    def stop(self) -> None:
        self._stopping.set()

    async def run_once(self) -> list[JobSpec]:
        """Start the job of every tick that has come; the jobs this process
        started."""
        if not self.scheduled:
            return []
        known, now = await self._known()
        started = []
        for s in self.scheduled.values():
            latest = s.timetable.latest(now)
            row = known.get(s.workflow)
            if row is None or row[0] != s.timetable.expression:
                await self._start(s, latest if row is None else row[1])
                continue
            last = row[1]
            if last is not None and latest <= last:
                continue
            missed = (now - latest).total_seconds() > MISSED_AFTER_S
            job = await self._claim(s, latest, run=not (missed and self.catch_up == "none"))
            if job is not None:
                started.append(job)
        if started:
            redis = self.jobs.streams[started[0].kind].redis
            await call_together(redis, [self.jobs.enqueue_call(j) for j in started])
        return started

    async def states(self) -> list[ScheduleState]:
        """Every schedule: its last tick and job, and its next tick."""
        known, now = await self._known()
        found = []
        for s in self.scheduled.values():
            _, last, last_job = known.get(s.workflow, (None, None, None))
            latest = s.timetable.latest(now)
            due = last is not None and latest > last
            found.append(
                ScheduleState(
                    s.workflow,
                    s.timetable.expression,
                    s.timetable.tz,
                    last,
                    None if last_job is None else str(last_job),
                    latest if due else s.timetable.following(now),
                )
            )
        return found

    async def _known(self) -> tuple[dict[str, tuple[str, datetime | None, Any]], datetime]:
        """The schedules' rows, and the time ticks are read at: this
        process's clock, but never ahead of PostgreSQL's (a process whose
        clock runs ahead must not start ticks early, nor move a schedule
        past ticks that then run nowhere)."""
        rows = (
            await run_statement(
                self.jobs.pool,
                query("known_schedules"),
                {"workflows": list(self.scheduled)},
                timeout_s=self.jobs.statement_timeout_s,
            )
        ).rows
        now = min(self.clock(), rows[0][0])
        return {w: (e, last, job) for _, w, e, last, job in rows if w is not None}, now

    async def _start(self, s: Scheduled, tick: datetime | None) -> None:
        params = {"workflow": s.workflow, "expression": s.timetable.expression, "tick": tick}
        await run_statement(
            self.jobs.pool, query("start_schedule"), params, timeout_s=self.jobs.statement_timeout_s
        )

    async def _claim(self, s: Scheduled, tick: datetime, *, run: bool) -> JobSpec | None:
        """Claim ``tick`` and record its job (``run``) or skip it; the job
        if this process recorded it."""
        payload = s.request(tick) if run else None
        job = JobSpec(s.job_id(self.tenant, tick), self.tenant, s.workflow, payload or {})
        params = {
            "workflow": s.workflow,
            "tick": tick,
            "job_id": job.job_id if run else None,
            "tenant": self.tenant,
            "kind": s.workflow,
            "payload": Jsonb(payload),
            "fingerprint": fingerprint(payload),
        }

        async def work(conn: psycopg.AsyncConnection[Any]) -> bool:
            cur = await conn.execute(query("claim_tick"), params)
            if await cur.fetchone() is None or not run:
                return False
            cur = await conn.execute(query("insert_scheduled_job"), params)
            return await cur.fetchone() is not None

        recorded = await run_transaction(
            self.jobs.pool, work, timeout_s=self.jobs.statement_timeout_s
        )
        if not run:
            log.info("schedule.skipped", workflow=s.workflow, tick=tick.isoformat())
            return None
        if recorded:
            log.info(
                "schedule.started", workflow=s.workflow, tick=tick.isoformat(), job_id=job.job_id
            )
            return job
        return None
